"""The staleness bound, ppo.max_head_offpolicyness = k: a step that trains at weight version v takes
only samples whose first token was sampled at version v - k or later (k = 0: strictly on-policy).

One policy answers every place that decides it: the batch and stream rollouts (rl/driver/rollout.py)
and the streaming engines' aborts at a weight update (rl/engine/weight_receive.py, inside the engine
actor, which is why it lives here and imports nothing).

    policy = Staleness.of(cfg.ppo)
    policy.too_stale(sample.version, at=state.version)   # never trained: generated again
    policy.oldest(version)                               # the engines abort requests begun before it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_kit.config.schema import PPOConfig


@dataclass(frozen=True)
class Staleness:
    k: int  # ppo.max_head_offpolicyness

    @classmethod
    def of(cls, ppo: PPOConfig) -> Staleness:
        return cls(ppo.max_head_offpolicyness)

    @property
    def batches_in_flight(self) -> int:
        """How many batches' worth of prompts may be generating, or generated and not yet trained:
        the one the next step trains on and k more, each from weights at most k versions old by then."""
        return self.k + 1

    def oldest(self, at: int) -> int:
        """The oldest weight version a step at version `at` may train on."""
        return at - self.k

    def too_stale(self, version: int, at: int) -> bool:
        """A sample begun at `version` can no longer be trained at version `at`."""
        return version < self.oldest(at)

    def last_chance(self, version: int, at: int) -> bool:
        """A sample begun at `version` is trained at version `at` or never (the next update makes it too stale)."""
        return version <= self.oldest(at)

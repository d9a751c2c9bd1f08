"""rollout.*: how the engines generate, batch by batch or streaming, and what a weight update does
to the generations in flight. A section of the training config (config/schema.py).

    areal-kit train tiny rollout.mode=stream rollout.interrupt=wait
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from areal_kit.config.fields import check, check_choices, opt


@dataclass
class RolloutConfig:
    mode: str = opt("batch",
        "batch: each engine generates a batch of prompts in one call, and the controller queues whole "
        "batches up to ppo.max_head_offpolicyness ahead of training. stream: engines run vLLM's AsyncLLM, "
        "the controller keeps up to (1 + max_head_offpolicyness) x train_bs_n_seqs prompts in flight or "
        "finished and not yet trained, a step trains on the first groups to finish, and new weights reach "
        "the engines while they generate (rollout.interrupt). Stream pays when answer lengths vary widely "
        "(reasoning models: a batch waits for its longest answer); on short, even answers (the tiny preset) "
        "its per-group calls cost more than they save (docs/presets.md: Streaming rollouts).",
        choices=("batch", "stream"))
    interrupt: str = opt("keep",
        "stream mode, when new weights arrive: keep = pause the engine with its requests in flight, load "
        "the weights, resume (tokens after the update come from the new weights; each sample records "
        "the version of every token); wait = in-flight requests finish on the old weights first.",
        choices=("keep", "wait"))
    max_restarts: int = opt(1,
        "stream mode: how often a group that outlived the staleness bound (a long answer that "
        "max_head_offpolicyness updates overtook) is generated again as any other before it is held: "
        "generated first, and trained by the step that is its last chance within the bound, which then "
        "waits for it. So no prompt is regenerated forever (the longest answers would never be trained); "
        "a higher value trades such waits for regenerated work.")

    def __post_init__(self) -> None:
        check_choices(self, "rollout.")
        check(isinstance(self.max_restarts, int) and self.max_restarts >= 0,
              f"rollout.max_restarts={self.max_restarts}; expected an integer >= 0")


class HasRollout(Protocol):
    """What `streaming` reads of a config: its rollout section (TrainConfig, config/schema.py, which
    imports this module: typed so, this module needs nothing of schema's)."""

    @property
    def rollout(self) -> RolloutConfig: ...


def streaming(cfg: HasRollout) -> bool:
    """Whether the run's engines stream (rollout.mode=stream)."""
    return cfg.rollout.mode == "stream"

"""When something periodic is due: the one rule for model saves, recover checkpoints and evals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """A schedule: every `steps` global steps, every `epochs` epochs (at an epoch's last step),
    every `secs` seconds; 0 (or None: a config's null before its check) turns each off."""

    steps: int | None = 0
    epochs: int | None = 0
    secs: float | None = 0.0

    def due(self, global_step: int, epoch: int = 0, end_of_epoch: bool = False, seconds_since: float = 0.0) -> bool:
        return bool((self.steps and global_step % self.steps == 0)
                    or (self.epochs and end_of_epoch and (epoch + 1) % self.epochs == 0)
                    or (self.secs and seconds_since >= self.secs))

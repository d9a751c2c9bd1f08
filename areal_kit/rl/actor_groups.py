"""What the driver's helpers outside rl/driver/ see of its actor groups (rl/driver/groups.py).

The weight sync's driver half (rl/weight_sync/sync.py, colocated.py) calls the trainer ranks and
the engines through the driver's TrainerGroup and EngineGroup, which import the workers, whose
trainer imports the weight sync's trainer half: typed against these protocols instead, the weight
sync imports nothing of driver/, and no import runs in a circle. The driver's groups fit them as
they are (mypy checks it where the driver hands its groups over).
"""

from __future__ import annotations

from typing import Protocol


class Watch(Protocol):
    """The driver's watchdog (rl/driver/watchdog.py), as far as a call through it goes."""

    def label(self, refs: list, names: list[str]) -> list:
        """Name the worker behind each ref, for a hang report; returns refs."""
        ...

    def wait(self, call: str, refs: list) -> list:
        """What the calls returned, or the first error (a hang: WorkerHang)."""
        ...


class Group(Protocol):
    """Actors of one kind: their Ray handles in order and their names (for the watchdog's reports)."""

    @property
    def actors(self) -> list: ...

    @property
    def names(self) -> list[str]: ...


class Trainers(Group, Protocol):
    """The trainer ranks (in rank order) and the watchdog over them."""

    @property
    def watchdog(self) -> Watch: ...

    def save_hf(self, path: str, merged: bool | None = None) -> None: ...


class Engines(Group, Protocol):
    """The rollout engines and each engine's devices (tp)."""

    @property
    def tp(self) -> int: ...

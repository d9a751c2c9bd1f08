"""The driver's calls to its Ray actors, typed: a call names the worker class's method itself, never
the method's name in a string, so mypy checks each call's arguments against the worker's
signature and types what comes back, and renaming a worker method breaks its callers at the check.

    trainers = Group[TrainerWorker](handles, watchdog, "trainer rank")
    ref = trainers.one(0, TrainerWorker.address)               # ObjectRef[tuple[str, int]]
    refs = trainers.each(TrainerWorker.ipc_start)              # one per rank, named for the watchdog
    starts = trainers.all(TrainerWorker.ipc_start)             # list[IpcStart], under the watchdog's bound

Ray's actor handles type their methods as Any; this module is the one place where a method object
becomes Ray's `handle.<name>.remote(...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from ray import ObjectRef

from areal_kit.rl.driver.watchdog import Watchdog

W = TypeVar("W")
P = ParamSpec("P")
R = TypeVar("R")


def remote(handle: Any, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]:
    """`handle.<method>.remote(*args, **kwargs)`, typed by the method."""
    return getattr(handle, method.__name__).remote(*args, **kwargs)


class Group(Generic[W]):
    """Actors of one worker class (W), in order, and the watchdog every wait on them goes through."""

    def __init__(self, actors: list[Any], watchdog: Watchdog, kind: str) -> None:
        self.actors = actors  # Ray actor handles (tests and Ray's own calls, such as ray.kill, use them)
        self.watchdog = watchdog
        self.names = [f"{kind} {i}" for i in range(len(actors))]

    def __len__(self) -> int:
        return len(self.actors)

    def one(self, i: int, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]:
        """Actor i's call, named for the watchdog."""
        return self.watchdog.label([remote(self.actors[i], method, *args, **kwargs)], [self.names[i]])[0]

    def each(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[ObjectRef[R]]:
        """The same call on every actor, each named for the watchdog."""
        return self.watchdog.label([remote(a, method, *args, **kwargs) for a in self.actors], self.names)

    def all(self, method: Callable[Concatenate[W, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """The same call on every actor, waited for under the watchdog's bound for the method."""
        return self.watchdog.wait(method.__name__, self.each(method, *args, **kwargs))

    def on_thread(self, i: int, group: str, method: Callable[Concatenate[W, P], R],
                  *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]:
        """Actor i's call on one of its concurrency groups (a thread of its own), named for the watchdog."""
        ref = getattr(self.actors[i], method.__name__).options(concurrency_group=group).remote(*args, **kwargs)
        return self.watchdog.label([ref], [self.names[i]])[0]

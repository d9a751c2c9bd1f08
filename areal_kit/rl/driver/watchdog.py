"""Hangs become failures: every wait on a worker call has a bound, and a call past it ends the attempt.

The loop waits on its workers through `Watchdog.wait(call, refs)`. The watchdog keeps how long
each kind of call took ("train_step", "generate", "weight sync", ...). The first calls of a
kind (compilation, caches) get `exp_ctrl.hang_first_s`; after them a call may take
`exp_ctrl.hang_factor` times the median of its kind, never less than `exp_ctrl.hang_floor_s` nor
more than `exp_ctrl.hang_ceiling_s` (when set).
A call past its bound is a hang: every worker writes its Python stacks (faulthandler, armed at
start on SIGUSR1, so a thread stuck in C code dumps too) into `<log dir>/stacks/`, and
`WorkerHang` names the worker, the call and how long it ran. The launcher stops the workers and
relaunches from the last recover checkpoint, as after a worker death.

    dog = Watchdog(cfg.exp_ctrl, stacks_dir)
    dog.arm({"trainer rank 0": (node, pid), ...})   # where each worker runs (its arm_stacks), for the dumps
    dog.wait("train_step", dog.label(refs, names))  # ray.get under the bound
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_kit.config.schema import ExpCtrl
from areal_kit.rl.common.stacks import STACK_SIGNAL

R = TypeVar("R")

HISTORY = 50  # the median of the last calls of a kind: a run whose steps slow down keeps a fair bound


class WorkerHang(RuntimeError):
    """A worker call ran past its bound."""


@ray.remote(num_cpus=0)
def _signal(pid: int) -> None:
    os.kill(pid, STACK_SIGNAL)


class Watchdog:
    def __init__(self, exp_ctrl: ExpCtrl, stacks_dir: str):
        self.factor = float(exp_ctrl.hang_factor)
        self.floor_s = float(exp_ctrl.hang_floor_s)
        self.first_s = float(exp_ctrl.hang_first_s)
        self.warmup = int(exp_ctrl.hang_warmup)
        self.ceiling_s = float(exp_ctrl.hang_ceiling_s) or float("inf")
        self.stacks_dir = stacks_dir
        self.took: dict[str, list[float]] = defaultdict(list)
        self._names: dict[str, str] = {}  # object ref -> worker, for the calls being waited on
        self._where: dict[str, tuple[str, int]] = {}  # worker -> (node id, pid)

    # -- bounds ------------------------------------------------------------------------------
    def bound(self, call: str) -> float | None:
        """Seconds a call of this kind may take now; None when the watchdog is off."""
        if self.factor <= 0:
            return None
        took = self.took[call]
        if len(took) < self.warmup:
            return self.first_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * statistics.median(took[-HISTORY:])))

    def record(self, call: str, seconds: float) -> None:
        self.took[call].append(seconds)

    # -- waiting -----------------------------------------------------------------------------
    def label(self, refs: list[ray.ObjectRef[R]], names: list[str]) -> list[ray.ObjectRef[R]]:
        """Name the worker behind each ref (a hang report names it); returns refs."""
        for r, n in zip(refs, names, strict=True):
            self._names[r.hex()] = n
        return refs

    def wait(self, call: str, refs: Sequence[ray.ObjectRef[R]]) -> list[R]:
        """What the calls returned, raising the first error as soon as it is in (a plain ray.get of
        a list can sit on a call stuck behind one that already failed), or WorkerHang."""
        t0 = time.monotonic()
        bound = self.bound(call)
        left = list(refs)
        got: dict[ray.ObjectRef[R], R] = {}
        try:
            while left:
                # Whatever is in already is read in one go (each read is a round trip for the driver);
                # else the first to come in, and the next round takes what came with it.
                done, left = ray.wait(left, num_returns=len(left), timeout=0)
                if not done:
                    timeout = None if bound is None else max(0.0, t0 + bound - time.monotonic())
                    done, left = ray.wait(left, num_returns=1, timeout=timeout)
                    if not done:
                        assert bound is not None, "a wait without a bound returns a call"
                        self.hang(call, left, time.monotonic() - t0, bound)
                got.update(zip(done, ray.get(done)))  # each reply read once: a generation's samples are big
            self.record(call, time.monotonic() - t0)
            return [got[r] for r in refs]
        finally:
            for r in refs:
                self._names.pop(r.hex(), None)

    def forget(self, ref: ray.ObjectRef[R]) -> None:
        """A labelled call that was waited on elsewhere (streaming) is done."""
        self._names.pop(ref.hex(), None)

    def hang(self, call: str, pending: list, ran: float, bound: float) -> None:
        """Raise WorkerHang for the calls still pending, with every worker's stacks dumped."""
        who = sorted({self._names.get(r.hex(), "a worker") for r in pending})
        took = self.took[call]
        why = (f"{self.factor:g}x its median {statistics.median(took[-HISTORY:]):.1f}s, at least {self.floor_s:g}s"
               if len(took) >= self.warmup else f"exp_ctrl.hang_first_s for its first {self.warmup} calls")
        where = self.dump_stacks()
        raise WorkerHang(f"{', '.join(who)} ran {call} for {ran:.0f}s, past its bound of {bound:.0f}s ({why}); "
                         f"Python stacks of every worker in {where}")

    # -- stacks ------------------------------------------------------------------------------
    def arm(self, where: dict[str, tuple[str, int]]) -> set[int]:
        """Remember where each worker runs (its node id and pid, from its arm_stacks: the signal
        makes it dump its stacks). Returns the workers' pids on this node."""
        self._where.update(where)
        here = ray.get_runtime_context().get_node_id()
        return {pid for node, pid in where.values() if node == here}

    def dump_stacks(self) -> str:
        """Every armed worker's stacks, and the driver's own, into stacks_dir; returns it."""
        os.makedirs(self.stacks_dir, exist_ok=True)
        here = ray.get_runtime_context().get_node_id()
        remote = []
        for node, pid in self._where.values():
            try:
                if node == here:
                    os.kill(pid, STACK_SIGNAL)
                else:
                    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                    remote.append(_signal.options(scheduling_strategy=strategy).remote(pid))
            except ProcessLookupError:
                pass  # that worker is gone already: nothing to dump
        if remote:
            ray.wait(remote, num_returns=len(remote), timeout=30)
        with open(os.path.join(self.stacks_dir, "driver.txt"), "a") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        time.sleep(1.0)  # the workers write from their signal handlers; give them a moment
        return self.stacks_dir

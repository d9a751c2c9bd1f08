"""Which failures relaunch a run, and the relaunch loop rl/driver/launch.py runs each attempt in.

A relaunch restarts every worker from the last recover checkpoint. It helps where the failure is
of the moment rather than of the code: a worker process, actor or node that died, a call that
hung (the watchdog, rl/driver/watchdog.py), an out-of-memory (CUDA's caching allocator
fragments over a long run; a restart starts clean), a vLLM engine core process that died while
its actor lives, an NCCL error or a collective that timed out (a flaky link, a peer that
stalled), Ray's own start timing out (its processes slow to register on a loaded machine; the
relaunch starts Ray again). Anything else, our own bug included, would fail the same way on every relaunch and
surfaces at once. The same transient failure at the same step after the bound is not transient:
the run stops with one line naming it and what to change.

    kind = failure_kind(e)          # "worker death", "out of memory", ... or None: not retryable
    relaunching(run_once, retries=2, log=log, where=lambda: step)

Types are recognised by their qualified names, through Ray's RayTaskError chain and `raise ...
from` chains: the driver imports neither torch nor vLLM for it (its imports stay light while Ray
starts).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import ray.exceptions as rex

from areal_kit import hardware, logs
from areal_kit.errors import RunFailed, describe
from areal_kit.rl.driver.watchdog import WorkerHang

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig
    from areal_kit.runlog import RunLogger

T = TypeVar("T")

DEATH, OOM, ENGINE, COLLECTIVE = "worker death", "out of memory", "dead vLLM engine core", "NCCL/collective error"
RAY_START = "Ray's start timed out"
# Qualified names of the exception types of each kind (any class in an error's MRO).
TYPES = {
    OOM: {"torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"},
    ENGINE: {"vllm.v1.engine.exceptions.EngineDeadError"},
    COLLECTIVE: {"torch.distributed.DistError", "torch.distributed.DistBackendError",
                 "torch.distributed.DistNetworkError", "torch.distributed.DistStoreError"},
}
# The same failures where a library re-raised them as a plain RuntimeError: a CUDA kernel's
# "out of memory", NCCL's own error text, gloo's timeout of a collective (NCCL's stand-in on CPU).
MESSAGES = {
    OOM: re.compile(r"CUDA out of memory|CUDA error: out of memory"),
    COLLECTIVE: re.compile(r"NCCL error|Watchdog caught collective operation timeout|"
                           r"gloo/transport/\S+\] Timed out waiting"),
}
# A vLLM engine core process that died while the engine started (vllm/v1/engine/utils.py names each
# failed core with its exit code): killed by a signal (a negative code: the kernel's OOM killer, a
# segfault) it is of the moment, like a core that dies later; one that exited with a code raised an
# error of its own (its root cause logged above), which a relaunch would meet again.
ENGINE_START_DEATH = re.compile(r"Engine core initialization failed\..*Failed core proc\(s\): \{[^}]*: -\d+")
# Ray's start raises a bare Exception when its raylet has not registered with the GCS in 30 s
# (ray/_private/node.py): a machine too busy for its processes, not a setting of the run.
RAY_START_TIMEOUT = re.compile(r"^The current node timed out during startup")


class WorkerDied(RuntimeError):
    """A worker of the attempt died while another one's error was what surfaced."""


class StillFailing(RunFailed):
    """A transient failure that came back after every relaunch the run allows: one line, its fix
    (a RunFailed: written whole, as users read it, not cut as another error's first line is)."""


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """e, then what it wraps: a RayTaskError's cause, else the error it was raised from."""
    seen = set()
    while e is not None and id(e) not in seen:  # causes can nest; a cycle must not loop forever
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) if isinstance(e, rex.RayTaskError) else e.__cause__


def _names(e: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}


def failure_kind(e: BaseException) -> str | None:
    """The kind of a failure a relaunch can fix (DEATH, OOM, ENGINE, COLLECTIVE, RAY_START), or None.

    A RayTaskError only says a remote call raised: its cause may be our own bug (a ValueError in a
    trainer method), which would fail the same way on every relaunch, so only its cause decides.
    """
    deaths = (rex.RayActorError, rex.WorkerCrashedError, rex.ObjectLostError, rex.NodeDiedError,
              rex.LocalRayletDiedError, WorkerDied, WorkerHang)
    for x in _chain(e):
        if isinstance(x, deaths):
            return DEATH
        names = _names(x)
        for kind, types in TYPES.items():
            if names & types:
                return kind
        if not isinstance(x, rex.RayError) and RAY_START_TIMEOUT.match(str(x)):
            return RAY_START
        if isinstance(x, RuntimeError) and not isinstance(x, rex.RayError):
            first = str(x)[:2000]
            if ENGINE_START_DEATH.search(first):
                return ENGINE
            for kind, pattern in MESSAGES.items():
                if pattern.search(first):
                    return kind
    return None


def worker_died(e: BaseException) -> bool:
    """True when a worker process, actor or node died (or hung)."""
    return failure_kind(e) == DEATH


def engine_side(e: BaseException) -> bool:
    """Whether the failure came from a rollout engine's call (else a trainer's, or the driver's)."""
    return any(isinstance(x, rex.RayTaskError) and "RolloutWorker" in str(x).split("\n", 1)[0]
               for x in _chain(e)) or failure_kind(e) == ENGINE


def advice(kind: str, e: BaseException, cfg: TrainConfig | None = None) -> str:
    """What to change when `kind` keeps coming back: the memory plan's levers for an OOM (those
    of the side that ran out, with the run's values when cfg is given)."""
    if kind == OOM:
        side = "generation" if engine_side(e) else "trainer"
        if side == "generation":
            util = f" (now {cfg.actor.vllm.gpu_memory_utilization:g})" if cfg is not None else ""
            fix = (f"lower actor.vllm.gpu_memory_utilization{util} or actor.vllm.max_num_seqs, or more tensor "
                   "parallel in allocation_mode")
        else:
            from areal_kit.rl.memory import trainer_fixes

            fixes = (trainer_fixes(cfg.actor.zero_stage, cfg.actor.gradient_checkpointing,
                                   cfg.actor_train.mb_spec.max_tokens_per_mb) if cfg is not None else
                     ["actor.zero_stage=3", "actor.gradient_checkpointing=true",
                      "a smaller actor_train.mb_spec.max_tokens_per_mb"])
            fix = "set " + ", or ".join(fixes)
        return fix + _plan_figures(cfg, side)
    if kind == ENGINE:
        return ("see the engine core's own error above it in train.log (often an out-of-memory: lower "
                "actor.vllm.gpu_memory_utilization)")
    if kind == RAY_START:
        return ("Ray's processes did not register within its 30 s on this machine: free its CPUs (other jobs, "
                "a test suite), or start Ray first (ray start --head) and give the run ray_address=auto")
    if kind == COLLECTIVE:
        return ("check the nodes' network (NCCL_DEBUG=INFO names the failing link) or raise "
                "exp_ctrl.hang_first_s if a slow first step timed out")
    return "see the worker's error in train.log"


def _plan_figures(cfg: TrainConfig | None, side: str) -> str:
    """The memory plan's figures for the GPU that ran out, as `; the memory plan: ...`: what the
    run's settings put on it, against what it has (rl/plan.py; '' on CPU, or for a model of unknown shape)."""
    figures = ""
    if cfg is not None:  # rl/plan.py only then: launch.py imports this module while Ray starts
        from areal_kit.rl.plan import memory_figures

        figures = memory_figures(cfg, hardware.detect(), side)
    return f"; the memory plan: {figures}" if figures else ""


def gave_up(kind: str, e: BaseException, step: int | None, same: bool, retries: int,
            cfg: TrainConfig | None = None) -> StillFailing:
    """The one line for a failure that a relaunch did not fix."""
    at = f" at global step {step}" if step else ""
    again = " again" if same else ""
    return StillFailing(f"{kind}{at}{again} after {retries} relaunch(es), the bound recover_retries={retries}; a "
                  f"relaunch does not fix it: {advice(kind, e, cfg)} ({describe(e)})")


def relaunching(run_once: Callable[[int], T], retries: int, log: RunLogger, pause: float = 1.0,
                where: Callable[[], int | None] = lambda: None, cfg: TrainConfig | None = None) -> T:
    """run_once(attempt) again after a failure a relaunch can fix, up to `retries` times; anything
    else raises at once. where(): the global step the last attempt failed in (None: unknown).
    Past the bound, a worker death raises as it is; another kind raises StillFailing, naming the fix."""
    attempt, last = 0, None
    while True:
        try:
            return run_once(attempt)
        except Exception as e:
            kind = failure_kind(e)
            if kind is None:
                raise
            step = where()
            if attempt >= retries:
                if kind == DEATH or retries == 0:
                    raise
                raise gave_up(kind, e, step, last == (kind, step), retries, cfg) from e
            attempt, last = attempt + 1, (kind, step)
            at = f" in global step {step}" if step else ""
            cause = "" if kind == DEATH else f"{kind}{at}: "
            log.warning(logs.relaunch_line(f"{cause}{describe(e)}", attempt, retries))
            time.sleep(pause)

"""Faults the integration tests and the fault campaign inject, by environment variable (unset: nothing).

    AREAL_TEST_STALL=rank:step:marker             that rank stops before that step's first collective
    AREAL_TEST_RAISE=rank:step:marker:Type        that rank raises a real torch exception as the step starts
    AREAL_TEST_RAISE_SYNC=rank:version:marker:Type   ... as its process stages its first weight sync
                                                  (of that version: after a resume, the restored one)
    AREAL_TEST_RAISE_LOAD=rank:step:marker:Type   ... as it loads the recover checkpoint of that step
    AREAL_TEST_RAY_START_TIMEOUT=marker           the driver's Ray start raises Ray's own start timeout

Each fires once: the marker file it creates keeps a relaunched worker (or a re-run) from firing
again, and removing the marker arms it again (bench/faults.py does, fault after fault). A step or
version of `*` matches any. Type is OutOfMemoryError (torch's, what CUDA's allocator raises) or
DistBackendError (what an NCCL error or timeout raises): a CPU run cannot run out of GPU memory or
lose an NCCL link, so the tests raise the exception those failures raise, in the real actor, at
the real point of the run. This module imports nothing heavy: the driver calls it while Ray starts.
"""

from __future__ import annotations

import os
import time

_RAISE = ("AREAL_TEST_RAISE", "AREAL_TEST_RAISE_SYNC", "AREAL_TEST_RAISE_LOAD")


def _fires(var: str, rank: int, step: int) -> list[str] | None:
    """The spec's remaining fields when `var` names this rank and step and its marker is not there
    yet (the marker is then created); else None."""
    spec = os.environ.get(var, "")
    if not spec:
        return None
    r, g, rest = spec.split(":", 2)
    marker, *more = rest.rsplit(":", 1) if var in _RAISE else [rest]
    if int(r) != rank or g not in ("*", str(step)) or not _claim(marker):
        return None
    return more


def _claim(marker: str) -> bool:
    """Create marker; False when it was there already (the hook has fired)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _raise(var: str, rank: int, step: int, where: str) -> None:
    more = _fires(var, rank, step)
    if more is not None:  # torch only then: the driver calls this module while Ray starts
        import torch
        import torch.distributed as dist

        kind = {"OutOfMemoryError": torch.OutOfMemoryError, "DistBackendError": dist.DistBackendError}[more[0]]
        raise kind(f"(injected by {var} {where}) CUDA out of memory. Tried to allocate 2.00 GiB on rank {rank}"
                   if kind is torch.OutOfMemoryError else
                   f"(injected by {var} {where}) NCCL error on rank {rank}: remote process exited or there "
                   "was a network error")


def before_train_step(rank: int, step: int) -> None:
    _test_stall(rank, step)
    _raise("AREAL_TEST_RAISE", rank, step, f"as global step {step} starts")


_synced: set[int] = set()  # the ranks of this process that staged a weight sync


def before_sync(rank: int, version: int) -> None:
    """At a trainer rank's weight sync: only its process's first (a fresh run's after step 1, a
    resumed one's of the restored weights), the sync a run depends on before any generation."""
    first = rank not in _synced
    _synced.add(rank)
    if first:
        _raise("AREAL_TEST_RAISE_SYNC", rank, version, f"at the first weight sync (version {version})")


def before_load(rank: int, step: int) -> None:
    _raise("AREAL_TEST_RAISE_LOAD", rank, step, f"loading the recover checkpoint of global step {step}")


def before_ray_start() -> None:
    """Ray's start failing as it does on a machine too busy for its processes to register
    (ray/_private/node.py raises this bare Exception); retry.py must recognise it by its text."""
    marker = os.environ.get("AREAL_TEST_RAY_START_TIMEOUT", "")
    if marker and _claim(marker):
        timed_out = ("The current node timed out during startup. This could happen because some of the Ray "
                     "processes failed to startup. (injected by AREAL_TEST_RAY_START_TIMEOUT)")
        raise Exception(timed_out)  # noqa: TRY002  (Ray's own bare Exception)


def _test_stall(rank: int, step: int) -> None:
    """A rank stuck outside the collective, as the hang tests need: its peers wait inside it."""
    if _fires("AREAL_TEST_STALL", rank, step) is not None:
        time.sleep(3600)

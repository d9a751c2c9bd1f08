"""Faults the integration tests inject into a trainer rank, by environment variable (unset: nothing).

    AREAL_TEST_STALL=rank:step:marker        that rank stops before that step's first collective
    AREAL_TEST_RAISE=rank:step:marker:Type   that rank raises a real torch exception as the step starts

Each fires once per run: the marker file it creates keeps a relaunched worker from firing again.
Type is OutOfMemoryError (torch's, what CUDA's allocator raises) or DistBackendError (what an NCCL
error or timeout raises): a CPU run cannot run out of GPU memory or lose an NCCL link, so the
tests raise the exception those failures raise, in the real actor, at the real point of a step.
"""

from __future__ import annotations

import os
import time


def _fires(var: str, rank: int, step: int) -> list[str] | None:
    """The spec's remaining fields when `var` names this rank and step and its marker is not there
    yet (the marker is then created); else None."""
    spec = os.environ.get(var, "")
    if not spec:
        return None
    r, g, rest = spec.split(":", 2)
    marker, *more = rest.rsplit(":", 1) if var == "AREAL_TEST_RAISE" else [rest]
    if (int(r), int(g)) != (rank, step) or os.path.exists(marker):
        return None
    open(marker, "w").close()
    return more


def before_train_step(rank: int, step: int) -> None:
    _test_stall(rank, step)
    more = _fires("AREAL_TEST_RAISE", rank, step)
    if more is not None:
        import torch
        import torch.distributed as dist

        kind = {"OutOfMemoryError": torch.OutOfMemoryError, "DistBackendError": dist.DistBackendError}[more[0]]
        raise kind(f"(injected by AREAL_TEST_RAISE) CUDA out of memory. Tried to allocate 2.00 GiB on rank {rank}"
                   if kind is torch.OutOfMemoryError else
                   f"(injected by AREAL_TEST_RAISE) NCCL error on rank {rank}: remote process exited or there "
                   "was a network error")


def _test_stall(rank: int, step: int) -> None:
    """A rank stuck outside the collective, as the hang tests need: its peers wait inside it."""
    if _fires("AREAL_TEST_STALL", rank, step) is not None:
        time.sleep(3600)

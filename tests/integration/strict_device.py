"""Collectives that refuse tensors not on the trainer's device, as NCCL refuses host memory: trainer
code runs on CPU as if its device were a GPU (a plain module that test child processes import).

On CPU every tensor lives in host memory, so a tensor the code forgot to put on its device looks
like any other. A device label tells them apart: the test sets the trainer's device to `cpu:0`,
which computes on the CPU like `cpu` but is another torch.device value wherever code names it.
While `strict_collectives(label)` is active, in this thread:
- `DeviceLabel` (a TorchFunctionMode) marks each tensor made with device=label or moved with
  .to(label), and each tensor computed from a marked one (an in-place op keeps its target's mark);
- torch.distributed's collectives refuse an unmarked tensor with NCCL's error for host tensors,
  unless DeepSpeed (or torch itself) is the caller: their tensors live where DeepSpeed put the
  model, host memory on CPU, and on GPUs DeepSpeed places them on its accelerator itself.
The wrappers replace the module attributes (`torch.distributed.all_reduce`, ...), the functions
code calls through `dist.NAME(...)`, and are removed on exit.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch.overrides import TorchFunctionMode

MARK = "_on_trainer_device"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter")
TRUSTED_CALLERS = ("deepspeed.", "torch.")


def _tensors(value):
    """The tensors of an argument or a result: itself, or the items of a list, tuple or dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, MARK, False)


class DeviceLabel(TorchFunctionMode):
    """Marks the tensors that would be on the label's device (see the module docstring)."""

    def __init__(self, label: torch.device):
        super().__init__()
        self.label = label

    def _is_label(self, value) -> bool:
        return isinstance(value, (str, torch.device)) and torch.device(value) == self.label

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "").endswith("_"):  # in place: the target keeps its own mark
            return out
        placed = self._is_label(kwargs.get("device")) or \
            (func is torch.Tensor.to and any(self._is_label(a) for a in args[1:])) or \
            any(on_device(t) for a in (*args, *kwargs.values()) for t in _tensors(a))
        if placed:
            for t in _tensors(out):
                setattr(t, MARK, True)
        return out


class HostTensorRefused(RuntimeError):
    pass


@contextlib.contextmanager
def strict_collectives(label: torch.device):
    """Refuse host tensors in torch.distributed's collectives (DeepSpeed's own calls excepted)."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def guard(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(TRUSTED_CALLERS):
                for t in (t for a in (*args, *kwargs.values()) for t in _tensors(a)):
                    if not on_device(t):
                        raise HostTensorRefused(
                            f"{name} called from {caller} with a tensor in host memory, not on the trainer's "
                            f"device {label} (NCCL: Tensors must be CUDA and dense)")
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, guard(name, fn))
    try:
        with DeviceLabel(label):
            yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)

"""Weights for engines on the trainer's own GPUs (shared layouts) through CUDA IPC: a trainer rank
copies the weights into one reusable GPU buffer, a chunk at a time, and hands the engine worker
on the same GPU a handle to it (torch.multiprocessing's reduce_tensor); the worker maps the buffer
(rebuild_cuda_tensor) and loads the chunk's views, with no host copy and no file. The parts here:

    chunks = list(plan(named, capacity))      # which tensors share each fill of the buffer, at what offsets
    fill(buffer, named, chunk)    # trainer: copy one chunk in;  handle = export(buffer)
    handles = merge([...])        # {GPU UUID: rebuild args}, one per trainer rank's GPU
    buffer = Importer().open(handles, uuid, device_index); views(buffer, chunk)   # engine worker

colocated.py drives them: it chooses this sync for shared CUDA GPUs and runs the chunk loop
(`unreachable` says when CUDA IPC could not serve a layout, and the run falls back to disk).
A buffer is exported once and mapped once per consumer (torch counts one release per export), so
every chunk of a sync reuses both; the producer may refill it only once every consumer returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

ALIGN = 256  # bytes: every view of the uint8 buffer starts where any dtype may (CUDA's own allocation alignment)
# Index of the device in rebuild_cuda_tensor's arguments (storage_device): the producer's index,
# which the consumer replaces with its own, as two processes may number the same GPU differently.
DEVICE_ARG = 6


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch attribute name: "bfloat16"
    offset: int  # bytes into the buffer
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(named: Iterable[tuple[str, torch.Tensor]], capacity: int) -> Iterator[list[Slot]]:
    """The tensors in order, cut into chunks that each fit a buffer of `capacity` bytes."""
    chunk: list[Slot] = []
    used = 0
    for name, t in named:
        n = _nbytes(t)
        if n > capacity:
            raise ValueError(f"{name} is {n} bytes, more than the IPC buffer's {capacity}; a larger buffer is needed")
        if chunk and aligned(used) + n > capacity:
            yield chunk
            chunk, used = [], 0
        offset = aligned(used)
        chunk.append(Slot(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, n))
        used = offset + n
    if chunk:
        yield chunk


def fill(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], chunk: list[Slot]) -> None:
    """Copy the chunk's tensors into the uint8 buffer at their offsets (queued on the current
    stream: synchronize before a consumer reads)."""
    for s in chunk:
        src = tensors[s.name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[s.offset:s.offset + s.nbytes].copy_(src)


def views(buffer: torch.Tensor, chunk: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each slot: views of the buffer, no copy (load them before it is refilled)."""
    return [(s.name, buffer[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape))
            for s in chunk]


def export(buffer: torch.Tensor) -> tuple:
    """rebuild_cuda_tensor's arguments for a CUDA buffer (picklable: bytes, ints, classes)."""
    if buffer.device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA memory, not {buffer.device.type} memory")
    return reduce_tensor(buffer)[1]


def localize(args: tuple, device_index: int) -> list:
    """The producer's rebuild arguments with the consumer's index of the same GPU."""
    out = list(args)
    out[DEVICE_ARG] = device_index
    return out


def merge(per_rank: list[dict[str, tuple]]) -> dict[str, tuple]:
    """One {GPU UUID: rebuild args} from every trainer rank's own; two ranks on one GPU is a layout
    error (each GPU has one trainer rank)."""
    out: dict[str, tuple] = {}
    for handles in per_rank:
        for uuid, args in handles.items():
            if uuid in out:
                raise ValueError(f"two trainer ranks export a buffer on GPU {uuid}")
            out[uuid] = args
    return out


def unreachable(engine_gpus: list[str], trainer_gpus: list[str]) -> str:
    """'' when every engine worker's GPU holds a trainer rank (its weights can be mapped there);
    else why not, for the log line of the fallback."""
    missing = [g for g in engine_gpus if g not in set(trainer_gpus)]
    if not missing:
        return ""
    return f"{len(missing)} engine worker(s) on GPUs without a trainer rank, e.g. {missing[0]}"


class Importer:
    """An engine worker's mapping of the trainer's buffer: opened at the first chunk of an export,
    reused by the rest, released when the next export arrives (or on close): one release per export."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._buffer: torch.Tensor | None = None

    def open(self, handles: dict[str, tuple], uuid: str, device_index: int) -> torch.Tensor:
        if uuid not in handles:
            raise ValueError(f"no IPC buffer for GPU {uuid}; buffers came for {sorted(handles)}")
        args = localize(handles[uuid], device_index)
        key = tuple(args)
        if key != self._key or self._buffer is None:
            self._buffer = None  # the previous export's mapping goes first
            self._buffer, self._key = rebuild_cuda_tensor(*args), key
        return self._buffer

    def close(self) -> None:
        self._buffer, self._key = None, None


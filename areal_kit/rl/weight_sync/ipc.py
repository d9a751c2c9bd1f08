"""Weights for engines beside the trainer's own ranks (shared layouts) through one buffer a trainer
rank exports and the engine worker on the same device maps: a trainer rank copies the weights in,
a chunk at a time, and hands the worker a handle to it; the worker maps the buffer and loads the
chunk's views, with no file and no broadcast. On a GPU the buffer is GPU memory and the handle
CUDA IPC's (torch's reduce_tensor / rebuild_cuda_tensor); on CPU it is a shared-memory region
(transport.new_region). Everything else, the chunk loop included, is the same code on both.

    buffer, handle = new_buffer(nbytes, device)   # trainer: once per sync
    chunks = list(plan(named, capacity))          # which tensors share each fill, at what offsets
    fill(buffer, named, chunk)                    # trainer: copy one chunk in
    handles = merge([{key: handle}, ...])         # {device key: handle}, one per trainer rank
    buffer = Importer().open(handles, key, device_index); views(buffer, chunk)   # engine worker

A handle is plain values (ints, bytes, strings in dicts and lists): it reaches a GPU engine's worker
through vLLM's engine-core client, whose msgpack encoder refuses classes and dtypes, and comes back
with its tuples as lists. rl/driver/weight_sync.py drives the parts: it chooses this sync for shared layouts and
runs the chunk loop (`unreachable` says when a layout could not use it, and the run falls back to
disk). A buffer is exported once and mapped once per consumer (torch counts one release per CUDA
export), so every chunk of a sync reuses both; the producer may refill it only once every consumer
returned.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from areal_kit.rl.weight_sync import transport

ALIGN = 256  # bytes: every view of the uint8 buffer starts where any dtype may (CUDA's own allocation alignment)
# rebuild_cuda_tensor's arguments that are not plain values: the buffer is always a 1-D uint8 tensor
# on a typed storage, so the handle leaves them out and the consumer puts them back.
_CUDA_CLASSES = (0, 4, 5)  # tensor class, storage class, dtype
# Index of the device in rebuild_cuda_tensor's arguments (storage_device): the producer's index,
# which the consumer replaces with its own, as two processes may number the same GPU differently.
DEVICE_ARG = 6
# The trainer ranks a CPU engine shares its slots with (rl/driver/groups.py sets it on shared
# layouts, as it sets CUDA_VISIBLE_DEVICES to their GPUs): its workers' device keys.
SHARED_RANKS_ENV = "AREAL_SHARED_RANKS"


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


def new_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, dict]:
    """A uint8 buffer of nbytes that a process beside this one maps with `Importer`, and its handle:
    {"cuda": rebuild arguments} for GPU memory, {"region": transport's region} for host memory."""
    if device.type == "cuda":
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer, {"cuda": export(buffer)}
    buffer, region = transport.new_region(nbytes)
    return buffer, {"region": region}


def free(handle: dict) -> None:
    """The producer's end of a handle once every consumer closed its mapping (CPU: the region's
    descriptor; torch reclaims a CUDA export itself, at ipc_collect)."""
    if "region" in handle:
        os.close(handle["region"]["fd"])


def export(buffer: torch.Tensor) -> list:
    """rebuild_cuda_tensor's arguments for a CUDA buffer, as plain values: the tensor and storage
    classes and the dtype left out (None), the sizes as lists."""
    if buffer.device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA memory, not {buffer.device.type} memory")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"an IPC buffer is a 1-D uint8 tensor, not {buffer.dtype} of shape {tuple(buffer.shape)}")
    return plain(reduce_tensor(buffer)[1])


def plain(rebuild: tuple) -> list:
    """rebuild_cuda_tensor's arguments of a 1-D uint8 buffer as plain values (see export)."""
    args = list(rebuild)
    for i in _CUDA_CLASSES:
        args[i] = None
    return [list(a) if isinstance(a, tuple) else a for a in args]


def rebuild_args(args: list, device_index: int) -> list:
    """export's plain values back as rebuild_cuda_tensor's arguments, with the consumer's index of
    the same GPU."""
    out = list(args)
    out[0], out[4], out[5] = torch.Tensor, torch.storage.TypedStorage, torch.uint8
    out[1], out[2] = torch.Size(out[1]), tuple(out[2])
    out[DEVICE_ARG] = device_index
    return out


def medium(is_cpu: bool) -> str:
    """What carries the buffers, in the words of the plan and the run's log."""
    return "shared memory" if is_cpu else "CUDA IPC"


def trainer_key(device: torch.device, rank: int) -> str:
    """Which device a trainer rank's buffer is on, as the engine worker beside it names its own:
    a GPU by its UUID (two processes may number it differently), a CPU slot by host and rank."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return f"{socket.gethostname()}/rank{rank}"


def worker_key(device: torch.device, local_rank: int) -> str:
    """trainer_key of the trainer rank beside an engine's worker `local_rank`: on a GPU its UUID,
    on CPU the rank SHARED_RANKS_ENV names for it ('' outside a shared layout: no rank beside it)."""
    if device.type == "cuda":
        return trainer_key(device, local_rank)  # the GPU names itself: the rank is not asked
    ranks = [int(r) for r in os.environ.get(SHARED_RANKS_ENV, "").split(",") if r]
    return trainer_key(device, ranks[local_rank]) if local_rank < len(ranks) else ""


def merge(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """One {device key: handle} from every trainer rank's own; two ranks on one device is a layout
    error (each GPU has one trainer rank)."""
    out: dict[str, dict] = {}
    for handles in per_rank:
        for key, handle in handles.items():
            if key in out:
                raise ValueError(f"two trainer ranks export a buffer on {key}")
            out[key] = handle
    return out


def unreachable(engine_devices: list[str], trainer_devices: list[str]) -> str:
    """'' when every engine worker's device holds a trainer rank (its weights can be mapped there);
    else why not, for the log line of the fallback."""
    missing = [g or "a device outside the shared layout" for g in engine_devices if g not in set(trainer_devices)]
    if not missing:
        return ""
    return f"{len(missing)} engine worker(s) on devices without a trainer rank, e.g. {missing[0]}"


class Importer:
    """An engine worker's mapping of the trainer's buffer: opened at the first chunk of an export,
    reused by the rest, released when the next export arrives (or on close): one release per export."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._buffer: torch.Tensor | None = None

    def open(self, handles: dict[str, dict], key: str, device_index: int) -> torch.Tensor:
        if key not in handles:
            raise ValueError(f"no IPC buffer for {key or 'this device'}; buffers came for {sorted(handles)}")
        handle = handles[key]
        ident = repr(sorted(handle.items()))
        if ident != self._key or self._buffer is None:
            self._buffer = None  # the previous export's mapping goes first
            if "cuda" in handle:
                self._buffer = rebuild_cuda_tensor(*rebuild_args(handle["cuda"], device_index))
            else:
                self._buffer = transport.open_region(handle["region"])
            self._key = ident
        return self._buffer

    def close(self) -> None:
        self._buffer, self._key = None, None


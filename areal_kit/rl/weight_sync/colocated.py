"""Weights for engines beside the trainer's own ranks (shared layouts, rl/driver/turns.py) through
IPC buffers, and the one place that chooses how a run's weights travel (`sync_mode`).

On shared CUDA GPUs, weight_sync=auto is `ipc`: every trainer rank stages the whole model
(ZeRO-3 gathers it on every rank), copies it a chunk at a time into one buffer it exports once
(ipc.py: CUDA IPC), and the engine worker on the same GPU maps that buffer and loads the chunk's
views straight into its parameters (vllm_ext.receive_ipc): no file, no host copy, no NCCL group
(NCCL takes no two ranks of one communicator on one GPU). On CPU weight_sync=ipc runs the same
calls over the same process boundaries, each buffer a shared-memory region (auto keeps CPU's
cheaper shared parameters there). `connect` probes first: where an engine worker sits on a device
without a trainer rank, or cannot load a chunk at a time (a quantized model reloads whole), the
run falls back to disk and says why. weight_sync=disk forces disk.

    mode = sync_mode(cfg)                 # once; plan.py prints it
    why = probe(trainers, engines)        # at connect: '' or why the run falls back to disk
    refs = push(trainers, engines, version)   # each step: the chunk loop

The buffer lives only through a sync (`ipc_end` frees it, `torch.cuda.ipc_collect` reclaims a CUDA
export, and the rank returns its cache): the sync runs with the engines' weights awake and
their KV cache asleep, so it never sits beside the generation turn the memory plan checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from areal_kit import hardware
from areal_kit.rl import lora, sharing
from areal_kit.rl.weight_sync import ipc

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig
    from areal_kit.rl.actor_groups import Engines as EngineGroup
    from areal_kit.rl.actor_groups import Trainers as TrainerGroup

# The buffer's size, unless one tensor is larger (the 1.5B model's embedding is 0.47 GB): vLLM's
# own packed IPC default. Fewer chunks mean fewer round trips; the buffer is freed after the sync.
IPC_BUFFER_BYTES = 1 << 30


def sync_mode(cfg: TrainConfig, plat: hardware.Platform | None = None) -> str:
    """How the run's weights travel: ipc, disk, auto (broadcast, or shared memory on one CPU
    node) or broadcast. weight_sync=auto on shared GPUs is ipc: the broadcast's NCCL group
    would need two ranks on one GPU, which NCCL refuses. A LoRA run that sends its adapter alone
    (megabytes, loaded through vLLM's LoRA manager) goes through disk there."""
    if cfg.weight_sync == "ipc" or (cfg.weight_sync == "auto" and sharing.shares_gpus(cfg, plat)):
        return "disk" if lora.sends_adapter(cfg) else "ipc"
    return cfg.weight_sync


def capacity(largest: int) -> int:
    """The IPC buffer's bytes for a model whose largest tensor has `largest` bytes."""
    return max(IPC_BUFFER_BYTES, ipc.aligned(largest))


def probe(trainers: TrainerGroup, engines: EngineGroup) -> str:
    """'' when every engine worker can map the buffer of the trainer rank on its device; else why
    not (the fallback's log line). Each side reports its device's key (ipc.trainer_key); an engine
    worker also says why it cannot load a chunk at a time."""
    dog = trainers.watchdog
    trainer_gpus = dog.wait("ipc probe", dog.label([t.ipc_key.remote() for t in trainers.actors], trainers.names))
    probes = dog.wait("ipc probe", dog.label([e.ipc_probe.remote() for e in engines.actors], engines.names))
    workers = [w for ws in probes for w in ws]
    why = [w["why"] for w in workers if w["why"]]
    return why[0] if why else ipc.unreachable([w["uuid"] for w in workers], trainer_gpus)


def push(trainers: TrainerGroup, engines: EngineGroup, version: int) -> list:
    """The chunk loop: every rank fills chunk i of its buffer, every engine loads it, until done;
    then the ranks free the buffer. Returns the engines' last calls (their load reports)."""
    dog = trainers.watchdog
    starts = dog.wait("ipc start", dog.label([t.ipc_start.remote() for t in trainers.actors], trainers.names))
    handles = ipc.merge([s["handles"] for s in starts])
    n = starts[0]["chunks"]
    loads = []
    try:
        for i in range(n):
            filled = dog.wait("ipc chunk", dog.label([t.ipc_fill.remote(i) for t in trainers.actors], trainers.names))
            loads = [e.receive_ipc.remote(version, handles, filled[0], i == 0, i == n - 1) for e in engines.actors]
            dog.wait("ipc chunk", dog.label(loads, engines.names))  # read before the next fill
    finally:
        dog.wait("ipc end", dog.label([t.ipc_end.remote() for t in trainers.actors], trainers.names))
    return loads


class IpcSender:
    """The trainer rank's end (a mixin of TrainerWorker). Needs from its host class: rank, device,
    _sync_state(every_rank) (the weights the engines get) and release_memory()."""

    rank: int
    device: torch.device
    _sync_state: Callable[..., dict[str, torch.Tensor]]
    release_memory: Callable[[], dict]
    # Through one sync: the buffer, its handle, the staged weights and their chunks.
    _ipc: tuple[torch.Tensor, dict, dict[str, torch.Tensor], list[list[ipc.Slot]]] | None = None

    def ipc_key(self) -> str:
        return ipc.trainer_key(self.device, self.rank)

    def ipc_start(self) -> dict:
        """Stage the weights, plan the chunks, export one buffer: {"handles": {key: handle}, "chunks": n}.
        Every rank stages the whole model: each feeds the engine worker beside it."""
        state = self._sync_state(every_rank=True)
        if not state:
            raise RuntimeError(f"trainer rank {self.rank} staged no weights for its IPC buffer")
        cap = capacity(max(t.numel() * t.element_size() for t in state.values()))
        chunks = list(ipc.plan(state.items(), cap))
        used = max(c[-1].offset + c[-1].nbytes for c in chunks)  # a small model needs less than cap
        buffer, handle = ipc.new_buffer(used, self.device)
        self._ipc = (buffer, handle, state, chunks)
        return {"handles": {self.ipc_key(): handle}, "chunks": len(chunks)}

    def ipc_fill(self, i: int) -> list[tuple]:
        """Copy chunk i in and wait for the copies; the chunk's slots as plain tuples."""
        assert self._ipc is not None, "ipc_start staged the weights"
        buffer, _, state, chunks = self._ipc
        ipc.fill(buffer, state, chunks[i])
        hardware.synchronize(self.device)  # the engine reads from another process: written means done
        return [dataclasses.astuple(s) for s in chunks[i]]

    def ipc_end(self) -> dict:
        """Free the buffer and the staged state; reclaim the exported block; return the cache."""
        if self._ipc is not None:
            ipc.free(self._ipc[1])
        self._ipc = None
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # the engines closed their mappings: the block can go back
        return self.release_memory()

"""The trainer's end of the weight sync: mixins of TrainerWorker (rank 0 sends, every rank gathers;
on shared layouts every rank fills an IPC buffer for the engine worker beside it: IpcSender).

Rank 0 joins a standalone process group with the engines' workers, stages the new weights after
each step (ZeRO-3 gathers them on every rank) and broadcasts them on the actor's "weights"
concurrency group, beside training; or, for engines on its node that share their parameter
memory, writes them straight into it. Under LoRA it sends the adapter alone, or the model with the
adapter merged (actor.lora.sync, see rl/lora.py). WeightSync (rl/driver/weight_sync.py) drives both ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from areal_kit import hardware
from areal_kit.config.schema import TrainConfig
from areal_kit.rl import lora
from areal_kit.rl.common import testhooks
from areal_kit.rl.hallway import IpcStart
from areal_kit.rl.trainer.release import TrainerTurn
from areal_kit.rl.weight_sync import ipc, mode, transport


class WeightSender:
    """Needs from its host class: rank, cfg, device, outbox (transport.Outbox), engine (DeepSpeed),
    version (of the weights it holds) and full_state() (the unsharded weights)."""

    rank: int
    version: int
    cfg: TrainConfig
    device: torch.device
    outbox: transport.Outbox
    engine: Any  # deepspeed's engine
    full_state: Callable[..., dict[str, torch.Tensor]]
    sync_group: transport.SyncGroup | None = None

    def _sync_state(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The weights the engines get: on rank 0 alone (it sends them), or with every_rank on each
        rank (each feeds the engine beside it: IpcSender)."""
        if lora.sends_adapter(self.cfg.actor.lora):  # actor.lora.sync=adapter: the engines serve it (rl/vllm_worker/lora_adapter.py)
            return lora.adapter_tensors(self.full_state(adapter_only=True, every_rank=every_rank))
        state = self.full_state(every_rank=every_rank)
        if self.cfg.actor.lora.enabled:  # actor.lora.sync=merged: the base weights with the adapter in them
            state = lora.merged_state(state, self.cfg.actor.lora)
        if getattr(self.engine.module.config, "tie_word_embeddings", False):
            # The same bytes as the embedding (a sixth of Qwen2.5-1.5B's): the engine re-names the
            # received embedding as lm_head (rl/vllm_worker/extension.py), so it is never sent twice.
            state.pop("lm_head.weight", None)
        return state

    def sync_plan(self) -> transport.Plan | None:
        state = self._sync_state()  # every rank: ZeRO-3 gathers
        return transport.make_plan(list(state.items())) if self.rank == 0 else None

    def init_sync(self, host: str, port: int, world: int, backend: str, plan: transport.Plan) -> bool:
        self._store, self.sync_group = transport.init_group(host, port, 0, world, backend, local_ip=host,
                                                              timeout_s=self.cfg.weight_sync_timeout_s)
        self._plan = plan
        return True

    def stage_weights(self) -> None:
        """Stage the new weights for the next send (every rank: ZeRO-3 gathers them here)."""
        testhooks.before_sync(self.rank, self.version)  # a fault the tests inject (unset: nothing)
        state = self._sync_state()
        if self.rank == 0:
            # ZeRO-3's gathered state is a copy; the other stages hand over the parameters.
            self.outbox.stage(state, live=self.cfg.actor.zero_stage != 3)

    def open_shared(self, regions: list[dict], names: list[str]) -> int:
        """Rank 0: map the engines' shared parameter memory (engines on this node, see the vLLM worker extension
        share_weights); sends with shared=True then write `names` straight into it."""
        bufs = [transport.open_region(r) for r in regions]
        metas = {transport.as_meta(m).name: m for bucket in self._plan for m in bucket}
        self._shared = {n: [transport.region_view(b, r["places"][n], metas[n]) for b, r in zip(bufs, regions)]
                        for n in names}
        return len(self._shared)

    def send_weights(self, *ready: object, shared: bool = False) -> dict[str, float]:
        """Rank 0, on the actor's "weights" concurrency group: broadcast the staged weights.

        The controller passes refs that resolve once the weights are staged and each engine is
        free to receive, so Ray starts this only then, and the main thread goes on training meanwhile.
        """
        to = getattr(self, "_shared", None) if shared else None
        group = self.sync_group
        assert group is not None, "init_sync joined the sync group"
        return self.outbox.send(lambda state: transport.send(group, self._plan, state, self.device, to))


class IpcSender(TrainerTurn):
    """The trainer rank's end of the IPC sync of shared layouts (a mixin of TrainerWorker; the
    driver's chunk loop is rl/driver/weight_sync.py's ipc_push). Needs from its host class: rank, device,
    _sync_state(every_rank) (the weights the engines get); it gives back its memory as TrainerTurn does."""

    rank: int
    device: torch.device
    _sync_state: Callable[..., dict[str, torch.Tensor]]
    # Through one sync: the buffer, its handle, the staged weights and their chunks.
    _ipc: tuple[torch.Tensor, dict, dict[str, torch.Tensor], list[list[ipc.Slot]]] | None = None

    def ipc_key(self) -> str:
        return ipc.trainer_key(self.device, self.rank)

    def ipc_start(self) -> IpcStart:
        """Stage the weights, plan the chunks, export one buffer: its handle and the chunks' count.
        Every rank stages the whole model: each feeds the engine worker beside it."""
        state = self._sync_state(every_rank=True)
        if not state:
            raise RuntimeError(f"trainer rank {self.rank} staged no weights for its IPC buffer")
        cap = mode.capacity(max(t.numel() * t.element_size() for t in state.values()))
        chunks = list(ipc.plan(state.items(), cap))
        used = max(c[-1].offset + c[-1].nbytes for c in chunks)  # a small model needs less than cap
        buffer, handle = ipc.new_buffer(used, self.device)
        self._ipc = (buffer, handle, state, chunks)
        return IpcStart({self.ipc_key(): handle}, len(chunks))

    def ipc_fill(self, i: int) -> list[tuple]:
        """Copy chunk i in and wait for the copies; the chunk's slots as plain tuples."""
        assert self._ipc is not None, "ipc_start staged the weights"
        buffer, _, state, chunks = self._ipc
        ipc.fill(buffer, state, chunks[i])
        hardware.synchronize(self.device)  # the engine reads from another process: written means done
        return [dataclasses.astuple(s) for s in chunks[i]]

    def ipc_end(self) -> dict[str, int]:
        """Free the buffer and the staged state; reclaim the exported block; return the cache."""
        if self._ipc is not None:
            ipc.free(self._ipc[1])
        self._ipc = None
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # the engines closed their mappings: the block can go back
        return self.release_memory()

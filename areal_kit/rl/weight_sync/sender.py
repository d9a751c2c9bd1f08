"""The trainer's end of the weight sync: a mixin of TrainerWorker (rank 0 sends, every rank gathers).

Rank 0 joins a standalone process group with the engines' workers, stages the new weights after
each step (ZeRO-3 gathers them on every rank) and broadcasts them on the actor's "weights"
concurrency group, beside training; or, for engines on its node that share their parameter
memory, writes them straight into it. Under LoRA it sends the adapter alone, or the model with the
adapter merged (actor.lora.sync, see rl/lora.py). WeightSync (sync.py) drives both ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from areal_kit.config.schema import TrainConfig
from areal_kit.rl import lora
from areal_kit.rl.weight_sync import transport
from areal_kit.rl.workers import testhooks


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
    sync_group = None

    def _sync_state(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The weights the engines get: on rank 0 alone (it sends them), or with every_rank on each
        rank (each feeds the engine beside it: colocated.IpcSender)."""
        if lora.sends_adapter(self.cfg):  # actor.lora.sync=adapter: the engines serve it (vllm_lora.py)
            return lora.adapter_tensors(self.full_state(adapter_only=True, every_rank=every_rank))
        state = self.full_state(every_rank=every_rank)
        if lora.enabled(self.cfg):  # actor.lora.sync=merged: the base weights with the adapter in them
            state = lora.merged_state(state, self.cfg.actor.lora)
        if getattr(self.engine.module.config, "tie_word_embeddings", False):
            # The same bytes as the embedding (a sixth of Qwen2.5-1.5B's): the engine re-names the
            # received embedding as lm_head (vllm_ext), so it is never sent twice.
            state.pop("lm_head.weight", None)
        return state

    def sync_plan(self):
        state = self._sync_state()  # every rank: ZeRO-3 gathers
        return transport.make_plan(list(state.items())) if self.rank == 0 else None

    def init_sync(self, host: str, port: int, world: int, backend: str, plan) -> bool:
        self._store, self.sync_group = transport.init_group(host, port, 0, world, backend, local_ip=host,
                                                              timeout_s=self.cfg.weight_sync_timeout_s)
        self._plan = plan
        return True

    def stage_weights(self) -> dict:
        """Stage the new weights for the next send (every rank: ZeRO-3 gathers them here)."""
        testhooks.before_sync(self.rank, self.version)  # a fault the tests inject (unset: nothing)
        state = self._sync_state()
        if self.rank == 0:
            # ZeRO-3's gathered state is a copy; the other stages hand over the parameters.
            self.outbox.stage(state, live=self.cfg.actor.zero_stage != 3)
        return {}

    def open_shared(self, regions: list[dict], names: list[str]) -> int:
        """Rank 0: map the engines' shared parameter memory (engines on this node, see vllm_ext
        share_weights); sends with shared=True then write `names` straight into it."""
        bufs = [transport.open_region(r) for r in regions]
        metas = {transport.as_meta(m).name: m for bucket in self._plan for m in bucket}
        self._shared = {n: [transport.region_view(b, r["places"][n], metas[n]) for b, r in zip(bufs, regions)]
                        for n in names}
        return len(self._shared)

    def send_weights(self, *ready, shared: bool = False) -> dict:
        """Rank 0, on the actor's "weights" concurrency group: broadcast the staged weights.

        The controller passes refs that resolve once the weights are staged and each engine is
        free to receive, so Ray starts this only then, and the main thread goes on training meanwhile.
        """
        to = getattr(self, "_shared", None) if shared else None
        return self.outbox.send(lambda state: transport.send(self.sync_group, self._plan, state, self.device, to))

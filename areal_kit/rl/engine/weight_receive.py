"""The rollout engine's end of the weight sync: a mixin of RolloutWorker.

Each call is passed to every vLLM worker process of the engine (collective_rpc), where
WeightSyncExtension (rl/vllm_worker/extension.py) joins the sync group, receives the buckets and loads them into
the parameters in place. ready_for_weights tells WeightSync an engine is free to receive: a
batch engine answers it once the calls queued before it (its generations) are done; a streaming
engine pauses its generations (rollout.interrupt) and answers, and resumes them once the new
weights are loaded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from areal_kit.rl import lora
from areal_kit.rl.hallway import WorkerProbe
from areal_kit.rl.staleness import Staleness
from areal_kit.rl.weight_sync import transport

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig


class WeightReceiver:
    """Needs from its host class: llm (vllm.LLM with WeightSyncExtension, or a StreamingLLM when
    streaming), cfg, version, streaming."""

    llm: Any
    cfg: TrainConfig
    version = 0
    streaming = False  # the host sets it at setup (rollout.mode=stream)

    def init_sync(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                  plan: transport.Plan) -> list[bool]:
        # vLLM's workers are child processes without Ray: tell them this node's address.
        local_ip = ray.util.get_node_ip_address()
        return self.llm.collective_rpc("init_weight_sync",
                                       args=(host, port, rank_offset, world, backend, plan, local_ip,
                                             self.cfg.weight_sync_timeout_s))

    def share_weights(self) -> list[dict]:
        """Each worker's shared parameter memory for the trainer on this node, or {"why": ...}."""
        return self.llm.collective_rpc("share_weights")

    def use_shared(self, names: list[str]) -> list[int]:
        return self.llm.collective_rpc("use_shared", args=(names,))

    def receive_weights(self, version: int, *ready: object, shared: bool = False) -> dict[str, float]:
        """Seconds of the whole receive and load, and of its slowest worker's parts: on the wire,
        copying into the parameters, re-packing CPU kernels. `ready`: the refs the sender waits
        for too (WeightSync.push), which Ray resolves before this starts."""
        if lora.sends_adapter(self.cfg.actor.lora):  # a LoRA adapter, served as version `version` (rl/vllm_worker/lora_adapter.py)
            return self._load(version, "receive_adapter",
                              (lora.SERVED_ID, lora.engine_peft_config(self.cfg.actor.lora)))
        return self._load(version, "receive_weights", (shared,))

    def load_from_disk(self, path: str, version: int) -> dict[str, float]:
        """The same, from a Hugging Face folder (weight_sync=disk), or a PEFT adapter folder."""
        if lora.sends_adapter(self.cfg.actor.lora):
            return self._load(version, "load_adapter_from_disk", (path, lora.SERVED_ID))
        return self._load(version, "load_weights_from_disk", (path,))

    def ipc_probe(self) -> list[WorkerProbe]:
        """Each worker's device key and why it cannot load IPC chunks ('' when it can)."""
        return [WorkerProbe(w["uuid"], w["why"]) for w in self.llm.collective_rpc("ipc_probe")]

    def receive_ipc(self, version: int, handles: dict[str, dict], chunk: list[tuple], first: bool,
                    last: bool) -> dict[str, float]:
        """Load one chunk of the trainer ranks' IPC buffers (the driver's ipc_push); the last one
        completes the update, as a receive_weights does."""
        args = (handles, chunk, first, last)
        if last:
            return self._load(version, "receive_ipc", args)
        return _slowest(self.llm.collective_rpc("receive_ipc", args=args))

    def ready_for_weights(self) -> int:
        """Answers when the engine may receive: at once for a streaming engine, its generations paused."""
        if self.streaming:
            self.llm.pause(self.cfg.rollout.interrupt)
        return self.version

    def _load(self, version: int, method: str, args: tuple) -> dict[str, float]:
        t0 = time.time()
        if self.streaming:
            self.llm.pause(self.cfg.rollout.interrupt)  # already, when the sync asked ready_for_weights
        parts = self.llm.collective_rpc(method, args=args)
        # Cached prefixes hold KV computed with the old weights.
        self.llm.reset_prefix_cache()
        self.version = version
        if isinstance(self.llm, lora.AdapterLLM):  # its generations name the new adapter from now on
            self.llm.loaded(version)
        extra: dict[str, float] = {}
        if self.streaming:
            # A request that began before the oldest version a step may train on: abort it now. Under
            # LoRA a request begun at version 0 names no adapter and would go on with the base.
            before = Staleness.of(self.cfg.ppo).oldest(version)
            extra["aborted"] = self.llm.resume(version, stale_before=max(before, 1) if lora.sends_adapter(self.cfg.actor.lora)
                                               else before)
        return {"load_time": time.time() - t0, **_slowest(parts), **extra}

    def get_version(self) -> int:
        return self.version


def _slowest(parts: list[dict[str, float]]) -> dict[str, float]:
    """The engine's load figures from its workers' (each a dict of seconds): the slowest worker's,
    as load_<figure>."""
    return {f"load_{k}": max(p[k] for p in parts) for k in parts[0]}

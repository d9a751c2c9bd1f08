"""vLLM worker extension, LoRA half: new adapter versions served from memory.

With actor.lora.rank > 0 and actor.lora.sync=adapter the trainer sends only the adapter's tensors
(PEFT names) over the same sync group as full weights. Here, in each vLLM worker process, they
become a vLLM LoRA model (vLLM's LoRAModel built from tensors: the constructor its own folder
loader ends in) registered in the worker's LoRA manager under the one id every version is
served as, replacing the version before, so the next request that carries the `LoRARequest`
(areal_kit/rl/lora.py), or a request an update interrupted, finds it loaded: vLLM never reads
the request's path. No folder is written.
Mixed into WeightSyncExtension (extension.py); called through `llm.collective_rpc`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load_file

from areal_kit.rl.weight_sync import transport


class LoRAExtension:
    # From vLLM's worker, which the extension extends (worker_extension_cls), and from
    # WeightSyncExtension.init_weight_sync: the sync group and the plan of its buckets.
    model_runner: Any
    _areal_group: transport.SyncGroup
    _areal_plan: Sequence[Sequence[transport.MetaLike]]

    def receive_adapter(self, lora_id: int, peft_config: dict) -> dict[str, float]:
        """Receive the next broadcast (adapter tensors) and serve it as adapter `lora_id`; returns
        the seconds on the wire ("wait") and building the adapter ("copy")."""
        stats: dict[str, float] = {"wait": 0.0, "copy": 0.0, "repack": 0.0, "placed": 0}
        device = torch.device(getattr(self.model_runner, "device", "cpu"))
        tensors: dict[str, torch.Tensor] = {}
        for bucket in transport.receive(self._areal_group, self._areal_plan, device, stats):
            tensors.update(bucket)  # a fresh buffer per bucket: views stay valid
        t0 = time.perf_counter()
        self._areal_add_adapter(lora_id, tensors, peft_config)
        stats["copy"] = time.perf_counter() - t0
        return stats

    def load_adapter_from_disk(self, path: str, lora_id: int) -> dict[str, float]:
        """The same from a PEFT adapter folder (weight_sync=disk); reading counts as "copy"."""
        t0 = time.perf_counter()
        with open(os.path.join(path, "adapter_config.json")) as f:
            peft_config = json.load(f)
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        self._areal_add_adapter(lora_id, tensors, peft_config)
        return {"wait": 0.0, "copy": time.perf_counter() - t0, "repack": 0.0, "placed": 0}

    def _areal_add_adapter(self, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        worker_mgr = self.model_runner.lora_manager
        # The worker manager has no public "add these tensors": its own loader reads a folder and
        # then does what follows, so its internals are the way to skip the folder.
        mgr = worker_mgr._adapter_manager
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings":
                                       worker_mgr.max_position_embeddings})
        helper.validate_legal(worker_mgr.lora_config)
        model = mgr.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, tensors, helper, device="cpu", dtype=worker_mgr.lora_config.lora_dtype,
            model_vocab_size=worker_mgr.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for old in list(mgr.list_adapters()):  # the engine serves one version: the newest
            mgr.remove_adapter(old)
        mgr.add_adapter(lora)
        mgr.activate_adapter(lora_id)

"""LoRA adapter folders and vLLM engines that serve an adapter, for training (rl/lora.py) and
evaluation (eval/engine.py) alike: which base an adapter folder was trained on, and a vllm.LLM
whose every generate names an adapter's LoRARequest.

    from areal_kit import adapters
    adapters.is_adapter_folder(path); adapters.adapter_base(path)
    llm = adapters.adapter_llm(LLM, kwargs_of_the_base, adapter_dir)   # eval of a LoRA checkpoint
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from areal_kit.config.lora import vllm_rank
from areal_kit.errors import UserError

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput
    from vllm.lora.request import LoRARequest

# vLLM's id of the trained adapter, whatever its version. Each new version replaces the last under
# this id (with the prefix cache reset), so a streaming request that an update interrupts goes on
# with the new adapter, as a full-weight update's requests go on with the new weights.
SERVED_ID = 1


def request(version: int) -> LoRARequest | None:
    """The LoRARequest that serves weight version `version`; None for version 0 (the fresh adapter
    is zero: the base model is the policy). Its path is never read: the adapter is loaded before
    it is used."""
    if version <= 0:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest("areal-kit", SERVED_ID, "areal-kit-memory://adapter")


class AdapterLLM:
    """vllm.LLM whose generate calls name the adapter version loaded last (`loaded`)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.current: LoRARequest | None = None

    def __getattr__(self, name: str) -> Any:  # the engine's other methods and attributes, as they are
        return getattr(self.llm, name)

    def loaded(self, version: int) -> None:
        self.current = request(version)

    def generate(self, *args: Any, **kwargs: Any) -> list[RequestOutput]:
        if self.current is not None:
            kwargs.setdefault("lora_request", self.current)
        return self.llm.generate(*args, **kwargs)


def adapter_llm(llm_cls: Callable[..., LLM], kwargs: dict, adapter_dir: str) -> AdapterLLM:
    """A vLLM engine of an adapter folder's base whose generate calls serve the adapter (vLLM
    loads it from the folder): eval of LoRA checkpoints."""
    from vllm.lora.request import LoRARequest

    engine = AdapterLLM(llm_cls(**kwargs, enable_lora=True, max_lora_rank=vllm_rank(adapter_rank(adapter_dir)),
                                max_loras=1))
    engine.current = LoRARequest(os.path.basename(adapter_dir.rstrip("/")), 1, os.path.abspath(adapter_dir))
    return engine


# ---------------------------------------------------------------- folders
def is_adapter_folder(path: str) -> bool:
    return os.path.exists(os.path.join(path, "adapter_config.json"))


def adapter_base(path: str) -> str:
    """The base model folder an adapter folder was trained on (its adapter_config.json)."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        base = json.load(f).get("base_model_name_or_path") or ""
    if not os.path.exists(os.path.join(base, "config.json")):
        raise UserError(f"{path} is an adapter of {base or 'an unnamed model'}, which is not a model folder "
                        "here; expected the base model's folder at that path")
    return base


def adapter_rank(path: str) -> int:
    with open(os.path.join(path, "adapter_config.json")) as f:
        return int(json.load(f)["r"])



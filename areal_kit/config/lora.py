"""actor.lora.*: train a LoRA adapter (PEFT) instead of the whole model, and send the engines
only the adapter. A section of the actor's config (config/schema.py); what it drives is in
areal_kit/rl/lora.py.

    areal-kit train tiny_lora
    areal-kit train tiny actor.lora.rank=16 actor.lora.target_modules=[q_proj,v_proj]
"""

# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_kit.config.fields import check, check_choices, check_positive, opt

# The ranks vLLM 0.32 serves (its LoRAConfig.max_lora_rank): an adapter of rank r needs an engine
# started with the smallest of these >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Layers whose adapters vLLM 0.32's adapter loader refuses (its LoRAModel.from_local_checkpoint
# expects linear layers only), so a saved adapter on them would not load in vLLM.
UNSERVED_MODULES = ("embed_tokens", "lm_head")


@dataclass
class LoRAConfig:
    rank: int = opt(0,
        "LoRA rank r (0 = off: the whole model trains). Up to 512, the largest rank vLLM serves; the "
        "engines start with enable_lora and the smallest max_lora_rank that holds it.")
    alpha: float = opt(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = opt(0.0, "Dropout on the adapter's input while training (0 = none; 0 <= x < 1).")
    # Any: OmegaConf has no "a list or a string" type; __post_init__ checks which it is.
    target_modules: Any = opt("all-linear",
        'Layers that get an adapter: "all-linear" (every linear layer but the LM head) or a list of '
        "module names as the model calls them, e.g. [q_proj, k_proj, v_proj, o_proj]. A name the "
        "model does not have is refused when the model is loaded.")
    sync: str = opt("adapter",
        "What the engines receive after each step. adapter: the adapter's tensors only (megabytes), "
        "served by vLLM's LoRA support as a new adapter version. merged: the adapter merged into the "
        "base weights, sent as the full model (as without LoRA), for models or layers vLLM's LoRA "
        "kernels do not cover.", choices=("adapter", "merged"))
    save_merged: bool = opt(False,
        "Persistent saves write the merged model (a plain Hugging Face folder) instead of the PEFT "
        "adapter folder (adapter_config.json + adapter_model.safetensors, the base read from it).")

    def __post_init__(self) -> None:
        check_positive("actor.lora.rank", self.rank, allow_zero=True)
        check(self.rank <= VLLM_LORA_RANKS[-1], f"actor.lora.rank={self.rank} does not fit vLLM's LoRA "
              f"kernels; expected 0 (off) up to {VLLM_LORA_RANKS[-1]}")
        check(self.alpha > 0, f"actor.lora.alpha={self.alpha} is not valid; expected > 0")
        check(0 <= self.dropout < 1, f"actor.lora.dropout={self.dropout} is not valid; expected 0 <= dropout < 1")
        check_choices(self, "actor.lora.")
        if isinstance(self.target_modules, str):
            check(self.target_modules == "all-linear", f"actor.lora.target_modules={self.target_modules!r} "
                  "is not valid; expected \"all-linear\" or a list of module names, e.g. [q_proj, v_proj]")
            return
        check(isinstance(self.target_modules, (list, tuple)), f"actor.lora.target_modules="
              f"{self.target_modules!r} is not valid; expected \"all-linear\" or a list of module names")
        self.target_modules = [str(m) for m in self.target_modules]
        check(len(self.target_modules) > 0 and all(self.target_modules),
              "actor.lora.target_modules is empty; expected \"all-linear\" or module names, e.g. [q_proj, v_proj]")
        bad = [m for m in self.target_modules if m.split(".")[-1] in UNSERVED_MODULES]
        check(not bad, f"actor.lora.target_modules has {', '.join(bad)}: vLLM 0.32 loads no adapter on the "
              "embeddings or the LM head; expected linear layers of the blocks, e.g. q_proj, v_proj")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def engine_rank(self) -> int:
        """The max_lora_rank the engines start with: the smallest vLLM serves that holds rank."""
        return vllm_rank(self.rank)


def vllm_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM serves that holds an adapter of rank `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)

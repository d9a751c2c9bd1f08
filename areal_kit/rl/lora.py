"""LoRA training (actor.lora, config/lora.py): the adapter PEFT puts on the trainer's model, what
the weight sync sends of it, and which adapter version each engine request names.

- trainer: `wrap` the model (PEFT), DeepSpeed trains `trainable` (the adapter alone); the KL
  reference is the same model with the adapter disabled; `adapter_tensors` / `merged_state`
  are what a sync sends (actor.lora.sync=adapter | merged).
- engines: `engine_kwargs` (enable_lora, max_lora_rank) and `serving`, which wraps vllm.LLM so
  that every generate names the `request` of the adapter version loaded last (received in
  memory by rl/vllm_worker/lora_adapter.py), batch and streaming engines alike.
- driver: `check_targets` refuses, in one line, target modules the model does not have.
- folders: `merge_folder` turns a saved adapter into a plain Hugging Face model (reading and
  serving adapter folders is areal_kit/adapters.py's, which eval shares).

    python -m areal_kit.rl.lora merge ADAPTER_DIR OUT_DIR
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from areal_kit.adapters import SERVED_ID, AdapterLLM, adapter_base, request
from areal_kit.config.lora import UNSERVED_MODULES
from areal_kit.data.tokenizer import copy_tokenizer_files
from areal_kit.errors import ExitCode, UserError

if TYPE_CHECKING:
    from peft import LoraConfig

    from areal_kit.config.lora import LoRAConfig

# The adapter PEFT creates is named "default"; the files it saves drop the name.
_ADAPTER = "default"
__all__ = ["SERVED_ID", "AdapterLLM", "request"]  # re-exported: the engines' side reads them from here


def sends_adapter(lcfg: LoRAConfig) -> bool:
    """The weight sync sends the adapter alone (the engines serve it with vLLM's LoRA support)."""
    return lcfg.enabled and lcfg.sync == "adapter"


# ---------------------------------------------------------------- trainer
def peft_config(lcfg: LoRAConfig) -> LoraConfig:
    from peft import LoraConfig

    # peft annotates lora_alpha as an int; it only divides it by r, so a float (actor.lora.alpha) scales as well.
    return LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha,  # type: ignore[arg-type]
                      lora_dropout=lcfg.dropout, bias="none", target_modules=lcfg.target_modules, task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, lcfg: LoRAConfig) -> torch.nn.Module:
    """The model with a fresh adapter (its B is zero: the policy starts as the base), only the
    adapter trainable; the model itself when LoRA is off."""
    if not lcfg.enabled:
        return model
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lcfg))


def trainable(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """What the optimizer holds: the adapter under LoRA, every parameter otherwise."""
    if not hasattr(model, "peft_config"):
        return model.parameters()
    return [p for p in model.parameters() if p.requires_grad]


def recover_kwargs(lcfg: LoRAConfig, save: bool) -> dict:
    """DeepSpeed's save_checkpoint / load_checkpoint arguments under LoRA: the adapter (and its
    optimizer state), the base coming from actor.path. DeepSpeed leaves frozen parameters out by
    name, so a tied LM head (the embedding under a second name) is still written, and loads back
    as the same values."""
    if not lcfg.enabled:
        return {}
    return {"exclude_frozen_parameters": True} if save else {"load_module_strict": False}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a PEFT model's state dict, named as in adapter_model.safetensors
    (and as vLLM reads them): base_model.model.<module>.lora_A.weight."""
    return {k.replace(f".{_ADAPTER}.", "."): v for k, v in state.items() if is_adapter(k)}


def base_name(name: str) -> str:
    """A PEFT model's parameter name -> the base model's."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_state(state: dict[str, torch.Tensor], lcfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict as the base model's, with each adapter merged into its layer
    (W + alpha / r * B @ A, in fp32): what a full-weight sync or a plain HF save holds."""
    out = {base_name(k): v for k, v in state.items() if not is_adapter(k)}
    scale = lcfg.alpha / lcfg.rank
    suffix = f".lora_A.{_ADAPTER}.weight"
    for name, a in state.items():
        if not name.endswith(suffix):
            continue
        module = name.removesuffix(suffix)
        b = state[f"{module}.lora_B.{_ADAPTER}.weight"]
        key = base_name(module) + ".weight"
        w = out[key]
        out[key] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


# ---------------------------------------------------------------- engines
def engine_kwargs(lcfg: LoRAConfig) -> dict:
    """vllm.LLM's LoRA arguments for the run's engines ({} without LoRA or with merged sync)."""
    if not sends_adapter(lcfg):
        return {}
    # One version is served at a time; max_cpu_loras 2 leaves room for the next one's load.
    return {"enable_lora": True, "max_lora_rank": lcfg.engine_rank, "max_loras": 1, "max_cpu_loras": 2}


def engine_buffers(lcfg: LoRAConfig) -> tuple[int, int]:
    """(max_lora_rank, max_loras) of the run's engines, whose LoRA buffers the memory plan counts;
    (0, 0) when they serve no adapter."""
    kw = engine_kwargs(lcfg)
    return (kw["max_lora_rank"], kw["max_loras"]) if kw else (0, 0)


def engine_peft_config(lcfg: LoRAConfig) -> dict[str, Any]:
    """What vLLM's PEFTHelper needs of the adapter the trainer sends."""
    return {"r": lcfg.rank, "lora_alpha": lcfg.alpha, "target_modules": lcfg.target_modules}


def serving(llm: Any, lcfg: LoRAConfig) -> Any:
    """The engine the rollout worker generates with: llm itself unless the adapter is synced.
    Any: vllm.LLM or StreamingLLM, whose calls are vLLM's (AdapterLLM passes them through)."""
    return AdapterLLM(llm) if sends_adapter(lcfg) else llm


# ---------------------------------------------------------------- driver
def check_targets(model_path: str, lcfg: LoRAConfig) -> None:
    """Before any worker starts: raise UserError (one line) when target_modules names no layer of
    the model, or the rank exceeds a targeted layer's size; built on the meta device, so no weight
    is read. Nothing to check without LoRA."""
    if not lcfg.enabled:
        return
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        model = get_peft_model(model, peft_config(lcfg))
    except ValueError as e:
        have = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
                      - set(UNSERVED_MODULES))
        raise UserError(f"actor.lora.target_modules={lcfg.target_modules}: {str(e).splitlines()[0]} "
                        f"expected linear layers of {model_path}: {', '.join(have)}") from None
    sizes = [min(m.in_features, m.out_features) for n, m in model.named_modules()
             if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    if sizes and lcfg.rank > min(sizes):
        raise UserError(f"actor.lora.rank={lcfg.rank} does not fit the model: its smallest targeted layer has "
                        f"{min(sizes)} features; expected a rank up to {min(sizes)}")


# ---------------------------------------------------------------- folders
def merge_folder(adapter_dir: str, out_dir: str) -> str:
    """Write base + adapter merged as a plain Hugging Face folder (weights, config, tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = adapter_base(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(adapter_dir if os.path.exists(os.path.join(adapter_dir, "tokenizer.json")) else base,
                         out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "merge":
        print("usage: python -m areal_kit.rl.lora merge ADAPTER_DIR OUT_DIR", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        print(merge_folder(argv[1], argv[2]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A decoder model's shape (layers, widths, vocabulary), from its config.json or a table of the
presets' models: what the memory plan (rl/memory.py) and the LoRA checks count parameters from.

    from areal_kit.rl import shapes
    shapes.model_shape("/storage/models/DeepSeek-R1-Distill-Qwen-1.5B").params   # 1777088000
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from areal_kit.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape (Qwen2/Llama layout: q, k, v, o; a gated MLP; two norms a layer)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True
    head_dim: int = 0  # 0: hidden / heads
    source: str = ""  # where the shape came from, for the plan's header

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        kv = self.kv_heads * self.dim
        q = self.heads * self.dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def lora_params(self, rank: int, targets: str | list[str] = "all-linear") -> int:
        """Parameters of a rank-`rank` LoRA adapter on the blocks' linear layers named in targets
        ("all-linear": all of them; the LM head never has one): rank x (in + out) each."""
        kv, q, h, i = self.kv_heads * self.dim, self.heads * self.dim, self.hidden, self.intermediate
        dims = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        names = dims if targets == "all-linear" else [t.split(".")[-1] for t in targets]
        return self.layers * rank * sum(dims.get(n, 0) for n in names)

    def vllm_lora_params(self, max_lora_rank: int, max_loras: int, tp: int = 1) -> int:
        """Elements of the LoRA buffers a vLLM engine with enable_lora allocates on each GPU at
        start: for every linear layer of every block (vLLM wraps them all when it is not given
        target modules, whichever layers an adapter targets), max_loras slots of A (max_lora_rank x
        its input) and B (its output x max_lora_rank), per slice of a packed layer (q, k, v; gate,
        up); a column-parallel layer's output and a row-parallel one's input split over TP."""
        h, q, i = self.hidden, self.heads * self.dim // tp, self.intermediate // tp
        kv = max(1, self.kv_heads // tp) * self.dim
        qkv, o = 3 * h + q + 2 * kv, q + h
        gate_up, down = 2 * h + 2 * i, i + h
        return self.layers * max_loras * max_lora_rank * (qkv + o + gate_up + down)

    def layer_values_per_token(self) -> int:
        """About the values one layer keeps a token for its backward: the norms' outputs and the
        residual stream (6 x hidden), k and v, and the MLP's gate, up, activation and product."""
        return 6 * self.hidden + 2 * self.kv_heads * self.dim + 4 * self.intermediate


# The fallback where the model folder is not on this machine (a dry run on a laptop): the shapes of
# the presets' models, as their config.json on the Hugging Face hub gives them. A folder's own
# config.json always wins.
KNOWN_MODELS = {
    "DeepSeek-R1-Distill-Qwen-1.5B": ModelShape("DeepSeek-R1-Distill-Qwen-1.5B", hidden=1536, layers=28, heads=12,
                                                kv_heads=2, intermediate=8960, vocab=151936, tied=False),
    "DeepSeek-R1-Distill-Qwen-7B": ModelShape("DeepSeek-R1-Distill-Qwen-7B", hidden=3584, layers=28, heads=28,
                                              kv_heads=4, intermediate=18944, vocab=152064, tied=False),
}


def shape_from_config(name: str, c: dict, source: str = "") -> ModelShape:
    """The shape a Hugging Face config.json describes."""
    return ModelShape(name, hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
                      kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                      intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                      tied=bool(c.get("tie_word_embeddings", False)),
                      qkv_bias=c.get("model_type") == "qwen2" or bool(c.get("attention_bias", False)),
                      head_dim=c.get("head_dim") or 0, source=source)


def model_shape(path: str) -> ModelShape | None:
    """The model's shape from its folder's config.json, else from KNOWN_MODELS by the folder's
    name, else None."""
    name = os.path.basename(str(path).rstrip("/"))
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file):
        try:
            with open(cfg_file) as f:
                return shape_from_config(name, json.load(f), source=cfg_file)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{cfg_file} does not describe a model's shape ({type(e).__name__}: {e}); "
                            "expected a Hugging Face config.json") from None
    known = KNOWN_MODELS.get(name)
    if known is None:
        return None
    return replace(known, source=f"rl/shapes.py's table of the presets' models, as {path} is not here")

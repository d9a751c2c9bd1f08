"""Variable-length causal attention for packed micro-batches where flash-attn is absent (CPU, or a
GPU image built without it): `choose` picks flash-attn or this, `explain` says which for the log.

A packed micro-batch is one row holding several sequences whose position ids restart at 0.
flash-attn's varlen kernel attends within each sequence only. Without it, transformers' SDPA path
builds a dense block-diagonal mask over the whole row and computes every query against every key,
then masks most of it away: quadratic in the row's length, which ate packing's gain on CPU. Here
attention runs per sequence (one batched causal SDPA call per distinct length), so it costs
sum(len_i^2) like flash-attn varlen; every other layer still runs on the packed row.

    from areal_kit.rl.algo import varlen
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=varlen.choose("cpu"))
    model(input_ids=ids[None], position_ids=pos[None], use_cache=False)   # pos restarts per sequence
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

NAME = "areal_varlen"


def register() -> str:
    """Make NAME a transformers attn_implementation (in this process); returns NAME."""

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


FLASH = "flash_attention_2"


def flash_attn_version() -> str | None:
    """The installed flash-attn's version ("unknown" without package metadata), None when absent."""

    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def choose(device: str) -> str:
    """The trainer's attn_implementation: flash-attn's varlen kernel on GPUs that have it, else ours."""
    if device == "cuda" and flash_attn_version() is not None:
        return FLASH
    return register()


def explain(device: str) -> str:
    """Which attention `choose(device)` runs and why, in words for the log."""
    version = flash_attn_version()
    if device == "cuda" and version is not None:
        return f"{FLASH} (flash-attn {version}, varlen kernel)"
    why = "on CPU" if device != "cuda" else "flash-attn is not installed"
    return f"{NAME} (per-sequence SDPA; {why})"


def _mask(**kw):
    """No mask when nothing is padded (flash-attn's rule: no dense T x T mask is built); padded
    batches get SDPA's mask, for the stock SDPA path `attention` then falls back to."""

    return None if flash_attention_mask(**kw) is None else sdpa_mask(**kw)


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence of a [T] position row (a new one starts at 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [int(position_ids.numel())]
    return list(zip(starts, ends))


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              position_ids=None, **kwargs):
    """transformers attention interface: q/k/v [B, H, T, D] -> ([B, T, H, D], None)."""
    if attention_mask is not None or query.shape[0] != 1 or position_ids is None or query.shape[2] != key.shape[2]:
        # Padding, a real batch or a KV cache: not a packed row, so the stock SDPA path is right.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    p = dropout if module.training else 0.0
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    pieces, order = [], []
    # Sequences of equal length run as one batched call: an RL batch repeats lengths a lot (a
    # group's short answers, the tiny task's fixed length), and per-call overhead dominates there.
    for idx, n, length in _groups(segments(position_ids[0]), q.device):
        def grab(x, idx=idx, n=n, length=length):  # [n, H, L, D]
            return x[:, idx].unflatten(1, (n, length)).transpose(0, 1)

        o = F.scaled_dot_product_attention(grab(q), grab(k), grab(v), dropout_p=p, is_causal=True,
                                           scale=scaling, enable_gqa=gqa)
        pieces.append(o.transpose(0, 1).flatten(1, 2))  # [H, n * L, D]
        order.append(idx)
    out = torch.cat(pieces, dim=1)
    if len(pieces) > 1:  # one group is the whole row in order already
        perm = torch.cat(order)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        out = out[:, inverse]
    return out.transpose(0, 1)[None].contiguous(), None


def _groups(segs: list[tuple[int, int]], device):
    """(token indices, count, length) per distinct sequence length, indices sequence-major."""
    by_len: dict[int, list[int]] = {}
    for s, e in segs:
        by_len.setdefault(e - s, []).append(s)
    for length, starts in by_len.items():
        idx = (torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)).flatten()
        yield idx, len(starts), length


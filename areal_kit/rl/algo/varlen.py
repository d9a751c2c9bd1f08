"""Variable-length causal attention for packed micro-batches where flash-attn is absent (CPU, or a
GPU image built without it): `choose` picks flash-attn or this, `explain` says which for the log.

A packed micro-batch is one row holding several sequences whose position ids restart at 0.
flash-attn's varlen kernel attends within each sequence only. Without it, transformers' SDPA path
builds a dense block-diagonal mask over the whole row and computes every query against every key,
then masks most of it away: quadratic in the row's length, which ate packing's gain on CPU. Here
attention runs per sequence (one batched causal SDPA call per distinct length), so it costs
sum(len_i^2) like flash-attn varlen; every other layer still runs on the packed row. A sequence
may also read a prefix elsewhere in the row (packing's shared prompts: a group's answers attend
to one copy of their prompt), which flash-attn's kernel cannot express.

Where the sequences lie is worked out once a micro-batch, on the host, from the lengths the packer
knows (`layout_kwargs`), and handed to every layer through the model's forward: read back from the
position ids in each layer, it would be a device-to-host sync per layer on a GPU. The same goes
for flash-attn, whose transformers wrapper otherwise derives its varlen arguments per layer.

    from areal_kit.rl.algo import varlen
    attn = varlen.choose("cpu")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    model(input_ids=ids[None], position_ids=pos[None], use_cache=False,    # pos restarts per sequence
          **varlen.layout_kwargs(attn, packed.views, device))              # optional: no per-layer sync
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
from dataclasses import dataclass
from typing import Any

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


def _mask(**kw: Any) -> torch.Tensor | None:
    """No mask when nothing is padded (flash-attn's rule: no dense T x T mask is built); padded
    batches get SDPA's mask, for the stock SDPA path `attention` then falls back to."""

    return None if flash_attention_mask(**kw) is None else sdpa_mask(**kw)


@dataclass(frozen=True)
class Layout:
    """Where a packed row's causal sequences (packing.View) lie, for `attention`, per distinct
    length: (token indices [n * length], sequence-major; n; length; the positions among those
    whose outputs the sequences own, None for all). Then the permutation that puts the owned
    outputs back in the row's order (None when they are in order already)."""

    groups: tuple[tuple[torch.Tensor, int, int, torch.Tensor | None], ...]
    inverse: torch.Tensor | None


def layout(views: list[tuple[int, int, int, int]], device: torch.device | str) -> Layout:
    """The Layout of a row of views: (prefix start, prefix length, own start, own length) each.
    Worked out on the host, then moved: no read-back from the device."""
    by_len: dict[int, list[tuple[int, int, int, int]]] = {}
    for v in views:
        by_len.setdefault(v[1] + v[3], []).append(v)
    groups, owned = [], []
    for length, vs in by_len.items():
        t = torch.tensor(vs, dtype=torch.long)
        ar = torch.arange(length)
        pre = t[:, 1:2]
        idx = torch.where(ar < pre, t[:, 0:1] + ar, t[:, 2:3] + ar - pre).flatten()
        keep = None
        if any(v[1] for v in vs):  # a prefix is read, not written: only the own tokens' outputs are kept
            keep = torch.arange(len(vs) * length).masked_select((ar >= pre).flatten())
        owned.append(idx if keep is None else idx[keep])
        groups.append((idx.to(device), len(vs), length, None if keep is None else keep.to(device)))
    perm = torch.cat(owned)
    if torch.equal(perm, torch.arange(perm.numel())):
        return Layout(tuple(groups), None)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    return Layout(tuple(groups), inverse.to(device))


def layout_kwargs(attn: str, views: list[tuple[int, int, int, int]],
                  device: torch.device | str) -> dict[str, torch.Tensor | int | Layout]:
    """The model forward's keyword arguments that tell attention `attn` where the causal sequences
    (packing.Packed.views) of a packed row lie: flash-attn's varlen arguments (cumulative lengths,
    longest; contiguous sequences only), or our Layout. Once a micro-batch, from host-side
    lengths: no layer reads anything back."""
    if attn == FLASH:
        if any(pre for _, pre, _, _ in views):
            raise ValueError("flash-attn's varlen kernel takes contiguous sequences, not shared prompts")
        seq_lens = [n for _, _, _, n in views]
        cu = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=device)
        longest = max(seq_lens)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return {"packed_layout": layout(views, device)}


def segments(position_ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """The views of a [T] position row of contiguous sequences (a new one starts at 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [int(position_ids.numel())]
    return [(s, 0, s, e - s) for s, e in zip(starts, ends)]


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              position_ids: torch.Tensor | None = None, packed_layout: Layout | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q/k/v [B, H, T, D] -> ([B, T, H, D], None). Without
    packed_layout (`layout_kwargs`) the sequences are found from the position ids, in every layer."""
    if attention_mask is not None or query.shape[0] != 1 or position_ids is None or query.shape[2] != key.shape[2]:
        # Padding, a real batch or a KV cache: not a packed row, so the stock SDPA path is right.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    p = dropout if module.training else 0.0
    q, k, v = query[0], key[0], value[0]  # [H, T, D]
    lay = packed_layout if packed_layout is not None else layout(segments(position_ids[0]), q.device)
    pieces = []
    # Sequences of equal length run as one batched call: an RL batch repeats lengths a lot (a
    # group's short answers, the tiny task's fixed length), and per-call overhead dominates there.
    for idx, n, length, keep in lay.groups:
        def grab(x: torch.Tensor, idx: torch.Tensor = idx, n: int = n, length: int = length) -> torch.Tensor:
            # [n, H, L, D]
            return x[:, idx].unflatten(1, (n, length)).transpose(0, 1)

        o = F.scaled_dot_product_attention(grab(q), grab(k), grab(v), dropout_p=p, is_causal=True,
                                           scale=scaling, enable_gqa=gqa).transpose(0, 1).flatten(1, 2)
        # [H, n * L, D]; a shared prompt's outputs come from the view that owns it, once.
        pieces.append(o if keep is None else o[:, keep])
    out = torch.cat(pieces, dim=1)
    if lay.inverse is not None:
        out = out[:, lay.inverse]
    return out.transpose(0, 1)[None].contiguous(), None


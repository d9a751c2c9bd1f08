"""Pack variable-length sequences into micro-batches without padding.

Sequences of a micro-batch are concatenated into one row; position ids restart at 0 for each
sequence and attention runs within each (flash-attn's varlen kernel, or rl/algo/varlen.py), so no
token attends across a boundary and no compute goes to padding. With share_prompts (our attention
only) a group's answers share one copy of their prompt.

    bins = partition(lengths, max_tokens=4096, n_bins=None)   # -> list of index lists
    batch = pack(prompts, answers, share_prompts=True)       # -> input_ids, position_ids, views, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def min_bins(lengths: list[int], max_tokens: int) -> int:
    """Fewest bins first-fit-decreasing needs to hold every length under max_tokens."""
    return len(_ffd(lengths, max_tokens))


def _ffd(lengths: list[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(f"a sequence of {n} tokens does not fit max_tokens_per_mb={max_tokens}")
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def partition(lengths: list[int], max_tokens: int, n_bins: int | None = None) -> list[list[int]]:
    """Split sequence indices into micro-batches of at most max_tokens tokens.

    With n_bins, exactly that many bins (every DeepSpeed rank must run the same number of
    micro-batches); n_bins must be >= min_bins. When n_bins exceeds the number of sequences the
    extra bins are empty (the trainer runs a zero-weight dummy pass for them). Indices in each
    bin are sorted so the original order is easy to restore.
    """
    bins = _ffd(lengths, max_tokens)
    if n_bins is not None:
        if n_bins < len(bins):
            raise ValueError(f"cannot split {len(lengths)} sequences into {n_bins} micro-batches "
                             f"(needs at least {len(bins)})")
        # Splitting a bin never breaks the token budget, so we can always reach n_bins.
        while len(bins) < n_bins and any(len(b) > 1 for b in bins):
            big = max(bins, key=len)
            half = len(big) // 2
            bins.append(big[half:])
            del big[half:]
        bins += [[] for _ in range(n_bins - len(bins))]
    return [sorted(b) for b in bins]


# A causal sequence as attention sees it: (prefix start, prefix length, own start, own length) in
# the packed row. Its tokens are the prefix's then its own; it writes the attention output of its
# own tokens only. A plain sequence has no prefix; the later answers to a shared prompt have the
# prompt's copy as their prefix (rl/algo/varlen.py attends over views).
View = tuple[int, int, int, int]


@dataclass
class Packed:
    input_ids: torch.Tensor  # [T] tokens of all sequences, concatenated
    position_ids: torch.Tensor  # [T] each sequence's own positions (an answer continues its prompt's)
    views: list[View]  # the causal sequences attention runs over, in row order
    # Answer tokens of the packed sequences, sequence after sequence: the position whose hidden
    # state predicts each (logits at t predict token t+1) and the token itself.
    pred_pos: torch.Tensor  # [N] long
    targets: torch.Tensor  # [N] long

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.numel())


class Answers:
    """Where each sequence's answer tokens sit in flat per-token tensors (the answers of a batch
    concatenated, sequence after sequence): one tensor op covers a whole batch or micro-batch,
    where a tensor per sequence cost a few microseconds each, times hundreds of sequences a step.

        ans = Answers([2, 1, 3])
        ans.index([2, 0])    # tensor([3, 4, 5, 0, 1]): sequence 2's tokens, then sequence 0's
    """

    def __init__(self, lens: list[int]):
        self.lens = torch.tensor(lens, dtype=torch.long)
        self.starts = torch.cumsum(self.lens, 0) - self.lens
        self.n_tokens = int(self.lens.sum())

    def __len__(self) -> int:
        return int(self.lens.numel())

    def index(self, rows: list[int]) -> torch.Tensor:
        """Flat positions of the answer tokens of `rows`, row after row, in order: the order in
        which a Packed of those rows lays them out (its answer_mask positions)."""
        r = torch.as_tensor(rows, dtype=torch.long)
        lens = self.lens[r]
        before = torch.cumsum(lens, 0) - lens  # where each row's run starts in the result
        return torch.repeat_interleave(self.starts[r] - before, lens) + torch.arange(int(lens.sum()))

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.split(self.lens.tolist()))


def pack(prompts: list[list[int]], answers: list[list[int]], share_prompts: bool = False) -> Packed:
    """Concatenate (prompt + answer) token lists into one packed row.

    share_prompts: sequences with the same prompt (a GRPO group's answers) hold one copy of it,
    which each of their answers attends to; every layer but attention then runs on it once, not
    group_size times. The hidden states, and so the logprobs, are those of the unshared row.
    """
    ids: list[int] = []
    pos: list[int] = []
    views: list[View] = []
    pred: list[int] = []
    copies: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (start, length) of its copy
    for p, a in zip(prompts, answers):
        s, key = len(ids), tuple(p)
        copy = copies.get(key) if share_prompts else None
        if copy is None:
            ids.extend(p)
            ids.extend(a)
            pos.extend(range(len(p) + len(a)))
            views.append((s, 0, s, len(p) + len(a)))
            # Position t predicts token t+1: answer tokens are predicted from p-1 .. n-2.
            pred.extend(range(s + len(p) - 1, s + len(p) + len(a) - 1))
            if share_prompts:
                copies[key] = (s, len(p))
        elif a:  # its prompt is in the row already: the answer alone, after that prompt's positions
            start, n = copy
            ids.extend(a)
            pos.extend(range(n, n + len(a)))
            views.append((start, n, s, len(a)))
            pred.append(start + n - 1)
            pred.extend(range(s, s + len(a) - 1))
    return Packed(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), views,
                  torch.tensor(pred, dtype=torch.long), torch.tensor([t for a in answers for t in a], dtype=torch.long))


def pad(prompts: list[list[int]], answers: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout (for the packing benchmark): [B, L] ids and attention mask."""
    rows = [p + a for p, a in zip(prompts, answers)]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        att[i, :len(r)] = 1
    return ids, att

"""Advantages of PPO/GRPO without a critic, all in one place.

The driver's half runs on whole groups (rl/algo/batch.py's shape_rewards): group_normalize and
zero_adv_groups. The trainer's half runs on one rank's shard of flat answer tokens
(rl/algo/ppo.py's PPOActor): token_advantages, i.e. the per-token KL reward, the discounted
returns and ppo.adv_norm's normalisation with moments summed over the ranks.

    python -m pytest tests/unit/test_functional.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from areal_kit.config.schema import PPOConfig


def group_moments(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's reward mean and (population) std, groups being consecutive runs of group_size."""
    g = rewards.view(-1, group_size)
    mean = g.mean(dim=1)
    std = g.std(dim=1, unbiased=False) if group_size > 1 else torch.zeros_like(mean)
    return mean, std


def group_normalize(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), groups being consecutive runs of group_size."""
    mean, std = group_moments(rewards, group_size)
    return ((rewards.view(-1, group_size) - mean[:, None]) / (std[:, None] + eps)).view(-1)


def zero_adv_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool per group: all rewards equal, so the group gives no learning signal."""
    g = rewards.view(-1, group_size)
    return (g.max(dim=1).values - g.min(dim=1).values).abs() < 1e-8


def token_returns(seq_rewards: torch.Tensor, token_rewards: torch.Tensor, seq_lens: list[int],
                  discount: float) -> torch.Tensor:
    """Discounted return of every generated token.

    seq_rewards: one final reward per sequence (credited to its last token);
    token_rewards: per-token rewards (e.g. -kl_ctl * kl) over the flat concatenation of the
    sequences' generated tokens, lengths seq_lens. Without a critic this is also the advantage.
    All sequences at once: each is a row of a [sequences, longest] grid, zero after its end, so
    every row's sums run backwards in the same order as that sequence alone would.
    """
    lens = torch.as_tensor(seq_lens, dtype=torch.long)
    n_seq, longest = len(seq_lens), max(seq_lens, default=0)
    row = seq_of_token(seq_lens)
    col = torch.arange(token_rewards.numel()) - (torch.cumsum(lens, 0) - lens)[row]
    grid = token_rewards.new_zeros(n_seq, longest)
    grid[row, col] = token_rewards
    grid[torch.arange(n_seq), lens - 1] += seq_rewards.to(grid.dtype)
    if discount == 1.0:
        grid = grid.flip(1).cumsum(1).flip(1)
    else:
        acc = grid.new_zeros(n_seq)
        for t in range(longest - 1, -1, -1):
            acc = grid[:, t] + discount * acc
            grid[:, t] = acc
    return grid[row, col]


def seq_of_token(seq_lens: list[int]) -> torch.Tensor:
    """The sequence number of every token of the flat concatenation of sequences of seq_lens."""
    return torch.repeat_interleave(torch.arange(len(seq_lens)), torch.as_tensor(seq_lens, dtype=torch.long))


def masked_normalize(x: torch.Tensor, eps: float = 1e-5,
                     stats: tuple[float, float, float] | None = None) -> torch.Tensor:
    """(x - mean) / (std + eps); stats=(sum, sum_sq, count) lets ranks share global moments."""
    s, sq, n = stats if stats is not None else (x.sum().item(), x.pow(2).sum().item(), x.numel())
    mean = s / max(n, 1)
    var = max(sq / max(n, 1) - mean * mean, 0.0)
    return (x - mean) / (var ** 0.5 + eps)


def token_advantages(seq_rewards: torch.Tensor, seq_lens: list[int], mask: torch.Tensor, kls: torch.Tensor | None,
                     ppo: PPOConfig, allreduce: Callable[[list[float]], list[float]] = lambda v: v) -> torch.Tensor:
    """Every answer token's advantage (flat): its sequence's seq_reward plus, under
    ppo.kl_mode=reward, the per-token KL reward -kl_ctl * kl, as discounted returns; then, under
    ppo.adv_norm, normalised with the mean and std of the tokens the loss mask covers (a workflow's
    inserted tokens are not the policy's). allreduce sums those moments over the ranks."""
    if kls is not None and ppo.kl_mode == "reward":
        tok_r = -ppo.kl_ctl * kls * mask
    else:
        tok_r = torch.zeros(mask.numel())
    ret = token_returns(seq_rewards, tok_r, seq_lens, ppo.discount)
    if ppo.adv_norm:
        s, sq, n = allreduce([(ret * mask).sum().item(), (ret.pow(2) * mask).sum().item(), mask.sum().item()])
        ret = masked_normalize(ret, stats=(s, sq, n))
    return ret

"""From scored samples to a training batch: reward shaping, group normalization, step stats (and
what the episodes did: episode_stats).

Rewards: task_reward (the verifier's) + format_reward (ppo.format_reward, when on) + the
overlong penalty (ppo.overlong_buffer, DAPO's), or ppo.non_stop_penalty_value for a truncated
answer when ppo.non_stop_penalty is on; that * reward_output_scaling + reward_output_bias, then,
for GRPO (group_adv_norm), normalized within each prompt's group. Groups whose rewards are all
equal carry no signal: counted as perc_zero_adv, dropped when skip_zero_adv_groups. Under
ppo.overlong_filter a truncated answer keeps its place in its group's baseline but its loss mask
is zeroed. Dynamic sampling (DAPO) picks groups before all this, on the raw task reward:
informative_groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from areal_kit.rl.algo import advantage as A
from areal_kit.rl.sample import Sample

if TYPE_CHECKING:
    from areal_kit.config.schema import PPOConfig


def sample_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of one prompt: the same (seed, step, prompt) always samples the same answers
    (a batch-mode engine call samples from one seed mixed from its prompts': the same call, the same answers)."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


def informative_groups(samples: list[Sample]) -> tuple[list[list[Sample]], int]:
    """(groups whose task rewards are not all equal, how many groups were dropped), in arrival
    order. The verifier's reward decides, never the shaped one: a format bonus or an overlong
    penalty that differs within a group of equally right answers is no signal about the task."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.id, s.group), []).append(s)
    keep = [g for g in groups.values() if len({s.task_reward for s in g}) > 1]
    return keep, len(groups) - len(keep)


def overlong_penalty(n_tokens: int, ppo: PPOConfig) -> float:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - overlong_buffer tokens, then a
    linear ramp to -overlong_penalty_factor at max_new_tokens."""
    buf, limit = ppo.overlong_buffer, ppo.gen.max_new_tokens
    if not buf:
        return 0.0
    return min(0.0, (limit - buf - n_tokens) / buf * ppo.overlong_penalty_factor)


@dataclass(frozen=True)
class Shaped:
    """What reward shaping makes of a step's samples."""

    samples: list[Sample]  # every sample given, with final_reward and seq_reward, each group contiguous
    train: list[Sample]  # the ones to train on: all, or those of groups with a signal under skip_zero_adv_groups
    perc_zero_adv: float  # the fraction of groups whose rewards are all equal
    final_reward_mean: float
    overlong_penalty: float | None = None  # the mean overlong penalty, under ppo.overlong_buffer
    overlong_masked: float | None = None  # the fraction of `train` whose loss is masked, under ppo.overlong_filter


def shape_rewards(samples: list[Sample], ppo: PPOConfig) -> Shaped:
    """The step's samples with their shaped rewards, the ones to train on, and the stats."""
    g = ppo.group_size
    # Samples arrive per engine; regroup by (prompt id, group) so groups are contiguous.
    ordered = sorted(samples, key=lambda s: (s.id, s.group))
    task = torch.tensor([_raw_reward(s, ppo) for s in ordered], dtype=torch.float32)
    reward = task * ppo.reward_output_scaling + ppo.reward_output_bias
    zero = A.zero_adv_groups(reward, g)
    seq = A.group_normalize(reward, g) if ppo.group_adv_norm else reward
    shaped = [replace(s, seq_reward=r, final_reward=rr) for s, r, rr in zip(ordered, seq.tolist(), reward.tolist())]
    keep = shaped
    if ppo.skip_zero_adv_groups and not bool(zero.all()):
        drop = set(torch.nonzero(zero).flatten().tolist())
        keep = [s for i, s in enumerate(shaped) if i // g not in drop]
    penalty = masked = None
    if ppo.overlong_buffer:
        penalty = sum(overlong_penalty(s.model_len, ppo) for s in ordered) / len(ordered)
    if ppo.overlong_filter:
        masked = sum(s.no_eos for s in keep) / max(len(keep), 1)
        keep = [replace(s, loss_mask=[0] * len(s.output_ids)) if s.no_eos else s for s in keep]
    return Shaped(shaped, keep, perc_zero_adv=float(zero.float().mean()),
                  final_reward_mean=float(reward.mean()), overlong_penalty=penalty, overlong_masked=masked)


def _raw_reward(s: Sample, ppo: PPOConfig) -> float:
    if ppo.non_stop_penalty and s.no_eos:
        return ppo.non_stop_penalty_value
    shaped = s.task_reward + (0.0 if s.format_reward is None else s.format_reward)
    return shaped + overlong_penalty(s.model_len, ppo) if ppo.overlong_buffer else shaped


def step_stats(samples: list[Sample], shaped: Shaped, train: dict) -> dict:
    """A step's metrics row: of the samples it generated, of their shaping, and of the trainer's stats (train)."""
    n = len(samples)
    out_lens = [len(s.output_ids) for s in samples]
    model_lens = [s.model_len for s in samples]  # a tool's inserted tokens are context, not answer length
    prompt_lens = [len(s.prompt_ids) for s in samples]
    row = {
        "ppo_approx_kl": train.get("ppo_approx_kl", 0.0),
        "actor_loss": train.get("actor_loss", 0.0),
        "actor_clip_ratio": train.get("actor_clip_ratio", 0.0),
        "importance_weight": train.get("importance_weight", 1.0),
        "task_reward": sum(s.task_reward for s in samples) / n,
        "kl_reward": train.get("kl_reward", 0.0),
        "final_reward": shaped.final_reward_mean + train.get("kl_reward", 0.0),
        "advantage": train.get("advantage", 0.0),
        "avg_seq_len": sum(model_lens) / n,
        "avg_prompt_len": sum(prompt_lens) / n,
        "n_tokens": sum(out_lens) + sum(prompt_lens),
        "n_valid_tokens": int(train.get("n_valid_tokens", sum(out_lens))),
        "n_seqs": n,
        "no_eos_ratio": sum(s.no_eos for s in samples) / n,
        "perc_zero_adv": shaped.perc_zero_adv,
    }
    if any(s.format_reward is not None for s in samples):
        row["format_reward"] = sum(0.0 if s.format_reward is None else s.format_reward for s in samples) / n
    if shaped.overlong_penalty is not None:
        row["overlong_penalty"] = shaped.overlong_penalty
    if shaped.overlong_masked is not None:
        row["overlong_masked"] = shaped.overlong_masked
    by_source: dict[str, list[float]] = {}
    for s in samples:
        if s.source is not None:
            by_source.setdefault(s.source, []).append(s.task_reward)
    for src, rewards in sorted(by_source.items()):
        row[f"task_reward/{src}"] = sum(rewards) / len(rewards)
    for k in ("entropy", "grad_norm", "lr"):
        if k in train:
            row[k] = train[k]
    return row


def episode_stats(samples: list[Sample], failed_calls: int) -> dict:
    """What a step's episodes did, for a workflow's and an agent's alike: means per episode of the
    model's turns, its tool calls (a model turn the environment answered: api.Trajectory.n_tool_calls),
    the environment's tokens after the prompt (loss mask 0) and the model's (loss mask 1); the share
    of episodes with a tool call; and the engine calls refused or failed in the step (a count)."""
    n = len(samples)
    return {
        "episode/turns": sum(s.turns for s in samples) / n,
        "episode/tool_calls": sum(s.tool_calls for s in samples) / n,
        "episode/tool_call_share": sum(1 for s in samples if s.tool_calls) / n,
        "episode/failed_calls": failed_calls,
        "episode/env_tokens": sum(len(s.output_ids) - s.model_len for s in samples) / n,
        "episode/model_tokens": sum(s.model_len for s in samples) / n,
    }

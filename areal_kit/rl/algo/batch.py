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

An episode of several sequences (an agent's calls that do not extend each other: segments, one
Sample each) counts once wherever episodes are counted: in its group's baseline (with the reward
of its last segment), in the truncation and length rules (its last segment's end, its model tokens
together) and in the per-episode metrics; each of its segments is a sequence of the trainer's
batch, its advantage its own reward against its group's episodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
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
    penalty that differs within a group of equally right answers is no signal about the task. An
    episode of segments counts with its last one's."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.id, s.group), []).append(s)
    keep = [g for g in groups.values() if len({ep[-1].task_reward for ep in episodes(g)}) > 1]
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
    trained: list[int]  # where each of `train` is in `samples`
    perc_zero_adv: float  # the fraction of groups whose rewards are all equal
    final_reward_mean: float
    overlong_penalty: float | None = None  # the mean overlong penalty, under ppo.overlong_buffer
    overlong_masked: float | None = None  # the fraction of `train` whose loss is masked, under ppo.overlong_filter


def episodes(samples: list[Sample]) -> list[list[Sample]]:
    """The samples by episode, in the order met: the segments of one (Sample.episode) together, in
    their order; any other sample an episode of its own."""
    out: dict[object, list[Sample]] = {}
    for i, s in enumerate(samples):
        out.setdefault(i if s.episode is None else (s.id, s.group, s.episode), []).append(s)
    return list(out.values())


def shape_rewards(samples: list[Sample], ppo: PPOConfig) -> Shaped:
    """The step's samples with their shaped rewards, the ones to train on, and the stats."""
    g = ppo.group_size
    # Samples arrive per engine; regroup by (prompt id, group) so groups are contiguous (a stable
    # sort: an episode's segments stay in order).
    eps = episodes(sorted(samples, key=lambda s: (s.id, s.group)))
    ordered = [s for ep in eps for s in ep]
    ep_of = [i for i, ep in enumerate(eps) for _ in ep]
    raw = [_raw_reward(s, ppo, sum(x.model_len for x in ep), ep[-1].no_eos) for ep in eps for s in ep]
    reward = torch.tensor(raw, dtype=torch.float32) * ppo.reward_output_scaling + ppo.reward_output_bias
    last = torch.tensor(list(accumulate(len(ep) for ep in eps)), dtype=torch.long) - 1
    episode_reward = reward[last]  # an episode's reward: its last segment's
    zero = A.zero_adv_groups(episode_reward, g)
    seq = reward
    if ppo.group_adv_norm:  # each sequence's reward against the moments of its group's episodes
        mean, std = A.group_moments(episode_reward, g)
        group = torch.tensor(ep_of, dtype=torch.long) // g
        seq = (reward - mean[group]) / (std[group] + 1e-6)
    shaped = [replace(s, seq_reward=r, final_reward=rr) for s, r, rr in zip(ordered, seq.tolist(), reward.tolist())]
    keep = list(zip(ep_of, shaped))
    trained = list(range(len(shaped)))
    if ppo.skip_zero_adv_groups and not bool(zero.all()):
        drop = set(torch.nonzero(zero).flatten().tolist())
        trained = [i for i, e in enumerate(ep_of) if e // g not in drop]
        keep = [keep[i] for i in trained]
    penalty = masked = None
    if ppo.overlong_buffer:
        penalty = sum(overlong_penalty(sum(s.model_len for s in ep), ppo) for ep in eps) / len(eps)
    if ppo.overlong_filter:  # an episode whose last answer was cut: every segment of it
        cut = {e for e, ep in enumerate(eps) if ep[-1].no_eos}
        kept = {e for e, _ in keep}
        masked = len(cut & kept) / max(len(kept), 1)
        keep = [(e, replace(s, loss_mask=[0] * len(s.output_ids)) if e in cut else s) for e, s in keep]
    return Shaped(shaped, [s for _, s in keep], trained, perc_zero_adv=float(zero.float().mean()),
                  final_reward_mean=float(episode_reward.mean()), overlong_penalty=penalty, overlong_masked=masked)


def _raw_reward(s: Sample, ppo: PPOConfig, model_len: int, no_eos: bool) -> float:
    """A sequence's reward before scaling; model_len and no_eos are its episode's."""
    if ppo.non_stop_penalty and no_eos:
        return ppo.non_stop_penalty_value
    shaped = s.task_reward + (0.0 if s.format_reward is None else s.format_reward)
    return shaped + overlong_penalty(model_len, ppo) if ppo.overlong_buffer else shaped


def step_stats(samples: list[Sample], shaped: Shaped, train: dict) -> dict:
    """A step's metrics row: of the samples it generated, of their shaping, and of the trainer's
    stats (train). Rewards, truncation and answer lengths are per episode (an episode of segments
    by its last one), prompt lengths and token counts per sequence."""
    eps = episodes(samples)
    n = len(eps)
    ends = [ep[-1] for ep in eps]
    out_lens = [len(s.output_ids) for s in samples]
    # A tool's inserted tokens are context, not answer length.
    model_lens = [sum(s.model_len for s in ep) for ep in eps]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    row = {
        "ppo_approx_kl": train.get("ppo_approx_kl", 0.0),
        "actor_loss": train.get("actor_loss", 0.0),
        "actor_clip_ratio": train.get("actor_clip_ratio", 0.0),
        "importance_weight": train.get("importance_weight", 1.0),
        "task_reward": sum(s.task_reward for s in ends) / n,
        "kl_reward": train.get("kl_reward", 0.0),
        "final_reward": shaped.final_reward_mean + train.get("kl_reward", 0.0),
        "advantage": train.get("advantage", 0.0),
        "avg_seq_len": sum(model_lens) / n,
        "avg_prompt_len": sum(prompt_lens) / len(samples),
        "n_tokens": sum(out_lens) + sum(prompt_lens),
        "n_valid_tokens": int(train.get("n_valid_tokens", sum(out_lens))),
        "n_seqs": len(samples),
        "no_eos_ratio": sum(s.no_eos for s in ends) / n,
        "perc_zero_adv": shaped.perc_zero_adv,
    }
    if any(s.format_reward is not None for s in ends):
        row["format_reward"] = sum(0.0 if s.format_reward is None else s.format_reward for s in ends) / n
    if shaped.overlong_penalty is not None:
        row["overlong_penalty"] = shaped.overlong_penalty
    if shaped.overlong_masked is not None:
        row["overlong_masked"] = shaped.overlong_masked
    by_source: dict[str, list[float]] = {}
    for s in ends:
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
    model's turns, its tool calls (a model turn the environment answered: api.Trajectory.n_tool_calls,
    a segment followed by another included), its sequences (segments: calls that did not extend
    the chat before them start one), the environment's tokens after the prompt (loss mask 0) and
    the model's (loss mask 1); the share of episodes with a tool call; and the engine calls refused
    or failed in the step (a count)."""
    eps = episodes(samples)
    n = len(eps)
    calls = [sum(s.tool_calls for s in ep) + len(ep) - 1 for ep in eps]
    return {
        "episode/turns": sum(s.turns for s in samples) / n,
        "episode/tool_calls": sum(calls) / n,
        "episode/tool_call_share": sum(1 for c in calls if c) / n,
        "episode/segments": len(samples) / n,
        "episode/failed_calls": failed_calls,
        "episode/env_tokens": sum(len(s.output_ids) - s.model_len for s in samples) / n,
        "episode/model_tokens": sum(s.model_len for s in samples) / n,
    }

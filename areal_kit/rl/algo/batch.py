"""From scored samples to a training batch: reward shaping, group normalization, step stats.

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

import torch

from areal_kit.errors import UserError
from areal_kit.rl.algo import functional as Fn

# What each built-in reward reads from a dataset row.
REWARD_FIELDS = {"toy": ("answer",), "math": ("answer", "solutions"), "gsm8k": ("answer",)}


def check_rows(rows: list[dict], reward_fns: list[str]) -> None:
    """Fail before any actor starts when a row lacks what its verifier needs."""
    for name in reward_fns:
        need = REWARD_FIELDS.get(name)
        if not need:
            continue
        for row in rows:
            if not any(row.get(f) not in (None, "", []) for f in need):
                raise UserError(f"dataset row {row.get('id', '?')!r} has no {' or '.join(need)} field, which "
                                f"reward {name!r} needs; expected every row to carry the reference answer")


def sample_seed(seed: int, step: int, index: int) -> int:
    """Sampling seed of one prompt: the same (seed, step, prompt) always samples the same answers."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


def informative_groups(samples: list[dict]) -> tuple[list[list[dict]], int]:
    """(groups whose task rewards are not all equal, how many groups were dropped), in arrival
    order. The verifier's reward decides, never the shaped one: a format bonus or an overlong
    penalty that differs within a group of equally right answers is no signal about the task."""
    groups: dict[tuple, list[dict]] = {}
    for s in samples:
        groups.setdefault((s["id"], s["group"]), []).append(s)
    keep = [g for g in groups.values() if len({s["task_reward"] for s in g}) > 1]
    return keep, len(groups) - len(keep)


def overlong_penalty(n_tokens: int, ppo) -> float:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - overlong_buffer tokens, then a
    linear ramp to -overlong_penalty_factor at max_new_tokens."""
    buf, limit = ppo.overlong_buffer, ppo.gen.max_new_tokens
    if not buf:
        return 0.0
    return min(0.0, (limit - buf - n_tokens) / buf * ppo.overlong_penalty_factor)


def shape_rewards(samples: list[dict], ppo) -> dict:
    """Set seq_reward on every sample; return stats and the samples to train on."""
    g = ppo.group_size
    # Samples arrive per engine; regroup by (prompt id, group) so groups are contiguous.
    samples.sort(key=lambda s: (s["id"], s["group"]))
    task = torch.tensor([_raw_reward(s, ppo) for s in samples], dtype=torch.float32)
    reward = task * ppo.reward_output_scaling + ppo.reward_output_bias
    zero = Fn.zero_adv_groups(reward, g)
    seq = Fn.group_normalize(reward, g) if ppo.group_adv_norm else reward
    for s, r, rr in zip(samples, seq.tolist(), reward.tolist()):
        s["seq_reward"] = r
        s["final_reward"] = rr
    keep = samples
    if ppo.skip_zero_adv_groups and not bool(zero.all()):
        drop = set(torch.nonzero(zero).flatten().tolist())
        keep = [s for i, s in enumerate(samples) if i // g not in drop]
    out = {"perc_zero_adv": float(zero.float().mean()), "advantage": float(seq.mean()),
           "final_reward_mean": float(reward.mean()), "_train_samples": keep}
    if ppo.overlong_buffer:
        out["overlong_penalty"] = sum(overlong_penalty(len(s["output_ids"]), ppo) for s in samples) / len(samples)
    if ppo.overlong_filter:
        masked = [s for s in keep if s["no_eos"]]
        for s in masked:
            s["loss_mask"] = [0] * len(s["output_ids"])
        out["overlong_masked"] = len(masked) / max(len(keep), 1)
    return out


def _raw_reward(s: dict, ppo) -> float:
    if ppo.non_stop_penalty and s["no_eos"]:
        return ppo.non_stop_penalty_value
    shaped = s["task_reward"] + s.get("format_reward", 0.0)
    return shaped + overlong_penalty(len(s["output_ids"]), ppo) if ppo.overlong_buffer else shaped


def step_stats(samples: list[dict], shaped: dict, train: dict) -> dict:
    n = len(samples)
    out_lens = [len(s["output_ids"]) for s in samples]
    prompt_lens = [len(s["prompt_ids"]) for s in samples]
    row = {
        "ppo_approx_kl": train.get("ppo_approx_kl", 0.0),
        "actor_loss": train.get("actor_loss", 0.0),
        "actor_clip_ratio": train.get("actor_clip_ratio", 0.0),
        "importance_weight": train.get("importance_weight", 1.0),
        "task_reward": sum(s["task_reward"] for s in samples) / n,
        "kl_reward": train.get("kl_reward", 0.0),
        "final_reward": shaped["final_reward_mean"] + train.get("kl_reward", 0.0),
        "advantage": shaped["advantage"],
        "avg_seq_len": sum(out_lens) / n,
        "avg_prompt_len": sum(prompt_lens) / n,
        "n_tokens": sum(out_lens) + sum(prompt_lens),
        "n_valid_tokens": int(train.get("n_valid_tokens", sum(out_lens))),
        "n_seqs": n,
        "no_eos_ratio": sum(s["no_eos"] for s in samples) / n,
        "perc_zero_adv": shaped["perc_zero_adv"],
    }
    if any("format_reward" in s for s in samples):
        row["format_reward"] = sum(s.get("format_reward", 0.0) for s in samples) / n
    for k in ("overlong_penalty", "overlong_masked"):
        if k in shaped:
            row[k] = shaped[k]
    by_source: dict[str, list[float]] = {}
    for s in samples:
        if "source" in s:
            by_source.setdefault(s["source"], []).append(s["task_reward"])
    for src, rewards in sorted(by_source.items()):
        row[f"task_reward/{src}"] = sum(rewards) / len(rewards)
    for k in ("entropy", "grad_norm", "lr"):
        if k in train:
            row[k] = train[k]
    return row

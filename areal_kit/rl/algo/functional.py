"""The math of PPO/GRPO on token sequences: KL estimators, the clipped loss, its aggregation, logprobs.

The advantages are in rl/algo/advantage.py.

Pure torch functions over flat (packed) token tensors; no Ray, no DeepSpeed, so unit tests can
check them against hand-computed values:

    python -m pytest tests/unit/test_functional.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from areal_kit.rl.algo.advantage import seq_of_token


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1, k2, k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = (r^-1 - 1) + log r, with log r = logp - ref_logp.
    k1 is unbiased but noisy and can be negative; k3 is unbiased and always >= 0.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
             behav_logp: torch.Tensor | None = None, behav_cap: float | None = None,
             eps_clip_high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate per token (not reduced) and its statistics.

    old_logp is the proximal policy (the ratio's denominator). With decoupled PPO, behav_logp is
    the policy that generated the tokens: each token is weighted by exp(old - behav), and tokens
    whose weight exceeds behav_cap are dropped (weight 0), as AReaL's decoupled objective does.
    eps_clip_high (DAPO's clip-higher) is the upper clip range when it differs from eps_clip: a
    rare token with a positive advantage may then grow further, which keeps entropy from collapsing.
    """
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_high is None else eps_clip_high))
    loss = -torch.min(ratio * advantages, clipped * advantages)
    clip_mask = (ratio * advantages) > (clipped * advantages)
    weight = torch.ones_like(loss)
    if behav_logp is not None:
        weight = torch.exp(old_logp - behav_logp).detach()
        if behav_cap is not None:
            weight = torch.where(weight > behav_cap, torch.zeros_like(weight), weight)
        loss = loss * weight
    stats = {
        "approx_kl": (old_logp - logp).detach(),
        "clip": clip_mask.float(),
        "importance_weight": weight.detach() if behav_logp is not None else ratio.detach(),
    }
    return loss, stats


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy per position, from logits [T, V] (computed in fp32)."""
    logits = logits.float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # a statistic only: keep it out of the autograd graph
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# Tokens a chunk of chunked_logprobs turns into logits at once (rl/memory.py sizes the trainer's
# logits memory from it).
LOGITS_CHUNK = 1024
# Logits elements of a whole micro-batch ([T, V]) up to which chunked_logprobs keeps them for
# backward instead of recomputing them (16 MB fp32).
KEEP_LOGITS = 4 << 20


def vocab_size(head: torch.nn.Module) -> int:
    """Rows of the output head's weight. Outside the head's forward, ZeRO-3 leaves a partitioned
    weight empty (its data is torch.empty(0)) and keeps the real shape as ds_shape."""
    weight = head.weight
    assert isinstance(weight, torch.Tensor)  # a Parameter (a Module's attribute may also be a Module)
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def chunked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                     temperature: float = 1.0, chunk: int = LOGITS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_logprobs over hidden states [T, H] in chunks of `chunk` tokens.

    Peak memory holds one [chunk, V] logits block instead of [T, V]: with a 150k vocabulary and
    20k-token micro-batches that is the difference between 12 GB and 0.6 GB. Under autograd each
    chunk is checkpointed, so backward recomputes its logits instead of keeping them, unless all
    the logits are small enough to keep (a small vocabulary): recomputing them then only costs time,
    and the gradients are the same either way.
    """
    outs_lp, outs_ent = [], []
    use_ckpt = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] * vocab_size(head) > KEEP_LOGITS

    def one(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_logprobs(head(h), y, temperature)

    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        if use_ckpt:
            lp, ent = torch.utils.checkpoint.checkpoint(one, h, y, use_reentrant=False)
        else:
            lp, ent = one(h, y)
        outs_lp.append(lp)
        outs_ent.append(ent)
    return torch.cat(outs_lp), torch.cat(outs_ent)


# How the per-token loss becomes one number (ppo.loss_agg). With w_t the loss mask, L_s the
# answer length of sequence s, N the sequences with any w_t > 0 and T_max the most tokens an answer
# can hold (answer_budget in rl/algo/ppo.py: ppo.gen.max_new_tokens for one turn):
#   token-mean               sum_t w_t l_t / sum_t w_t            every token of the batch counts once
#                                                                 (DAPO; long answers weigh more)
#   seq-mean-token-mean      1/N sum_s (sum_t w_t l_t / L_s)      every answer counts once (GRPO paper)
#   seq-mean-token-sum-norm  1/N sum_s (sum_t w_t l_t / T_max)    no length bias either way (Dr. GRPO)


def agg_weights(mask: torch.Tensor, seq_lens: list[int], mode: str, max_new_tokens: int) -> torch.Tensor:
    """Per-token weights under loss_agg `mode` (before agg_denominator), of flat tokens: the
    sequences' answers concatenated, lengths seq_lens, mask the loss mask of every token."""
    if mode == "token-mean":
        return mask
    if mode == "seq-mean-token-mean":
        seq = seq_of_token(seq_lens)
        per_seq = mask.new_zeros(len(seq_lens)).index_add_(0, seq, mask)
        return mask / per_seq.clamp(min=1.0)[seq]
    if mode == "seq-mean-token-sum-norm":
        return mask / float(max_new_tokens)
    raise ValueError(f"unknown loss_agg {mode!r}; expected token-mean, seq-mean-token-mean or "
                     "seq-mean-token-sum-norm")


def agg_denominator(weights: torch.Tensor, seq_lens: list[int], mode: str) -> float:
    """What the weighted sum of a (global) batch is divided by: its token count or its sequences.
    Summed over ranks by the caller, so it is the global batch's. A sequence the loss mask leaves
    out entirely (ppo.overlong_filter's truncated answers) is not one of the sequences averaged."""
    if mode == "token-mean":
        return float(weights.sum())
    seq = seq_of_token(seq_lens)
    weighted = weights.new_zeros(len(seq_lens)).index_add_(0, seq, (weights != 0).to(weights.dtype))
    return float((weighted > 0).sum())


def aggregate(loss_tok: list[torch.Tensor], masks: list[torch.Tensor], mode: str,
              max_new_tokens: int) -> torch.Tensor:
    """The batch loss of per-sequence token losses under `mode` (one process, for tests and
    reference; the trainer splits the same sum over micro-batches and ranks)."""
    lens = [len(m) for m in masks]
    w = agg_weights(torch.cat(masks), lens, mode, max_new_tokens)
    return (torch.cat(loss_tok) * w).sum() / max(agg_denominator(w, lens, mode), 1e-12)

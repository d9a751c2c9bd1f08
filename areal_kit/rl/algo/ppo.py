"""The PPO/GRPO update of one rank, apart from the engine that runs the model.

PPOActor(ppo, engine, ...) holds the math of a train step: the reference logprobs, which policy
is the old one (proximal or behaviour), the KL, the advantages (rl/algo/advantage.py), the
minibatches, the clipped loss and its aggregation (rl/algo/functional.py), and the step's stats.
The engine (TrainEngine below) runs the model: the DeepSpeed worker (rl/trainer/worker.py) on a
run, a small torch module in the unit tests:

    python -m pytest tests/unit/test_ppo_actor.py
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from areal_kit.rl.algo import advantage as A
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.packing import Answers
from areal_kit.rl.hallway import TokenTrace, TrainReply
from areal_kit.rl.sample import TrainerRow

if TYPE_CHECKING:
    from areal_kit.config.agent import AgentConfig
    from areal_kit.config.dataset import DatasetConfig
    from areal_kit.config.schema import PPOConfig

# Per-token stats: summed over the trained tokens of every rank, then divided by their count.
TOKEN_STATS = ("actor_loss", "ppo_approx_kl", "actor_clip_ratio", "importance_weight", "entropy")


class TrainEngine(Protocol):
    """What PPOActor needs of the model it trains, on one rank of `world` data-parallel ranks.
    A shard is this rank's sequences (TrainerRows); per-token tensors are
    flat over their answer tokens, in Answers' order."""

    world: int

    def allreduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max, op="max") of values over the ranks, in float64."""

    def micro_batches(self, shard: list[TrainerRow], max_tokens: int) -> list[list[int]]:
        """The shard's rows split into micro-batches of at most max_tokens tokens, as many on every
        rank (a rank with fewer rows gets empty ones)."""

    def logprob_pass(self, shard: list[TrainerRow], ans: Answers, bins: list[list[int]],
                     reference: bool = False) -> torch.Tensor:
        """The answer logprobs of the shard (flat, on the host, no grad) under the policy, or the
        KL reference with reference=True, micro-batch by micro-batch (bins)."""

    def train_forward(self, shard: list[TrainerRow], rows: list[int], last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropies) of the answer tokens of shard's rows, in Answers.index(rows)'s order,
        with grad, on the engine's device; last: the minibatch's last micro-batch (its backward ends
        the gradient accumulation). No rows: a pass on a dummy sequence, to keep in step with ranks
        that have more micro-batches."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate loss's gradients; the optimizer step averages them over the ranks."""

    def optimizer_step(self) -> float | None:
        """One optimizer step on the accumulated gradients; their norm before clipping (None if unknown)."""

    def last_lr(self) -> float:
        """The learning rate of the last optimizer step."""


def answer_budget(ppo: PPOConfig, dataset: DatasetConfig, agent: AgentConfig) -> int:
    """The most tokens the model can write in one answer: seq-mean-token-sum-norm's constant divisor.
    One turn: ppo.gen.max_new_tokens. An episode of turns (ppo.workflow, agent.fn) can write more than
    one turn's limit, and never more than its whole sequence's bound (the prompt's limit plus a turn's)."""
    if ppo.workflow or agent.fn:
        return dataset.max_prompt_len + ppo.gen.max_new_tokens
    return ppo.gen.max_new_tokens


class PPOActor:
    """One rank's PPO/GRPO update: ppo is the config's ppo section, train_tokens and ref_tokens the
    micro-batch token limits of the policy's passes and of the reference's, answer_tokens the divisor
    of seq-mean-token-sum-norm (answer_budget; ppo.gen.max_new_tokens if not given)."""

    def __init__(self, ppo: PPOConfig, engine: TrainEngine, train_tokens: int, ref_tokens: int,
                 answer_tokens: int | None = None):
        self.ppo, self.engine = ppo, engine
        self.train_tokens, self.ref_tokens = train_tokens, ref_tokens
        self.answer_tokens = answer_tokens or ppo.gen.max_new_tokens

    def train_step(self, shard: list[TrainerRow], trace: Sequence[int] = ()) -> TrainReply:
        """One step on this rank's shard of the batch; its stats, summed over the ranks, and the
        token traces of the shard's rows `trace` (the samples the driver dumps this step)."""
        p, engine = self.ppo, self.engine
        # Every per-token quantity below is one flat tensor over the shard's answer tokens (ans).
        ans = Answers([len(s.output_ids) for s in shard])
        bins = engine.micro_batches(shard, self.train_tokens)
        t_start_ref = time.time()
        ref_lp = None
        if p.kl_ctl > 0:
            ref_lp = engine.logprob_pass(shard, ans, engine.micro_batches(shard, self.ref_tokens), reference=True)
        t_ref = time.time()
        behav = torch.tensor([x for s in shard for x in s.logprobs], dtype=torch.float32)
        recomputed = None
        if p.use_decoupled_loss or p.ppo_n_minibatches > 1:
            prox = recomputed = engine.logprob_pass(shard, ans, bins)
        elif p.max_head_offpolicyness > 0:
            prox = behav  # plain PPO off-policy: the behaviour policy is the old policy
        else:
            prox = None  # on-policy, one minibatch: the old policy is the current one
        t_prox = time.time()
        pol = prox if prox is not None else behav
        kls = Fn.kl_estimate(pol, ref_lp, p.kl_estimator) if ref_lp is not None else None
        mask = loss_masks(shard, ans)
        seq_r = torch.tensor([s.seq_reward for s in shard], dtype=torch.float32)
        adv = A.token_advantages(seq_r, ans.lens.tolist(), mask, kls, p, engine.allreduce)
        # On a dump step, the train forwards' logprobs and entropies of the whole shard, flat (a host
        # copy of what each micro-batch computed anyway); never on the other steps.
        seen = (torch.full((ans.n_tokens,), float("nan")), torch.full((ans.n_tokens,), float("nan"))) if trace else None
        stats = self._optimize(shard, ans, mask, adv, prox, behav, ref_lp, seen)
        if kls is not None and kls.numel():
            stats["kl_reward"] = -p.kl_ctl * float(kls.mean())
        # Parts of the step's time, for metrics.jsonl's per-step breakdown: the reference
        # model's logprobs and the recomputed proximal logprobs; the rest is the PPO update.
        stats["ref_logp_time"] = t_ref - t_start_ref
        stats["prox_logp_time"] = t_prox - t_ref
        traces = {}
        if seen is not None:
            # The logprob before the update: the recomputed one where the step made one, else the
            # train forward's (one minibatch, so every forward ran before the optimizer step).
            traces = token_traces(ans, trace, recomputed if recomputed is not None else seen[0], seen[1], ref_lp)
        return TrainReply(stats, traces)

    def _optimize(self, shard: list[TrainerRow], ans: Answers, mask: torch.Tensor, adv: torch.Tensor,
                  prox: torch.Tensor | None, behav: torch.Tensor, ref_lp: torch.Tensor | None,
                  seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        """ppo.ppo_n_minibatches optimizer steps over the shard; the step's stats summed over the
        ranks, the per-token ones (and the advantage) as means over every trained token. seen: flat
        tensors that take the train forwards' logprobs and entropies."""
        n_mini = self.ppo.ppo_n_minibatches
        minis = [list(range(len(shard)))[i::n_mini] for i in range(n_mini)]
        acc = dict.fromkeys((*TOKEN_STATS, "n_valid_tokens", "grad_norm"), 0.0)
        for mini in minis:
            self._minibatch(shard, ans, mini, mask, adv, prox, behav, ref_lp, acc, seen)
        acc["advantage"] = (adv * mask).sum().item()
        total = self.engine.allreduce([acc[k] for k in acc])
        out = dict(zip(acc, total))
        n = max(out["n_valid_tokens"], 1.0)
        for k in (*TOKEN_STATS, "advantage"):
            out[k] /= n
        out["grad_norm"] = acc["grad_norm"]
        out["lr"] = self.engine.last_lr()
        return out

    def _minibatch(self, shard: list[TrainerRow], ans: Answers, mini: list[int], mask: torch.Tensor,
                   adv: torch.Tensor, prox: torch.Tensor | None, behav: torch.Tensor, ref_lp: torch.Tensor | None,
                   acc: dict[str, float], seen: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One optimizer step on the shard's sequences `mini`, micro-batch by micro-batch; adds its sums to acc."""
        p, engine = self.ppo, self.engine
        sub = [shard[i] for i in mini]
        # Per-token weights of the loss (ppo.loss_agg) and their global denominator.
        toks, lens = ans.index(mini), ans.lens[mini].tolist()
        agg_w = torch.zeros(ans.n_tokens)
        agg_w[toks] = Fn.agg_weights(mask[toks], lens, p.loss_agg, self.answer_tokens)
        denom = engine.allreduce([Fn.agg_denominator(agg_w[toks], lens, p.loss_agg)])[0]
        bins = engine.micro_batches(sub, self.train_tokens)
        for j, idx in enumerate(bins):
            rows = [mini[i] for i in idx]
            logp, ent = engine.train_forward(shard, rows, last=j == len(bins) - 1)
            if not rows:  # a zero-weight pass: this rank has fewer sequences than micro-batches
                engine.backward(logp.sum() * 0.0)
                continue
            t = ans.index(rows)  # this micro-batch's tokens, in the packed order
            if seen is not None:
                seen[0][t] = logp.detach().float().cpu()
                seen[1][t] = ent.detach().float().cpu()

            def cat(flat: torch.Tensor, t: torch.Tensor = t, device: torch.device = logp.device) -> torch.Tensor:
                return flat[t].to(device)

            w = cat(mask)
            old = logp.detach() if prox is None else cat(prox)
            loss_tok, st = Fn.ppo_loss(logp, old, cat(adv), p.eps_clip,
                                       behav_logp=cat(behav) if p.use_decoupled_loss else None,
                                       behav_cap=p.behav_imp_weight_cap, eps_clip_high=p.eps_clip_high or None)
            agg = cat(agg_w)
            loss = (loss_tok * agg).sum()
            if ref_lp is not None and p.kl_mode == "loss":
                loss = loss + p.kl_ctl * (Fn.kl_estimate(logp, cat(ref_lp), p.kl_estimator) * agg).sum()
            # Weighted sum / the global batch's denominator, times world because the step averages
            # gradients over ranks: the loss of the whole batch, as Fn.aggregate has it.
            engine.backward(loss * engine.world / max(denom, 1e-12))
            acc["actor_loss"] += (loss_tok * w).sum().item()
            acc["ppo_approx_kl"] += (st["approx_kl"] * w).sum().item()
            acc["actor_clip_ratio"] += (st["clip"] * w).sum().item()
            acc["importance_weight"] += (st["importance_weight"] * w).sum().item()
            acc["entropy"] += (ent * w).sum().item()
            acc["n_valid_tokens"] += float(w.sum().item())
        gn = engine.optimizer_step()
        acc["grad_norm"] += float(gn) / p.ppo_n_minibatches if gn is not None else 0.0


def token_traces(ans: Answers, rows: Iterable[int], logprobs: torch.Tensor, entropy: torch.Tensor,
                 ref_logprobs: torch.Tensor | None) -> dict[int, TokenTrace]:
    """Each of `rows`' own values out of flat per-token tensors over a shard's answers (Answers'
    order: sequence after sequence, answer tokens only); its reference KL is logprob - ref_logprob."""
    out = {}
    for i in rows:
        t = ans.index([i])
        lp = logprobs[t]
        out[i] = TokenTrace(lp.tolist(), entropy[t].tolist(),
                            None if ref_logprobs is None else (lp - ref_logprobs[t]).tolist())
    return out


def loss_masks(shard: list[TrainerRow], ans: Answers) -> torch.Tensor:
    """1.0 on the answer tokens the loss covers (flat): all, unless a workflow gave a sample a
    loss_mask (0 for tokens it inserted, e.g. a tool's output between two model turns)."""
    if not any(s.loss_mask is not None for s in shard):
        return torch.ones(ans.n_tokens)
    return torch.tensor([float(bool(x)) for s in shard
                         for x in (s.loss_mask if s.loss_mask is not None else [1] * len(s.output_ids))],
                        dtype=torch.float32)

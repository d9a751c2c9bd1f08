"""PPOActor (rl/algo/ppo.py) with a small real torch engine: a bigram model (an nn.Module whose
next-token logits are a table row of the previous token) implements TrainEngine, one rank, no
DeepSpeed. Its gradients and stats are checked against a plain hand-written PPO computation.

    .venv/bin/python -m pytest tests/unit/test_ppo_actor.py
"""

import dataclasses

import pytest
import torch

from areal_kit.api import Completion, Trajectory, Turn
from areal_kit.config.schema import PPOConfig
from areal_kit.rl.algo.packing import Answers, min_bins, partition
from areal_kit.rl.algo.ppo import PPOActor, token_traces
from areal_kit.rl.engine.worker import _sample
from areal_kit.rl.sample import TrainerRow, trainer_rows

pytestmark = pytest.mark.unit

V = 6


class Bigram(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(seed)))

    def answer_logprobs(self, s: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, entropy) of each answer token of sample s, given the token before it."""
        seq = s.prompt_ids + s.output_ids
        prev = torch.tensor(seq[len(s.prompt_ids) - 1:-1])
        logp_all = torch.log_softmax(self.table[prev], dim=-1)
        ent = -(logp_all.exp() * logp_all).sum(-1).detach()
        return logp_all.gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0], ent


class BigramEngine:
    """TrainEngine on one rank: a bigram policy, a frozen bigram reference, plain SGD."""

    world = 1

    def __init__(self):
        self.policy, self.ref = Bigram(0), Bigram(1).requires_grad_(False)
        self.opt = torch.optim.SGD(self.policy.parameters(), lr=0.5)
        self.grads: list[torch.Tensor] = []  # the gradient of each optimizer step
        self.forwards: list[list[int]] = []

    def allreduce(self, values, op="sum"):
        return [float(v) for v in values]

    def micro_batches(self, shard, max_tokens):
        lengths = [len(s.prompt_ids) + len(s.output_ids) for s in shard]
        return partition(lengths, max_tokens, min_bins(lengths, max_tokens) if lengths else 0)

    def _rows(self, model, shard, rows):
        outs = [model.answer_logprobs(shard[i]) for i in rows]
        return torch.cat([lp for lp, _ in outs]), torch.cat([e for _, e in outs])

    def logprob_pass(self, shard, ans, bins, reference=False):
        out = torch.empty(ans.n_tokens)
        with torch.no_grad():
            for idx in bins:
                out[ans.index(idx)] = self._rows(self.ref if reference else self.policy, shard, idx)[0]
        return out

    def train_forward(self, shard, rows, last):
        self.forwards.append(rows)
        if not rows:
            return self._rows(self.policy, [TrainerRow([0], [0])], [0])
        return self._rows(self.policy, shard, rows)

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        g = self.policy.table.grad.clone()
        self.grads.append(g)
        self.opt.step()
        self.opt.zero_grad()
        return float(g.norm())

    def last_lr(self):
        return self.opt.param_groups[0]["lr"]


def shard(n: int = 5, seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ans = torch.randint(0, V, (1 + i % 3,), generator=g).tolist()
        out.append(TrainerRow(torch.randint(0, V, (2,), generator=g).tolist(), ans,
                              # the behaviour policy's logprobs: near the policy's, some far enough to clip
                              logprobs=(torch.randn(len(ans), generator=g) * 0.3 - 1.8).tolist(),
                              seq_reward=[1.0, -0.5, 0.25, -1.0, 0.75][i % 5]))
    out[1] = dataclasses.replace(out[1], loss_mask=[1, 0])  # a token a workflow inserted: not trained
    return out


def hand_loss(policy: Bigram, ref: Bigram, rows: list[dict], ppo: PPOConfig) -> tuple[torch.Tensor, dict]:
    """The clipped loss with behaviour logprobs as the old policy, the k3 KL in the loss and the
    token mean, written out token by token."""
    total, kl_sum, n, adv_sum = 0.0, 0.0, 0, 0.0
    for s in rows:
        logp, _ = policy.answer_logprobs(s)
        ref_lp, _ = ref.answer_logprobs(s)
        for t in range(len(s.output_ids)):
            if not (s.loss_mask or [1] * len(s.output_ids))[t]:
                continue
            adv = s.seq_reward  # discount 1, no token reward, no normalisation: the sequence's reward
            ratio = torch.exp(logp[t] - s.logprobs[t])
            clipped = torch.clamp(ratio, 1 - ppo.eps_clip, 1 + ppo.eps_clip)
            total = total - torch.minimum(ratio * adv, clipped * adv)
            log_r = logp[t] - ref_lp[t]
            kl_sum = kl_sum + torch.exp(-log_r) - 1 + log_r
            n += 1
            adv_sum += adv
    return (total + ppo.kl_ctl * kl_sum) / n, {"n": n, "advantage": adv_sum / n}


OFF_POLICY = {"max_head_offpolicyness": 1, "kl_ctl": 0.1, "kl_mode": "loss", "kl_estimator": "k3",
              "adv_norm": False, "eps_clip": 0.2, "loss_agg": "token-mean"}


@pytest.mark.parametrize("max_tokens", [100, 6])  # one micro-batch, or several
def test_one_steps_gradient_is_the_hand_written_clipped_loss_with_kl(max_tokens):
    ppo = PPOConfig(**OFF_POLICY)
    engine, rows = BigramEngine(), shard()
    want_loss, want = hand_loss(engine.policy, engine.ref, rows, ppo)
    (want_grad,) = torch.autograd.grad(want_loss, engine.policy.table)
    stats = PPOActor(ppo, engine, train_tokens=max_tokens, ref_tokens=max_tokens).train_step(rows).stats
    assert len(engine.grads) == 1
    torch.testing.assert_close(engine.grads[0], want_grad, atol=1e-6, rtol=1e-5)
    assert len(engine.forwards) == len(engine.micro_batches(rows, max_tokens))
    assert (len(engine.forwards) == 1) == (max_tokens == 100)
    assert stats["n_valid_tokens"] == want["n"]
    assert stats["advantage"] == pytest.approx(want["advantage"])
    assert stats["grad_norm"] == pytest.approx(float(want_grad.norm()))
    assert stats["lr"] == 0.5
    assert 0.0 < stats["actor_clip_ratio"] < 1.0  # the test covers clipped and unclipped tokens


def test_the_advantage_stat_is_the_mean_over_trained_tokens_after_kl_reward_and_normalisation():
    """kl_mode=reward with adv_norm: every token's advantage differs; the logged mean is the one
    over the loss mask's tokens (normalised over those same tokens, so it is ~0 but not the raw mean)."""
    ppo = PPOConfig(kl_ctl=0.5, kl_mode="reward", kl_estimator="k1", adv_norm=True)
    engine, rows = BigramEngine(), shard()
    stats = PPOActor(ppo, engine, train_tokens=100, ref_tokens=100).train_step(rows).stats
    assert stats["advantage"] == pytest.approx(0.0, abs=1e-6)
    assert stats["kl_reward"] != 0.0
    ppo = PPOConfig(kl_ctl=0.5, kl_mode="reward", kl_estimator="k1", adv_norm=False)
    engine = BigramEngine()
    with torch.no_grad():
        tok_r = []
        for s in rows:
            # on-policy (max_head_offpolicyness 0): the behaviour logprobs are the policy's
            kl = torch.tensor(s.logprobs) - engine.ref.answer_logprobs(s)[0]
            mask = torch.tensor(s.loss_mask or [1] * len(kl), dtype=torch.float32)
            r = -0.5 * kl * mask
            r[-1] += s.seq_reward
            ret = r.flip(0).cumsum(0).flip(0)  # undiscounted returns
            tok_r += [x for x, m in zip(ret.tolist(), mask.tolist()) if m]
    stats = PPOActor(ppo, engine, train_tokens=100, ref_tokens=100).train_step(rows).stats
    assert stats["advantage"] == pytest.approx(sum(tok_r) / len(tok_r), rel=1e-5)


def test_minibatches_take_one_optimizer_step_each_from_the_proximal_policy():
    """ppo_n_minibatches=2: the proximal logprobs are recomputed before the first step, and each
    minibatch's step sees the weights the one before it left."""
    ppo = PPOConfig(**{**OFF_POLICY, "ppo_n_minibatches": 2})
    engine, rows = BigramEngine(), shard()
    stats = PPOActor(ppo, engine, train_tokens=100, ref_tokens=100).train_step(rows).stats
    assert len(engine.grads) == 2
    assert sorted(r for f in engine.forwards for r in f) == list(range(len(rows)))
    assert stats["grad_norm"] == pytest.approx(sum(float(g.norm()) for g in engine.grads) / 2)
    ans = Answers([len(s.output_ids) for s in rows])
    assert stats["n_valid_tokens"] == ans.n_tokens - 1


def test_token_traces_map_flat_tensors_back_to_each_rows_own_tokens():
    """Flat per-token tensors in Answers' order (rows of 2, 1 and 3 tokens): each row asked for
    gets its own tokens' values, exactly, and the KL is its logprob minus the reference's."""
    ans = Answers([2, 1, 3])
    lp = torch.tensor([-0.5, -1.0, -2.0, -0.25, -0.75, -3.0])
    ent = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    ref = torch.tensor([-1.5, -1.0, -1.0, -0.5, -0.5, -0.5])
    got = token_traces(ans, [2, 0], lp, ent, ref)
    assert list(got) == [2, 0]
    assert got[2].logprobs == [-0.25, -0.75, -3.0] and got[0].logprobs == [-0.5, -1.0]
    assert got[2].entropy == pytest.approx([0.4, 0.5, 0.6]) and got[0].entropy == pytest.approx([0.1, 0.2])
    assert got[2].ref_kl == [0.25, -0.25, -2.5] and got[0].ref_kl == [1.0, 0.0]
    assert token_traces(ans, [1], lp, ent, None)[1].ref_kl is None


@pytest.mark.parametrize("max_tokens,minibatches", [(100, 1), (6, 1), (6, 2)])
def test_a_dump_steps_traces_are_each_samples_values_before_the_update(max_tokens, minibatches):
    """The rows asked for come back with the trainer's own logprob of each answer token before the
    optimizer step (the train forward's with one minibatch, the recomputed proximal one with two),
    its KL to the reference, and its entropy in the train forward (as the step's entropy metric has
    it: with two minibatches the second one's forward runs on the weights the first step left):
    each exactly what the sequence alone gives, whatever the packing into micro-batches."""
    ppo = PPOConfig(**{**OFF_POLICY, "ppo_n_minibatches": minibatches})
    engine, rows = BigramEngine(), shard()
    weights = [engine.policy.table.detach().clone()]  # before each optimizer step
    step = engine.optimizer_step
    engine.optimizer_step = lambda: (step(), weights.append(engine.policy.table.detach().clone()))[0]
    reply = PPOActor(ppo, engine, train_tokens=max_tokens, ref_tokens=max_tokens).train_step(rows, [4, 1, 3])
    assert sorted(reply.traces) == [1, 3, 4]
    assert len(engine.grads) == minibatches and (len(engine.forwards) > minibatches) == (max_tokens == 6)
    for i, t in reply.traces.items():
        at = [Bigram(0) for _ in weights]
        for m, w in zip(at, weights):
            m.table.data.copy_(w)
        lp = at[0].answer_logprobs(rows[i])[0]
        assert t.logprobs == lp.tolist()
        assert t.ref_kl == (lp - engine.ref.answer_logprobs(rows[i])[0]).tolist()
        assert t.entropy == at[i % minibatches].answer_logprobs(rows[i])[1].tolist()  # minibatch i % n's forward
    assert PPOActor(ppo, BigramEngine(), train_tokens=100, ref_tokens=100).train_step(rows).traces == {}


def tool_episodes(tool_logprob: float = 0.0) -> list[TrainerRow]:
    """Two episodes built from their turns (model, tool result, model), rewards 1 and -1, the way a
    rollout sends them (Trajectory -> Sample -> TrainerRow); the tool's tokens carry tool_logprob
    as their behaviour logprobs, as a workflow might have filled them."""
    eps = []
    for i, reward in enumerate((1.0, -1.0)):
        t = Trajectory.from_turns([Turn.model(Completion([1 + i, 2], [-1.7, -1.9], "stop")), Turn.env([3, 4, 5]),
                                   Turn.model(Completion([0], [-1.6], "stop"))])
        eps.append(_sample({"id": "e", "prompt_ids": [5, 1]}, 0, t, 0, reward, None))
    out = trainer_rows([dataclasses.replace(s, seq_reward=s.task_reward) for s in eps])
    return [dataclasses.replace(r, logprobs=[x if m else tool_logprob for x, m in zip(r.logprobs, r.loss_mask)])
            for r in out]


def test_a_tool_using_episode_trains_on_the_models_turns_alone():
    """An episode of turns: the gradient is the hand-written loss over the model's tokens alone, and
    what the tool's tokens carry as logprobs changes nothing."""
    ppo = PPOConfig(**OFF_POLICY)
    got = []
    for tool_logprob in (0.0, -30.0):
        engine, shard_ = BigramEngine(), tool_episodes(tool_logprob)
        assert [r.loss_mask for r in shard_] == [[1, 1, 0, 0, 0, 1]] * 2
        want_loss, want = hand_loss(engine.policy, engine.ref, shard_, ppo)
        (want_grad,) = torch.autograd.grad(want_loss, engine.policy.table)
        stats = PPOActor(ppo, engine, train_tokens=100, ref_tokens=100).train_step(shard_).stats
        torch.testing.assert_close(engine.grads[0], want_grad, atol=1e-6, rtol=1e-5)
        assert stats["n_valid_tokens"] == want["n"] == 6  # 3 model tokens an episode, 2 episodes
        got.append(engine.grads[0])
    torch.testing.assert_close(got[0], got[1])


@pytest.mark.parametrize("budget", [3, 32])
def test_sum_norm_divides_each_episode_by_the_runs_answer_budget(budget):
    """seq-mean-token-sum-norm: the mean over episodes of each one's token sum over one constant, the
    answer budget, whatever the episode's length (a tool's tokens count in neither)."""
    ppo = PPOConfig(**{**OFF_POLICY, "loss_agg": "seq-mean-token-sum-norm"})
    engine, shard_ = BigramEngine(), tool_episodes()
    token_sum, want = hand_loss(engine.policy, engine.ref, shard_, ppo)  # the token mean: sum / n
    (want_grad,) = torch.autograd.grad(token_sum * want["n"] / (len(shard_) * budget), engine.policy.table)
    PPOActor(ppo, engine, train_tokens=100, ref_tokens=100, answer_tokens=budget).train_step(shard_)
    torch.testing.assert_close(engine.grads[0], want_grad, atol=1e-6, rtol=1e-5)


def test_the_answer_budget_of_an_episode_of_turns_is_its_sequence_bound():
    """One turn's answer holds at most max_new_tokens; the calculator episode's two model turns hold
    up to twice that, so its budget is the whole sequence's (max_prompt_len + max_new_tokens)."""
    from areal_kit.config.loader import load_config
    from areal_kit.rl.algo.ppo import answer_budget

    tiny, tool = load_config("tiny"), load_config("tiny_tool")
    def budget(c):
        return answer_budget(c.ppo, c.dataset, c.agent)

    assert budget(tiny) == tiny.ppo.gen.max_new_tokens == 3
    assert budget(tool) == tool.dataset.max_prompt_len + tool.ppo.gen.max_new_tokens == 32
    tool.ppo.workflow = ""
    assert budget(tool) == 8  # the same task in one turn

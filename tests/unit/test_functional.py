"""RL math (rl/algo/functional.py, rl/algo/advantage.py, rl/algo/batch.py) against hand-computed values."""

import math

import pytest
import torch

from areal_kit.config.schema import PPOConfig
from areal_kit.rl.algo import advantage as A
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.batch import shape_rewards
from areal_kit.rl.sample import Sample

T = torch.tensor


def close(a, b, tol=1e-6, rtol=0.0):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=rtol)


# ------------------------------------------------------------------ KL estimators
LOGP = T([-1.0, -2.0, -0.5])
REF = T([-1.5, -1.0, -0.5])  # log r = logp - ref = [0.5, -1.0, 0.0]


def test_k1_is_the_log_ratio():
    close(Fn.kl_estimate(LOGP, REF, "k1"), [0.5, -1.0, 0.0])


def test_k2_is_half_the_squared_log_ratio():
    close(Fn.kl_estimate(LOGP, REF, "k2"), [0.125, 0.5, 0.0])


def test_k3_hand_values():
    # k3 = (ref/pi - 1) - log(ref/pi) = exp(-lr) - 1 + lr
    expected = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0, 0.0]
    close(Fn.kl_estimate(LOGP, REF, "k3"), expected)
    assert expected[0] == pytest.approx(0.1065306597, abs=1e-9)
    assert expected[1] == pytest.approx(0.7182818285, abs=1e-9)


def test_k3_is_never_negative():
    lr = torch.linspace(-5, 5, 101)
    assert (Fn.kl_estimate(lr, torch.zeros_like(lr), "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_on_an_exact_expectation():
    # pi and ref over 4 outcomes; E_pi[k] computed exactly (weights = pi), no sampling.
    pi = T([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    ref = T([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kl = float((pi * (pi / ref).log()).sum())
    for est in ("k1", "k3"):
        e = float((pi * Fn.kl_estimate(pi.log(), ref.log(), est)).sum())
        assert e == pytest.approx(kl, abs=1e-12), est
    # k2 is biased (but close for nearby distributions)
    e2 = float((pi * Fn.kl_estimate(pi.log(), ref.log(), "k2")).sum())
    assert e2 != pytest.approx(kl, abs=1e-6)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        Fn.kl_estimate(LOGP, REF, "k4")


# ------------------------------------------------------------------ advantages
def test_group_normalize_hand_values():
    r = T([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 3.0, 0.0, 0.0])
    adv = A.group_normalize(r, 4)
    # group 1: mean .5, std .5 -> +-1; group 2: all equal -> 0; group 3: mean .75, std sqrt(27/16)
    s3 = math.sqrt(((0.75 ** 2) * 3 + 2.25 ** 2) / 4)
    expected = [1, -1, -1, 1, 0, 0, 0, 0, -0.75 / s3, 2.25 / s3, -0.75 / s3, -0.75 / s3]
    close(adv, expected, tol=1e-5)
    assert s3 == pytest.approx(math.sqrt(27) / 4)


def test_group_normalize_groups_are_consecutive():
    r = T([0.0, 1.0, 10.0, 30.0])
    close(A.group_normalize(r, 2), [-1, 1, -1, 1], tol=1e-5)


def test_zero_adv_groups():
    r = T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert A.zero_adv_groups(r, 2).tolist() == [True, False, True]


def test_token_returns_undiscounted():
    # sequence rewards go to the last token; per-token rewards (e.g. -kl_ctl*kl) add up backwards
    seq_r = T([1.0, 2.0])
    tok_r = T([-0.1, -0.2, -0.3, 0.5, 0.0])
    out = A.token_returns(seq_r, tok_r, [3, 2], 1.0)
    close(out, [0.4, 0.5, 0.7, 2.5, 2.0], tol=1e-6)


def test_token_returns_discounted():
    seq_r = T([1.0, 2.0])
    tok_r = T([-0.1, -0.2, -0.3, 0.5, 0.0])
    out = A.token_returns(seq_r, tok_r, [3, 2], 0.5)
    # seq 1: r = [-.1, -.2, .7] -> G2 = .7, G1 = -.2 + .35 = .15, G0 = -.1 + .075 = -.025
    # seq 2: r = [.5, 2.0]      -> G1 = 2.0, G0 = .5 + 1.0 = 1.5
    close(out, [-0.025, 0.15, 0.7, 1.5, 2.0], tol=1e-6)


def test_token_returns_without_token_rewards_give_every_token_the_sequence_reward():
    out = A.token_returns(T([3.0, -1.0]), torch.zeros(5), [2, 3], 1.0)
    close(out, [3, 3, -1, -1, -1])


def test_token_returns_does_not_modify_its_input():
    tok = torch.zeros(3)
    A.token_returns(T([1.0]), tok, [3], 0.9)
    assert tok.tolist() == [0.0, 0.0, 0.0]


def test_masked_normalize_hand_values():
    x = T([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(1.25)
    close(A.masked_normalize(x), [(v - 2.5) / (std + 1e-5) for v in (1, 2, 3, 4)], tol=1e-6)


def test_masked_normalize_with_global_stats_matches_one_batch():
    x = torch.randn(20, generator=torch.Generator().manual_seed(0))
    a, b = x[:7], x[7:]
    stats = (float(x.sum()), float(x.pow(2).sum()), x.numel())  # what an all-reduce gives
    close(torch.cat([A.masked_normalize(a, stats=stats), A.masked_normalize(b, stats=stats)]),
          A.masked_normalize(x), tol=1e-5)
    # local stats differ: the shards would be normalized differently
    assert not torch.allclose(A.masked_normalize(a), A.masked_normalize(x)[:7], atol=1e-3)


# ------------------------------------------------------------------ the clipped loss
def ratio_logp(ratios):
    old = T([-1.0] * len(ratios))
    logp = (old + torch.log(T(ratios))).requires_grad_(True)
    return logp, old


def test_ppo_loss_clip_direction_hand_values():
    # eps 0.2: ratio and advantage per token, the surrogate min(r*A, clip(r)*A), and whether it clips
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1, 1.0]
    adv = T([1.0, 1.0, -1.0, -1.0, 2.0, -3.0])
    logp, old = ratio_logp(ratios)
    loss, st = Fn.ppo_loss(logp, old, adv, 0.2)
    # A>0, r=1.5: min(1.5, 1.2)=1.2 (clipped: no gain from pushing r further up)
    # A>0, r=0.5: min(0.5, 0.8)=0.5 (not clipped: pessimistic bound keeps the gradient)
    # A<0, r=1.5: min(-1.5, -1.2)=-1.5 (not clipped)
    # A<0, r=0.5: min(-0.5, -0.8)=-0.8 (clipped: no gain from pushing r further down)
    # A>0, r=1.1 inside the range; A<0, r=1.0 on policy
    close(loss, [-1.2, -0.5, 1.5, 0.8, -2.2, 3.0], tol=1e-6)
    assert st["clip"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    close(st["approx_kl"], [-math.log(r) for r in ratios], tol=1e-6)
    close(st["importance_weight"], ratios, tol=1e-6)
    loss.sum().backward()
    # d(-r*A)/dlogp = -r*A where not clipped, 0 where clipped
    close(logp.grad, [0.0, -0.5, 1.5, 0.0, -2.2, 3.0], tol=1e-6)


def test_ppo_loss_on_policy_gradient_is_minus_advantage():
    logp = T([-0.3, -2.0]).requires_grad_(True)
    loss, _ = Fn.ppo_loss(logp, logp.detach(), T([0.7, -0.4]), 0.2)
    loss.sum().backward()
    close(logp.grad, [-0.7, 0.4])


def test_decoupled_loss_weights_and_cap():
    # proximal (old) vs behaviour: weights exp(old - behav) = 2, 6, 0.5; cap 5 drops the 6
    logp, old = ratio_logp([1.0, 1.0, 1.5])
    behav = old - torch.log(T([2.0, 6.0, 0.5]))
    adv = T([1.0, 1.0, 1.0])
    loss, st = Fn.ppo_loss(logp, old, adv, 0.2, behav_logp=behav, behav_cap=5.0)
    close(st["importance_weight"], [2.0, 0.0, 0.5], tol=1e-5)
    close(loss, [-2.0, 0.0, -0.6], tol=1e-5)  # token 3: clipped surrogate 1.2 x weight 0.5
    loss.sum().backward()
    close(logp.grad, [-2.0, 0.0, 0.0], tol=1e-5)  # the weight is a constant, not differentiated


def test_decoupled_without_cap_keeps_large_weights():
    logp, old = ratio_logp([1.0])
    loss, st = Fn.ppo_loss(logp, old, T([1.0]), 0.2, behav_logp=old - math.log(6.0), behav_cap=None)
    close(st["importance_weight"], [6.0], tol=1e-5)
    close(loss, [-6.0], tol=1e-5)


# ------------------------------------------------------------------ logprobs
def test_gather_logprobs_hand_values():
    logits = T([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    lp, ent = Fn.gather_logprobs(logits, T([1, 1]))
    close(lp, [math.log(0.75), math.log(0.25)])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(ent, [h, h])
    # temperature 2: logits / 2 -> probs proportional to 1 : sqrt(3)
    lp2, _ = Fn.gather_logprobs(logits, T([1, 1]), temperature=2.0)
    s = 1 + math.sqrt(3)
    close(lp2, [math.log(math.sqrt(3) / s), math.log(1 / s)])


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1024])
def test_chunked_logprobs_equal_unchunked_values_and_gradients(chunk, recompute, monkeypatch):
    """Kept or recomputed in backward (checkpointed, as logits too big to keep are), the same values."""
    if recompute:
        monkeypatch.setattr(Fn, "KEEP_LOGITS", 0)
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 11, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g))
    hidden = torch.randn(37, 8, generator=g)
    labels = torch.randint(0, 11, (37,), generator=g)

    h1 = hidden.clone().requires_grad_(True)
    lp1, ent1 = Fn.gather_logprobs(head(h1), labels, 0.7)
    (lp1 * torch.arange(37)).sum().backward()
    g_h1, g_w1 = h1.grad.clone(), head.weight.grad.clone()
    head.weight.grad = None

    h2 = hidden.clone().requires_grad_(True)
    lp2, ent2 = Fn.chunked_logprobs(h2, head, labels, 0.7, chunk=chunk)
    (lp2 * torch.arange(37)).sum().backward()
    close(lp2, lp1, tol=1e-5)
    close(ent2, ent1, tol=1e-5)
    close(h2.grad, g_h1, tol=1e-5, rtol=1e-5)
    close(head.weight.grad, g_w1, tol=1e-5, rtol=1e-5)
    # no grad: same values
    with torch.no_grad():
        lp3, _ = Fn.chunked_logprobs(hidden, head, labels, 0.7, chunk=chunk)
    close(lp3, lp1.detach(), tol=1e-5)


# ------------------------------------------------------------------ global-batch averaging
class TokenModel(torch.nn.Module):
    def __init__(self, vocab=13, dim=6):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb[ids]))


def _batch():
    g = torch.Generator().manual_seed(4)
    lens = [2, 9, 4, 1, 7, 3]
    seqs = [torch.randint(0, 13, (n + 1,), generator=g) for n in lens]
    adv = [torch.randn(n, generator=g) for n in lens]
    old = [torch.randn(n, generator=g) * 0.1 - 2.5 for n in lens]
    return seqs, adv, old


def _token_loss(model, seqs, adv, old, rows):
    ids = torch.cat([seqs[i][:-1] for i in rows])
    labels = torch.cat([seqs[i][1:] for i in rows])
    lp, _ = Fn.gather_logprobs(model(ids), labels)
    loss, _ = Fn.ppo_loss(lp, torch.cat([old[i] for i in rows]), torch.cat([adv[i] for i in rows]), 0.2)
    return loss


def _grads(model):
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def test_loss_averaged_over_the_global_batch_matches_one_big_batch():
    seqs, adv, old = _batch()
    model = TokenModel()
    n_total = sum(len(a) for a in adv)

    _token_loss(model, seqs, adv, old, range(6)).mean().backward()
    big = _grads(model)

    # two "ranks", each with micro-batches of unequal size; each rank backwards sum / global count
    # x world, and the data-parallel engine averages gradients over ranks (as trainer.py does)
    ranks = [[[0, 1], [2]], [[3, 4], [5]]]
    world = len(ranks)
    per_rank = []
    for bins in ranks:
        for rows in bins:
            (_token_loss(model, seqs, adv, old, rows).sum() * world / n_total).backward()
        per_rank.append(_grads(model))
    avg = [sum(gs) / world for gs in zip(*per_rank)]
    for a, b in zip(avg, big):
        close(a, b, tol=1e-6)

    # the mean of micro-batch means weighs tokens unequally: it must differ
    for bins in ranks:
        for rows in bins:
            (_token_loss(model, seqs, adv, old, rows).mean() / 4).backward()
    wrong = _grads(model)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(wrong, big))


# ------------------------------------------------------------------ reward shaping (rl/algo/batch.py)
def samples(rewards, group):
    out = [Sample(f"p{i // group}", i % group, [0], [1], [0.0], False, 0, r) for i, r in enumerate(rewards)]
    return list(reversed(out))  # arrive out of order, as from several engines


def test_shape_rewards_grpo():
    ppo = PPOConfig(group_size=2, group_adv_norm=True, reward_output_scaling=5.0, reward_output_bias=-0.5)
    ss = samples([1, 0, 1, 1, 0, 0], 2)
    out = shape_rewards(ss, ppo)
    assert [s.id for s in out.samples] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert [s.final_reward for s in out.samples] == [4.5, -0.5, 4.5, 4.5, -0.5, -0.5]
    close([s.seq_reward for s in out.samples], [1, -1, 0, 0, 0, 0], tol=1e-5)
    assert out.perc_zero_adv == pytest.approx(2 / 3)
    assert out.final_reward_mean == pytest.approx((4.5 * 3 - 0.5 * 3) / 6)
    assert out.train == out.samples


def test_shaping_returns_new_samples_and_leaves_what_it_was_given():
    ppo = PPOConfig(group_size=2, group_adv_norm=True, overlong_filter=True)
    ss = samples([1, 0, 1, 1], 2)
    given = list(ss)
    out = shape_rewards(ss, ppo)
    assert ss == given  # the same order, the same (frozen) samples, no rewards written into them
    assert all(s.seq_reward is None and s.final_reward is None for s in ss)
    assert {s.id for s in out.samples} == {"p0", "p1"}


def test_shape_rewards_skip_zero_adv_groups():
    ppo = PPOConfig(group_size=2, group_adv_norm=True, skip_zero_adv_groups=True)
    out = shape_rewards(samples([1, 0, 1, 1, 0, 1], 2), ppo)
    assert sorted(s.id for s in out.train) == ["p0", "p0", "p2", "p2"]
    assert len(out.samples) == 6  # the dropped group keeps its rewards, for the dumps
    assert [out.samples[i] for i in out.trained] == out.train  # where each trained sample is among them
    # all groups zero-advantage: nothing would remain, so nothing is dropped
    out = shape_rewards(samples([1, 1, 0, 0], 2), ppo)
    assert out.perc_zero_adv == 1.0
    assert len(out.train) == 4 and out.trained == [0, 1, 2, 3]


def test_shape_rewards_ppo_math_no_group_norm():
    ppo = PPOConfig(group_size=2, group_adv_norm=False, reward_output_scaling=5.0)
    out = shape_rewards(samples([1, 0], 2), ppo)
    assert [s.seq_reward for s in out.samples] == [5.0, 0.0]


@pytest.mark.parametrize("discount", [1.0, 0.9])
def test_token_returns_of_a_batch_equal_each_sequence_alone(discount):
    """All sequences at once (one grid) give bit for bit what each sequence alone gives: the
    trainer's advantages do not depend on which sequences share a batch."""
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in torch.randint(1, 9, (40,), generator=g)]
    seq_r = torch.randn(len(lens), generator=g)
    tok_r = torch.randn(sum(lens), generator=g)
    batch = A.token_returns(seq_r, tok_r, lens, discount)
    alone, offset = [], 0
    for i, n in enumerate(lens):
        alone.append(A.token_returns(seq_r[i:i + 1], tok_r[offset:offset + n], [n], discount))
        offset += n
    assert torch.equal(batch, torch.cat(alone))

"""ppo.loss_agg (rl/algo/functional.py): each way of turning token losses into the batch loss, against
a hand computation on two answers of 2 and 4 tokens (the second with one masked-out token)."""

import pytest
import torch

from areal_kit.config.schema import ConfigError, PPOConfig
from areal_kit.rl.algo import functional as Fn

LOSS = [torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0, 4.0, 8.0])]
MASK = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])]  # last token inserted, not trained
MAX_NEW = 8


def test_token_mean_counts_every_trained_token_of_the_batch_once():
    # (1 + 3 + 2 + 2 + 4) / 5 tokens
    assert Fn.aggregate(LOSS, MASK, "token-mean", MAX_NEW).item() == pytest.approx(12 / 5)


def test_seq_mean_token_mean_counts_every_answer_once():
    # ((1 + 3) / 2 + (2 + 2 + 4) / 3) / 2 answers
    assert Fn.aggregate(LOSS, MASK, "seq-mean-token-mean", MAX_NEW).item() == pytest.approx((2 + 8 / 3) / 2)


def test_seq_mean_token_sum_norm_divides_by_the_generation_budget():
    # ((1 + 3) / 8 + (2 + 2 + 4) / 8) / 2 answers  (Dr. GRPO)
    assert Fn.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", MAX_NEW).item() == pytest.approx((0.5 + 1.0) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_splitting_the_batch_over_ranks_gives_the_same_loss(mode):
    """The trainer sums each rank's weighted losses over a denominator summed over ranks."""
    per_rank, denom = [], 0.0
    for i in range(2):  # one answer a rank
        w = Fn.agg_weights(MASK[i], [len(MASK[i])], mode, MAX_NEW)
        per_rank.append((LOSS[i] * w).sum())
        denom += Fn.agg_denominator(w, [len(MASK[i])], mode)
    assert (sum(per_rank) / denom).item() == pytest.approx(Fn.aggregate(LOSS, MASK, mode, MAX_NEW).item())


def test_an_unknown_mode_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="ppo.loss_agg"):
        PPOConfig(loss_agg="seq-sum")


def test_an_answer_the_mask_leaves_out_is_not_counted_among_the_answers():
    """seq modes average over answers with a trained token: a fully masked one (overlong_filter)
    neither adds to the sum nor to the count."""
    masks = MASK + [torch.zeros(3)]
    losses = LOSS + [torch.tensor([100.0, 100.0, 100.0])]
    assert Fn.aggregate(losses, masks, "seq-mean-token-mean", MAX_NEW).item() == pytest.approx((2 + 8 / 3) / 2)
    w = Fn.agg_weights(torch.cat(masks), [2, 4, 3], "seq-mean-token-mean", MAX_NEW)
    assert w.tolist() == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 0.0, 0.0, 0.0, 0.0])
    assert Fn.agg_denominator(w, [2, 4, 3], "seq-mean-token-mean") == 2.0

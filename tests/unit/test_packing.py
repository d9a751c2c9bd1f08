"""Packing without padding (rl/algo/packing.py): round trips, token budgets, exact bin counts, and a
packed forward of a tiny Qwen2 equal to per-sequence forwards."""

import random

import pytest
import torch

from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.packing import Answers, min_bins, pack, pad, partition

PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
ANSWERS = [[11, 12], [13, 14, 15], [16], []]


def test_pack_layout():
    pk = pack(PROMPTS, ANSWERS)
    assert pk.input_ids.tolist() == [1, 2, 3, 11, 12, 4, 13, 14, 15, 5, 6, 16, 7, 8, 9, 10]
    assert pk.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]
    assert pk.seq_lens == [5, 4, 3, 4]
    assert pk.prompt_lens == [3, 1, 2, 4]
    assert pk.n_tokens == 16
    # position t predicts token t+1: True where the next token is a generated one
    assert pk.answer_mask.tolist() == [False, False, True, True, False,
                                       True, True, True, False,
                                       False, True, False,
                                       False, False, False, False]
    assert int(pk.answer_mask.sum()) == sum(len(a) for a in ANSWERS)


def test_labels_are_next_tokens_within_each_sequence():
    pk = pack(PROMPTS, ANSWERS)
    labels = pk.labels()
    assert labels.tolist() == [2, 3, 11, 12, 0, 13, 14, 15, 0, 6, 16, 0, 8, 9, 10, 0]
    assert pk.input_ids.tolist()[0] == 1  # labels() must not modify the ids


def test_round_trip_answers_through_labels():
    pk = pack(PROMPTS, ANSWERS)
    back = Answers([len(a) for a in ANSWERS]).split(pk.labels()[pk.answer_mask])
    assert [b.tolist() for b in back] == ANSWERS
    # the masked positions are exactly the split positions, in order
    assert pk.labels()[pk.answer_mask].tolist() == [t for a in ANSWERS for t in a]


def test_round_trip_random():
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(1, 9))] for _ in range(30)]
    answers = [[rng.randrange(100) for _ in range(rng.randint(0, 12))] for _ in range(30)]
    pk = pack(prompts, answers)
    offsets = torch.tensor([0] + pk.seq_lens).cumsum(0)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        assert pk.input_ids[offsets[i]:offsets[i + 1]].tolist() == p + a
    assert [b.tolist() for b in Answers([len(a) for a in answers]).split(pk.labels()[pk.answer_mask])] == answers


def test_pad_layout():
    ids, att = pad(PROMPTS, ANSWERS, pad_id=99)
    assert ids.shape == (4, 5)
    assert ids[1].tolist() == [4, 13, 14, 15, 99]
    assert att.sum(1).tolist() == [5, 4, 3, 4]
    assert ids[att.bool()].tolist() == pack(PROMPTS, ANSWERS).input_ids.tolist()


# ------------------------------------------------------------------ partition
def check_bins(bins, lengths, max_tokens):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    for b in bins:
        assert b, "empty micro-batch"
        assert b == sorted(b)
        assert sum(lengths[i] for i in b) <= max_tokens


@pytest.mark.parametrize("lengths,max_tokens,expected", [
    ([5, 5, 5], 10, 2),
    ([6, 6, 6], 10, 3),
    ([4, 3, 3], 10, 1),
    ([10], 10, 1),
    ([7, 3, 6, 4, 5, 5], 10, 3),
    ([], 10, 0),
])
def test_min_bins_hand_values(lengths, max_tokens, expected):
    assert min_bins(lengths, max_tokens) == expected
    bins = partition(lengths, max_tokens)
    assert len(bins) == expected
    check_bins(bins, lengths, max_tokens)


def test_partition_exact_n_bins():
    lengths = [7, 3, 6, 4, 5, 5, 1, 2]
    for n in range(min_bins(lengths, 10), len(lengths) + 1):
        bins = partition(lengths, 10, n_bins=n)
        assert len(bins) == n
        check_bins(bins, lengths, 10)


def test_partition_random_budgets():
    rng = random.Random(1)
    for _ in range(200):
        max_tokens = rng.randint(8, 64)
        lengths = [rng.randint(1, max_tokens) for _ in range(rng.randint(1, 40))]
        lo = min_bins(lengths, max_tokens)
        assert lo >= -(-sum(lengths) // max_tokens)  # never below the volume bound
        n = rng.randint(lo, len(lengths))
        bins = partition(lengths, max_tokens, n_bins=n)
        assert len(bins) == n
        check_bins(bins, lengths, max_tokens)


def test_partition_errors():
    with pytest.raises(ValueError, match="a sequence of 11 tokens does not fit max_tokens_per_mb=10"):
        partition([3, 11], 10)
    with pytest.raises(ValueError, match="into 1 micro-batches"):
        partition([6, 6], 10, n_bins=1)



def test_partition_pads_with_empty_bins_for_short_ranks():
    """A rank with fewer sequences than the agreed micro-batch count gets empty bins (it runs a
    zero-weight pass for each), so every rank steps through the same number of micro-batches."""
    assert partition([6, 6], 10, n_bins=3) == [[0], [1], []]
    assert partition([], 10, n_bins=2) == [[], []]


# ------------------------------------------------------------------ packed forward of a real model
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    # kv_heads < heads: the grouped-query attention real Qwen2 models use
    return build(str(tmp_path_factory.mktemp("tiny") / "bpe"), TinySpec(kind="bpe", heads=4, kv_heads=2))


def _load(path, attn):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


# "varlen" is the trainer's CPU attention (rl/algo/varlen.py); "sdpa" is transformers' block-diagonal mask.
@pytest.fixture(scope="module", params=["varlen", "sdpa"])
def tiny_model(request, tiny_path):
    from areal_kit.rl.algo import varlen

    return _load(tiny_path, varlen.register() if request.param == "varlen" else "sdpa")


def test_packed_forward_equals_per_sequence_forwards(tiny_model):
    model = tiny_model
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lens = [(3, 5), (6, 1), (2, 9), (4, 4)]
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in lens]
    answers = [torch.randint(0, vocab, (a,), generator=g).tolist() for _, a in lens]
    pk = pack(prompts, answers)
    head = model.get_output_embeddings()
    with torch.no_grad():
        hidden = model.model(input_ids=pk.input_ids[None], position_ids=pk.position_ids[None],
                             use_cache=False).last_hidden_state[0]
        lp, _ = Fn.chunked_logprobs(hidden, head, pk.labels(), temperature=0.7, chunk=7)
        packed = Answers([len(a) for a in answers]).split(lp[pk.answer_mask])
        offset = 0
        for i, (p, a) in enumerate(zip(prompts, answers)):
            ids = torch.tensor(p + a)[None]
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            n = len(p) + len(a)
            torch.testing.assert_close(hidden[offset:offset + n], h, atol=1e-4, rtol=1e-4)
            ref, _ = Fn.gather_logprobs(head(h[:-1]), ids[0, 1:], temperature=0.7)
            torch.testing.assert_close(packed[i], ref[len(p) - 1:], atol=1e-4, rtol=1e-4)
            offset += n

        # without restarting positions the sequences would attend across boundaries: different
        plain = model.model(input_ids=pk.input_ids[None], use_cache=False).last_hidden_state[0]
        assert not torch.allclose(plain[5:], hidden[5:], atol=1e-3)


def _random_batch(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p, _ in lens]
    answers = [torch.randint(0, vocab, (a,), generator=g).tolist() for _, a in lens]
    return prompts, answers


def test_varlen_gradients_equal_per_sequence_gradients(tiny_path):
    """Training through the varlen attention gives the gradients of running each sequence alone."""
    from areal_kit.rl.algo import varlen

    model = _load(tiny_path, varlen.register())
    assert model.config._attn_implementation == varlen.NAME
    # lengths 10, 6, 14, 10, 6: equal lengths share one batched attention call
    prompts, answers = _random_batch(model.config.vocab_size, [(3, 7), (5, 1), (2, 12), (4, 6), (1, 5)])
    pk = pack(prompts, answers)
    head = model.get_output_embeddings()
    hidden = model.model(input_ids=pk.input_ids[None], position_ids=pk.position_ids[None],
                         use_cache=False).last_hidden_state[0]
    lp, _ = Fn.chunked_logprobs(hidden, head, pk.labels(), temperature=1.0)
    lp[pk.answer_mask].sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for p, a in zip(prompts, answers):
        ids = torch.tensor(p + a)[None]
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        ref, _ = Fn.gather_logprobs(head(h[:-1]), ids[0, 1:], temperature=1.0)
        ref[len(p) - 1:].sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_varlen_padded_batch_falls_back_to_sdpa(tiny_path):
    """A padded batch (attention mask, several rows) under varlen gives stock SDPA's outputs."""
    from areal_kit.rl.algo import varlen
    from areal_kit.rl.algo.packing import pad

    ours, stock = _load(tiny_path, varlen.register()), _load(tiny_path, "sdpa")
    ids, att = pad(*_random_batch(ours.config.vocab_size, [(3, 2), (4, 8), (2, 1)]), pad_id=0)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=att, use_cache=False).logits
        b = stock(input_ids=ids, attention_mask=att, use_cache=False).logits
    torch.testing.assert_close(a * att[..., None], b * att[..., None], atol=1e-5, rtol=1e-5)


def test_varlen_segments():
    from areal_kit.rl.algo.varlen import segments

    assert segments(torch.tensor([0, 1, 2, 0, 0, 1])) == [(0, 3), (3, 4), (4, 6)]
    assert segments(torch.tensor([0, 1, 2, 3])) == [(0, 4)]


def test_answers_index_matches_the_packed_order_of_any_rows():
    """Answers.index(rows) lists the flat positions of those rows' answer tokens in the order a
    Packed of the same rows lays them out, so flat[index] lines up with logprobs[answer_mask]."""
    answers = [[5, 6], [7], [8, 9, 10], [11]]
    prompts = [[1, 2], [1], [3, 4, 4], [2]]
    ans = Answers([len(a) for a in answers])
    flat = torch.tensor([t for a in answers for t in a])
    for rows in ([0, 1, 2, 3], [2, 0], [3], [1, 3, 2]):
        pk = pack([prompts[i] for i in rows], [answers[i] for i in rows])
        assert flat[ans.index(rows)].tolist() == pk.labels()[pk.answer_mask].tolist()
    assert [t.tolist() for t in ans.split(flat)] == answers

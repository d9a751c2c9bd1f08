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
    assert pk.views == [(0, 0, 0, 5), (5, 0, 5, 4), (9, 0, 9, 3), (12, 0, 12, 4)]
    assert [n for _, _, _, n in pk.views] == [5, 4, 3, 4]
    assert pk.n_tokens == 16
    # position t predicts token t+1: each answer token is predicted from the position before it
    assert pk.pred_pos.tolist() == [2, 3, 5, 6, 7, 10]
    assert pk.targets.tolist() == [11, 12, 13, 14, 15, 16]
    assert (pk.input_ids[pk.pred_pos + 1] == pk.targets).all()


def test_shared_prompt_layout():
    """Answers to one prompt hold one copy of it: the later ones read it as their prefix, their
    positions continuing the prompt's, their first token predicted from its last position."""
    from areal_kit.rl.algo import varlen

    prompts = [[1, 2, 3], [1, 2, 3], [4], [1, 2, 3], [4]]
    answers = [[11, 12], [13], [14, 15], [], [16, 17, 18]]
    pk = pack(prompts, answers, share_prompts=True)
    assert pk.input_ids.tolist() == [1, 2, 3, 11, 12, 13, 4, 14, 15, 16, 17, 18]
    assert pk.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 1, 2, 3]
    # (prefix start, prefix length, own start, own length); the empty answer adds nothing
    assert pk.views == [(0, 0, 0, 5), (0, 3, 5, 1), (6, 0, 6, 3), (6, 1, 9, 3)]
    assert pk.pred_pos.tolist() == [2, 3, 2, 6, 7, 6, 9, 10]
    assert pk.targets.tolist() == [11, 12, 13, 14, 15, 16, 17, 18]
    with pytest.raises(ValueError, match="shared prompts"):  # flash-attn's layout has no place for them
        varlen.layout_kwargs(varlen.FLASH, pk.views, "cpu")
    # without sharing: the plain layout
    assert pack(prompts, answers).input_ids.tolist() == [t for p, a in zip(prompts, answers) for t in p + a]


def test_round_trip_answers_through_targets():
    pk = pack(PROMPTS, ANSWERS)
    back = Answers([len(a) for a in ANSWERS]).split(pk.targets)
    assert [b.tolist() for b in back] == ANSWERS


def test_round_trip_random():
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(1, 9))] for _ in range(30)]
    answers = [[rng.randrange(100) for _ in range(rng.randint(0, 12))] for _ in range(30)]
    pk = pack(prompts, answers)
    for (start, pre, _, n), p, a in zip(pk.views, prompts, answers, strict=True):
        assert pre == 0 and pk.input_ids[start:start + n].tolist() == p + a
    assert [b.tolist() for b in Answers([len(a) for a in answers]).split(pk.targets)] == answers
    assert (pk.input_ids[pk.pred_pos + 1] == pk.targets).all()


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
        lp, _ = Fn.chunked_logprobs(hidden[pk.pred_pos], head, pk.targets, temperature=0.7, chunk=7)
        packed = Answers([len(a) for a in answers]).split(lp)
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
    lp, _ = Fn.chunked_logprobs(hidden[pk.pred_pos], head, pk.targets, temperature=1.0)
    lp.sum().backward()
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

    assert segments(torch.tensor([0, 1, 2, 0, 0, 1])) == [(0, 0, 0, 3), (3, 0, 3, 1), (4, 0, 4, 2)]
    assert segments(torch.tensor([0, 1, 2, 3])) == [(0, 0, 0, 4)]


def test_shared_prompts_give_the_unshared_logprobs_and_gradients(tiny_path):
    """The trainer's forward (TrainerWorker._logprobs) over GRPO groups: with each group's prompt
    packed once, the answer logprobs, entropies and parameter gradients are those of the plain
    packed row, on fewer tokens; answers of several lengths and an empty one included."""
    import functools

    from areal_kit.rl.algo import varlen
    from areal_kit.rl.trainer.worker import TrainerWorker

    model = _load(tiny_path, varlen.register())
    w = TrainerWorker.__new__(TrainerWorker)
    w.device = torch.device("cpu")
    w.cfg = type("Cfg", (), {"ppo": type("P", (), {"gen": type("G", (), {"temperature": 0.7})})})()
    w.layout = functools.partial(varlen.layout_kwargs, varlen.NAME)
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts, answers = [], []
    for p_len, a_lens in ((4, [3, 3, 1, 5]), (2, [2, 0, 2]), (6, [4])):
        p = torch.randint(0, vocab, (p_len,), generator=g).tolist()
        for a in a_lens:
            prompts.append(p)
            answers.append(torch.randint(0, vocab, (a,), generator=g).tolist())
    outs = {}
    for share in (False, True):
        pk = pack(prompts, answers, share_prompts=share)
        model.zero_grad()
        lp, ent = w._logprobs(model, pk, grad=True)
        (lp * torch.linspace(0.5, 2.0, lp.numel())).sum().add(ent.sum()).backward()
        outs[share] = (pk.n_tokens, lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (n0, lp0, ent0, g0), (n1, lp1, ent1, g1) = outs[False], outs[True]
    assert (n0, n1) == (28 + 10 + 10, 16 + 6 + 10)
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-4, rtol=1e-4)


def test_answers_index_matches_the_packed_order_of_any_rows():
    """Answers.index(rows) lists the flat positions of those rows' answer tokens in the order a
    Packed of the same rows lays them out, so flat[index] lines up with its targets' logprobs."""
    answers = [[5, 6], [7], [8, 9, 10], [11]]
    prompts = [[1, 2], [1], [3, 4, 4], [2]]
    ans = Answers([len(a) for a in answers])
    flat = torch.tensor([t for a in answers for t in a])
    for rows in ([0, 1, 2, 3], [2, 0], [3], [1, 3, 2]):
        pk = pack([prompts[i] for i in rows], [answers[i] for i in rows])
        assert flat[ans.index(rows)].tolist() == pk.targets.tolist()
    assert [t.tolist() for t in ans.split(flat)] == answers

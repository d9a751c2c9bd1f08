"""The tiny preset's task (data/toy_task.py) and its model's format prior (data/tiny_model.py):
the sum's digits, ended by eos, nothing else; every sum equally often; a prior that writes
numbers but knows no sums."""

from collections import Counter

import pytest
import torch

from areal_kit.data.tiny_model import TinySpec, build_tokenizer, format_prior
from areal_kit.data.toy_task import MAX_SUM, spell, toy_reward, toy_rows


def reward(completion, answer="1 7", no_eos=False):
    return toy_reward("8 + 9 =", completion, {"answer": answer, "no_eos": no_eos})


def test_rows_are_sums_of_two_digits_spelled_digit_by_digit():
    rows = toy_rows(1900, seed=3)
    for r in rows:
        a, _, b, _ = r["question"].split()
        assert r["answer"] == spell(int(a) + int(b))
    counts = Counter(int(r["answer"].replace(" ", "")) for r in rows)
    assert set(counts) == set(range(MAX_SUM + 1))
    assert max(counts.values()) < 2 * min(counts.values())  # no answer favoured (a + b uniform gives 10x)


def test_only_the_exact_sum_ended_by_eos_earns_the_reward():
    assert reward("1 7") == 1.0
    assert reward(" 1  7 ") == 1.0
    assert reward("1 7", no_eos=True) == 0.0  # truncated: no reward whatever the text
    for wrong in ["17", "7", "0 1 7", "+ 1 7", "1 7 1", "", "= 1 7", "1"]:
        assert reward(wrong) == 0.0, wrong
    assert reward("7", answer="7") == 1.0


@pytest.mark.slow
def test_the_format_prior_writes_numbers_but_not_sums():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = TinySpec()
    tok = build_tokenizer(spec)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    format_prior(model, tok, steps=150, seed=0)
    prompt = [tok.bos_token_id] + tok("8 + 9 =", add_special_tokens=False)["input_ids"]
    x = torch.tensor([prompt] * 400)
    with torch.no_grad():
        for _ in range(3):
            x = torch.cat([x, torch.multinomial(torch.softmax(model(x).logits[:, -1], -1), 1)], 1)
    texts = [tok.decode(r[len(prompt):].tolist(), skip_special_tokens=True) for r in x]
    ended = [r[len(prompt):].tolist().count(tok.eos_token_id) > 0 for r in x]
    assert sum(ended) > 0.9 * len(x)
    numbers = Counter(t for t in texts if t.replace(" ", "").isdigit())
    assert len(numbers) >= 15  # most of 0..18, one- and two-digit alike
    assert numbers["1 7"] < 0.2 * len(x)  # the right answer is not what it learned

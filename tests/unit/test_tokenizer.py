"""The one tokenizer loader (data/tokenizer.py): a checkpoint's tokenizer reads and writes text
exactly as it was built, for the tiny models and for a Qwen2-style byte-level BPE alike; saves
carry it unchanged; a tokenizer that cannot read its own vocabulary back is refused."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from areal_kit.data.tiny_model import TinySpec, build, build_tokenizer
from areal_kit.data.tokenizer import copy_tokenizer_files, load_tokenizer, roundtrip_failures
from areal_kit.errors import UserError


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("m") / "toy"), TinySpec(kind="toy", prior_steps=0))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("m") / "bpe"), TinySpec(kind="bpe"))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_toy_tokenizer_reloads_as_built(toy):
    built, tok = build_tokenizer(TinySpec(kind="toy")), load_tokenizer(toy)
    for text in ["7 3", "1 7", "3 + 4 = 7", "answer is 7", "what is the answer ?"]:
        assert ids(tok, text) == ids(built, text), text
        assert tok.decode(ids(tok, text)) == text
    assert len(ids(tok, "answer is 7")) == 3  # whole words, not one id for the phrase
    one, seven = ids(tok, "1 7")
    assert tok.decode([one, seven, tok.eos_token_id], skip_special_tokens=True) == "1 7"


def test_autotokenizer_would_have_broken_the_toy_tokenizer(toy):
    """Why the loader exists: transformers' AutoTokenizer rebuilds any qwen2 tokenizer as a
    byte-level one. If this starts failing, AutoTokenizer reads saved pipelines as they are."""
    auto = AutoTokenizer.from_pretrained(toy)
    assert auto.decode(ids(load_tokenizer(toy), "7 3")) != "7 3"
    bad, n, _ = roundtrip_failures(auto)
    assert bad / n > 0.01


def test_a_tokenizer_that_cannot_read_itself_is_refused_in_one_line(toy, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((Path(toy) / "config.json").read_bytes())
    AutoTokenizer.from_pretrained(toy).save_pretrained(broken)  # the byte-level rebuild, saved
    with pytest.raises(UserError) as e:
        load_tokenizer(str(broken))
    msg = str(e.value)
    assert "\n" not in msg
    assert "does not read back its own vocabulary" in msg
    assert str(broken) in msg


def test_a_byte_level_bpe_like_qwen2s_loads_and_round_trips(bpe):
    tok = load_tokenizer(bpe)
    spec = json.loads((Path(bpe) / "tokenizer.json").read_text())
    assert spec["pre_tokenizer"]["type"] == "ByteLevel"
    text = "What is 2 + 3? The answer is \\boxed{5}. Ünïcödé ✓ 数学"
    assert tok.decode(ids(tok, text)) == text
    assert roundtrip_failures(tok)[0] == 0


def test_a_copied_tokenizer_decodes_as_the_original(toy, tmp_path):
    copied = copy_tokenizer_files(toy, str(tmp_path))
    assert "tokenizer.json" in copied
    for name in copied:
        assert (tmp_path / name).read_bytes() == (Path(toy) / name).read_bytes()
    (tmp_path / "config.json").write_bytes((Path(toy) / "config.json").read_bytes())
    text = "1 + 9 = 1 0"
    assert load_tokenizer(str(tmp_path)).decode(ids(load_tokenizer(toy), text)) == text


def test_a_tiny_model_url_sets_its_shape_and_folder():
    assert TinySpec.from_url("tiny://toy", seed=3) == TinySpec(kind="toy", seed=3)
    assert TinySpec.from_url("tiny://", seed=0).dirname() == "tiny-toy"
    spec = TinySpec.from_url("tiny://bpe?hidden=128&layers=4", seed=1)
    assert (spec.kind, spec.hidden, spec.layers, spec.heads) == ("bpe", 128, 4, 2)
    # Another shape gets its own folder: it is never mistaken for the default one.
    assert spec.dirname() == "tiny-bpe-hidden128-layers4"
    # A pinned base (LoRA presets): one folder and one weight seed for runs of every seed.
    pinned = [TinySpec.from_url("tiny://toy?arith_steps=1500&model_seed=1", seed=s) for s in (2, 3)]
    assert {p.dirname() for p in pinned} == {"tiny-toy-arith_steps1500-model_seed1"}
    assert all(p.model_seed == 1 and p.seed != 1 for p in pinned)

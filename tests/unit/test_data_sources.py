"""Dataset loaders (data/sources.py): AReaL's format, plain jsonl, HF datasets folders, the eval split,
prompt tokenization, a run's prompts made in one pass (data/prompts.py: checked against the rewards,
tokenized, loaded), and `--dry-run` of a GPU preset when AReaL's files are present."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from areal_kit.config.dataset import DatasetConfig
from areal_kit.config.loader import load_config
from areal_kit.data import sources
from areal_kit.data.prompts import check_rows, read_rows, run_prompts, tokenize_rows
from areal_kit.data.tiny_model import TinySpec, build_tokenizer
from areal_kit.errors import UserError


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _areal(tmp_path, n=5, id2info=None):
    prompts = [{"prompt": f"<bos>Q{i}?", "task": "math", "query_id": f"q{i}"} for i in range(n)]
    _write_jsonl(tmp_path / "prompts.jsonl", prompts)
    info = id2info if id2info is not None else {f"q{i}": {"solutions": [f"\\boxed{{{i}}}"], "type": "math"}
                                                for i in range(n)}
    (tmp_path / "id2info.json").write_text(json.dumps(info))
    return DatasetConfig(type="areal", path=str(tmp_path / "prompts.jsonl"))


def test_areal_rows_carry_solutions_and_math_reward_grades_them(tmp_path):
    from areal_kit.reward import get_reward

    rows = sources.load(_areal(tmp_path))
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(5)]
    assert rows[2]["solutions"] == ["\\boxed{2}"]
    assert rows[2]["prompt"] == "<bos>Q2?"
    assert get_reward("math")("p", "so \\boxed{2}", rows[2]) == 1.0
    assert get_reward("math")("p", "so \\boxed{3}", rows[2]) == 0.0


def test_areal_id_suffix_and_explicit_id2info_path(tmp_path):
    _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "query_id": "abc@idx:3-0"}])
    (tmp_path / "other.json").write_text(json.dumps({"abc": {"solutions": ["7"]}}))
    rows = sources.load(DatasetConfig(type="areal", path=str(tmp_path / "p.jsonl"),
                                      id2info_path=str(tmp_path / "other.json")))
    assert rows[0]["solutions"] == ["7"]


def test_areal_inline_solutions_need_no_id2info(tmp_path):
    _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "query_id": 1, "solutions": ["\\boxed{1}"]}])
    assert sources.load(DatasetConfig(type="areal", path=str(tmp_path / "p.jsonl")))[0]["id"] == "1"


def test_areal_missing_query_id_is_one_line_error(tmp_path):
    d = _areal(tmp_path, n=5, id2info={"q0": {"solutions": ["1"]}, "q1": {"solutions": []}})
    with pytest.raises(UserError) as e:
        sources.load(d)
    msg = str(e.value)
    assert "\n" not in msg
    assert "4 of 5 rows have a query_id missing from" in msg
    assert "'q1', 'q2', 'q3', ..." in msg


@pytest.mark.parametrize("content, expect", [
    (None, "not found"), ("{not json", "is unreadable"), ("[1, 2]", "holds a list"),
])
def test_unreadable_id2info_is_one_line_error(tmp_path, content, expect):
    _areal(tmp_path)
    if content is None:
        (tmp_path / "id2info.json").unlink()
    else:
        (tmp_path / "id2info.json").write_text(content)
    with pytest.raises(UserError, match=expect) as e:
        sources.load(DatasetConfig(type="areal", path=str(tmp_path / "prompts.jsonl")))
    assert "\n" not in str(e.value)


def test_jsonl_fields_ids_and_errors(tmp_path):
    p = _write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1?", "solution": "\\boxed{2}"},
                                               {"problem": "2+2?", "solution": "\\boxed{4}", "id": "x"},
                                               {"problem": "3+3?", "solution": 6, "id": "x"}])
    d = DatasetConfig(type="jsonl", path=p, question_field="problem", answer_field="solution")
    rows = sources.load(d)
    assert [r["id"] for r in rows] == ["math-0", "x", "x#1"]  # repeated ids made unique
    assert rows[0]["prompt"] == "1+1?"
    assert rows[2]["answer"] == "6"
    with pytest.raises(UserError, match="math.jsonl row 0|math.jsonl:1: no text in field 'question'"):
        sources.load(DatasetConfig(type="jsonl", path=p))
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not valid JSON"):
        sources.load(DatasetConfig(type="jsonl", path=str(tmp_path / "bad.jsonl")))
    with pytest.raises(UserError, match="not found"):
        sources.load(DatasetConfig(type="jsonl", path=str(tmp_path / "nope.jsonl")))


@pytest.mark.slow
def test_hf_save_to_disk_and_script_free_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    data = {"question": ["What is 2+3?", "What is 4+4?"], "answer": ["It is 5.\n#### 5", "#### 8"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(data)}).save_to_disk(str(tmp_path / "saved"))
    rows = sources.load(DatasetConfig(type="hf", path=str(tmp_path / "saved")))
    assert [r["prompt"] for r in rows] == data["question"]
    assert rows[1]["answer"] == "#### 8"
    # A folder as downloaded from the Hub: data files, no loading script.
    (tmp_path / "hub" / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"problem": ["p1", "p2", "p3"], "answer": ["1", "2", "3"]}).to_parquet(
        str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    rows = sources.load(DatasetConfig(type="hf", path=str(tmp_path / "hub"), question_field="problem"))
    assert [r["answer"] for r in rows] == ["1", "2", "3"]
    assert len({r["id"] for r in rows}) == 3
    with pytest.raises(UserError, match="not a folder"):
        sources.load(DatasetConfig(type="hf", path=_write_jsonl(tmp_path / "f.jsonl", [{"a": 1}])))


def test_split_eval_held_out_or_from_path(tmp_path):
    rows = [{"id": str(i), "prompt": "q", "answer": "1"} for i in range(20)]
    train, ev = sources.split_eval(rows, DatasetConfig(type="toy", eval_size=5), seed=1)
    assert len(train) == 15
    assert len(ev) == 5
    assert not {r["id"] for r in train} & {r["id"] for r in ev}
    assert sources.split_eval(rows, DatasetConfig(type="toy", eval_size=5), seed=1)[1] == ev  # seeded
    assert sources.split_eval(rows, DatasetConfig(type="toy"), seed=1) == (rows, [])
    p = _write_jsonl(tmp_path / "ev.jsonl", [{"question": f"e{i}", "answer": "1"} for i in range(4)])
    train, ev = sources.split_eval(rows, DatasetConfig(type="jsonl", path=p, eval_path=p, eval_size=3), seed=1)
    assert train == rows
    assert [r["prompt"] for r in ev] == ["e0", "e1", "e2"]
    with pytest.raises(UserError, match="holds out every prompt"):
        sources.split_eval(rows, DatasetConfig(type="toy", eval_size=20), seed=1)


class _Tok:
    """A character tokenizer with a bos token, enough for tokenize_rows."""

    bos_token, bos_token_id = "<bos>", 1

    def __call__(self, text, add_special_tokens=False):
        if text.startswith(self.bos_token):
            return {"input_ids": [1] + [ord(c) for c in text[len(self.bos_token):]]}
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1, 2] + [ord(c) for c in messages[0]["content"]] + [3]


def test_tokenize_no_double_bos_chat_template_and_dropped_count():
    rows = [{"id": "a", "prompt": "<bos>ab"}, {"id": "b", "prompt": "cd"}, {"id": "c", "prompt": "x" * 50}]
    kept, dropped = tokenize_rows(rows, _Tok(), max_prompt_len=10)
    assert dropped == 1
    assert [r["id"] for r in kept] == ["a", "b"]
    assert kept[0]["prompt_ids"] == [1, 97, 98]
    assert kept[1]["prompt_ids"] == [1, 99, 100]
    kept, _ = tokenize_rows(rows[1:2], _Tok(), max_prompt_len=10, apply_chat_template=True)
    assert kept[0]["prompt_ids"] == [1, 2, 99, 100, 3]


def test_gpu_preset_dry_run_counts_areal_rows(tmp_path, capsys, monkeypatch):
    from areal_kit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "datasets").mkdir()
    _areal(tmp_path / "datasets", n=3000)
    (tmp_path / "datasets" / "prompts.jsonl").rename(tmp_path / "datasets" / "prompts_for_r1_distilled.jsonl")
    try:
        main(["train", "1.5B_n4", "--dry-run", f"storage_root={tmp_path}"])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert f"dataset: 3000 prompts ({tmp_path}/datasets/prompts_for_r1_distilled.jsonl); 2 steps per epoch, " \
           "20 steps in all" in out.replace("\n", "")


def test_cli_entry_prints_rows(tmp_path):
    import subprocess
    import sys

    p = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    out = subprocess.run([sys.executable, "-m", "areal_kit.data.sources", p], capture_output=True, text=True, check=False)
    assert out.returncode == 0
    assert out.stdout.startswith("1 rows; first:")


def test_namespace_config_is_enough():
    # Not a DatasetConfig on purpose: data/prompts.py (a dataset.mix source) and the module's CLI pass plain
    # namespaces; the loader reads only these fields.
    with pytest.raises(UserError, match="not found"):
        sources.load(SimpleNamespace(path="/nonexistent/x.jsonl", type="jsonl", id2info_path="",
                                     question_field="question", answer_field="answer"))


# ------------------------------------------------------------------ a run's prompts (data/prompts.run_prompts)
def test_check_rows():
    check_rows([{"id": 1, "answer": "3"}, {"id": 2, "solutions": ["\\boxed{2}"]}], ["math"])
    check_rows([{"id": 1}], ["my.module:fn"])  # custom rewards: nothing to check
    with pytest.raises(UserError, match="dataset row 7 has no answer or solutions field"):
        check_rows([{"id": 1, "answer": "3"}, {"id": 7, "answer": ""}], ["math"])
    with pytest.raises(UserError, match="reward 'toy' needs"):
        check_rows([{"id": 1, "solutions": ["1"]}], ["toy"])


def test_rows_the_reward_cannot_grade_are_refused_where_they_are_read(tmp_path):
    """AReaL's rows carry solutions, no answer: the toy reward cannot grade them. The run refuses
    them in one line, and the dry-run plan reports the same instead of counting them."""
    from areal_kit.rl.plan import dataset_size

    path = _areal(tmp_path).path
    cfg = load_config("tiny", [f"fileroot={tmp_path}", "dataset.type=areal", f"dataset.path={path}"])
    with pytest.raises(UserError, match="dataset row 'q0' has no answer field, which reward 'toy' needs"):
        read_rows(cfg)
    n, note = dataset_size(cfg)
    assert n is None and "which reward 'toy' needs" in note
    cfg = load_config("tiny", [f"fileroot={tmp_path}", "dataset.type=areal", f"dataset.path={path}",
                               "ppo.reward_fns=[math]", "dataset.eval_size=2"])
    train, ev = read_rows(cfg)
    assert (len(train), len(ev)) == (3, 2)
    assert {r["id"] for r in train} | {r["id"] for r in ev} == {f"q{i}" for i in range(5)}
    assert dataset_size(cfg) == (3, f"{path}; eval split 2 prompts held out")


def test_run_prompts_tokenizes_both_splits_and_loads_the_training_rows(tmp_path):
    model = str(tmp_path / "model")  # only the tokenizer is read
    build_tokenizer(TinySpec(kind="toy")).save_pretrained(model)
    short = [{"id": f"s{i}", "question": "1 + 2 =", "answer": "3"} for i in range(12)]
    long = [{"id": f"l{i}", "question": "1 + 2 + 3 + 4 =", "answer": "1 0"} for i in range(4)]
    path = _write_jsonl(tmp_path / "d.jsonl", short + long)
    cfg = load_config("tiny", [f"fileroot={tmp_path}", "dataset.type=jsonl", f"dataset.path={path}",
                               "dataset.eval_size=3", "dataset.max_prompt_len=6", "dataset.train_bs_n_seqs=4"])
    train, ev = read_rows(cfg)
    got = run_prompts(cfg, model)
    kept = [r["id"] for r in train if r["id"].startswith("s")]
    assert [r["id"] for r in got.loader.rows] == kept  # the long prompts dropped, and counted
    assert got.n_dropped == len(train) - len(kept) > 0
    assert [r["id"] for r in got.eval_rows] == [r["id"] for r in ev if r["id"].startswith("s")]
    bos = got.tokenizer.bos_token_id
    assert all(r["prompt_ids"][0] == bos and len(r["prompt_ids"]) == 5 for r in got.loader.rows + got.eval_rows)
    assert got.loader.steps_per_epoch == len(kept) // 4

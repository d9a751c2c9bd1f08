"""`areal-kit filter` without an engine: --keep, the selection rule, records -> rates, bad input
(one line, exit 2, nothing written), and whole runs whose samples are all recorded already
(rates, filtered file read back by training's loader, refused changes).

The generation through the real vLLM engine is in tests/integration/test_filter_tiny.py.

    .venv/bin/python -m pytest tests/unit/test_filter.py -q
"""

import json

import pytest
from cli_run import assert_one_line_error, run_cli

from areal_kit.cli import main
from areal_kit.config.dataset import DatasetConfig
from areal_kit.data import sources
from areal_kit.eval.filter import kept, prompt_rates, sample_keys, summary
from areal_kit.eval.options import parse_keep

pytestmark = pytest.mark.unit

ROWS = [{"id": f"q{i}", "question": f"{i} + 1 =", "answer": str(i + 1)} for i in range(5)]
# Correct samples of q0..q4 out of 4: rates 0, 0.25, 0.5, 0.75, 1.
N_CORRECT = [0, 1, 2, 3, 4]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(ids_correct, num_samples):
    """Per-sample records as filter writes them: the first n_correct samples of a prompt correct."""
    out = []
    for rid, c in ids_correct:
        for i, key in enumerate(sample_keys(rid, num_samples)):
            out.append({"key": key, "id": rid, "sample": i, "completion": "", "extracted": None,
                        "correct": i < c, "tokens": 1, "finish_reason": "stop"})
    return out


@pytest.mark.parametrize("text,want", [("0.1-0.9", (0.1, 0.9)), ("0-1", (0.0, 1.0)), (" .25 - .5 ", (0.25, 0.5)),
                                       ("0.5-0.5", (0.5, 0.5)), ("1-1", (1.0, 1.0))])
def test_keep_parses_inclusive_ranges(text, want):
    assert parse_keep(text) == want


@pytest.mark.parametrize("text,needle", [("0.9-0.1", "LO 0.9 is above HI 0.1"), ("0.5", "not a range"),
                                         ("a-b", "not a range"), ("0.1-1.5", "at most 1"),
                                         ("-0.1-0.5", "not a range"), ("0.1-0.9-1", "not a range")])
def test_bad_keep_is_one_line_exit_2_before_anything_else(text, needle, tmp_path, capsys):
    # The model does not exist either: --keep is checked first.
    code, _, err = run_cli(["filter", "--model_path", str(tmp_path / "none"), "--dataset", str(tmp_path / "d.jsonl"),
                            "--output_path", str(tmp_path / "out"), "--keep", text], capsys)
    assert_one_line_error(code, err, f"--keep {text!r}", needle)
    assert not (tmp_path / "out").exists()


def test_selection_rule_includes_both_ends():
    keep = (0.25, 0.75)
    assert [kept(x, keep) for x in (0.0, 0.24, 0.25, 0.5, 0.75, 0.76, 1.0)] == \
        [False, False, True, True, True, False, False]
    assert kept(0.0, (0.0, 0.0)) and not kept(None, (0.0, 1.0))
    assert kept(0.1, parse_keep("0.1-0.9")) and kept(9 / 10, parse_keep("0.1-0.9"))  # n_correct / n at the ends


def test_records_to_rates_use_the_first_num_samples_and_mark_skipped_prompts():
    recs = records(zip(["q0", "q1", "q2", "q3"], N_CORRECT), 6)  # 6 recorded, 4 asked for
    done = {r["key"]: r for r in recs}
    rows = [{"id": f"q{i}"} for i in range(5)]
    rates = prompt_rates(rows, {"q0", "q1", "q2", "q3"}, done, 4, (0.25, 0.5))
    assert [r["id"] for r in rates] == ["q0", "q1", "q2", "q3", "q4"]
    assert [r["n_correct"] for r in rates] == [0, 1, 2, 3, 0]
    assert [r["pass_rate"] for r in rates] == [0.0, 0.25, 0.5, 0.75, None]
    assert [r["n_samples"] for r in rates] == [4, 4, 4, 4, 0]
    assert [r["kept"] for r in rates] == [False, True, True, False, False]
    assert rates[4]["skipped"] == "prompt_too_long"
    line = summary(rates, (0.25, 0.5), 2048)
    assert line.startswith("filter: kept 2 of 5 prompts (pass rate in [0.25, 0.5]); mean pass rate 0.375;")
    assert "rates 0:1 (0,0.25):0 [0.25,0.5):1 [0.5,0.75):1 [0.75,1):1 1:0" in line
    assert line.endswith("; 1 longer than max_prompt_len=2048 not sampled")


@pytest.mark.parametrize("extra,needles", [
    (["--type", "toy"], ["--type 'toy'", "areal, jsonl, hf"]),
    (["--num_samples", "0"], ["num_samples must be >= 1"]),
    (["--temperature", "0"], ["temperature must be > 0"]),
    (["--dataset", "MISSING"], ["not found"]),
    (["--dataset", "NOANSWER"], ["no reference answer in field 'answer'", ":2:"]),
    (["--type", "areal"], ["id2info"]),
    (["--model_path", "MISSING"], ["filter takes one --model_path, got 2"]),  # eval's repeats it, filter's does not
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(extra, needles, fake_model, tmp_path, capsys):
    (tmp_path / "data").mkdir()
    good = write_jsonl(tmp_path / "data" / "d.jsonl", ROWS)
    bad = write_jsonl(tmp_path / "data" / "noanswer.jsonl", [ROWS[0], {"question": "2 + 2 ="}])
    subst = {"MISSING": str(tmp_path / "data" / "missing.jsonl"), "NOANSWER": str(bad)}
    args = ["filter", "--model_path", str(fake_model), "--dataset", str(good), "--output_path", str(tmp_path / "out")]
    code, _, err = run_cli(args + [subst.get(a, a) for a in extra], capsys)
    assert_one_line_error(code, err, *needles)
    assert not (tmp_path / "out").exists()


def test_output_in_the_dataset_folder_is_refused(fake_model, tmp_path, capsys):
    good = write_jsonl(tmp_path / "d.jsonl", ROWS)
    code, _, err = run_cli(["filter", "--model_path", str(fake_model), "--dataset", str(good),
                            "--output_path", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is the dataset's folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "model"]


@pytest.mark.slow
def test_a_model_without_tokenizer_is_one_line(fake_model, tmp_path, capsys):
    good = write_jsonl(tmp_path / "d.jsonl", ROWS)
    code, _, err = run_cli(["filter", "--model_path", str(fake_model), "--dataset", str(good),
                            "--output_path", str(tmp_path / "out")], capsys)
    assert_one_line_error(code, err, f"cannot load the tokenizer of {fake_model}")
    assert not (tmp_path / "out").exists()


# Whole runs with every sample recorded beforehand: no engine starts, everything else is real.

@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    return build(str(tmp_path_factory.mktemp("tiny") / "toy"), TinySpec(kind="toy"))


def prefill(out, ids_correct, num_samples=4):
    out.mkdir(parents=True)
    write_jsonl(out / "samples.jsonl", records(ids_correct, num_samples))
    return (out / "samples.jsonl").read_bytes()


def filter_args(model, data, out, *extra, num_samples=4):
    return ["filter", "--model_path", str(model), "--dataset", str(data), "--output_path", str(out),
            "--num_samples", str(num_samples), *extra]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_jsonl_run_writes_rates_and_a_filtered_file_training_reads(toy_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [{**r, "source": "x"} for r in ROWS])
    out = tmp_path / "out"
    before = prefill(out, zip([r["id"] for r in ROWS], N_CORRECT))
    main(filter_args(toy_model, data, out, "--keep", "0.25-0.75"))
    printed = capsys.readouterr().out
    assert "20 samples over 5 prompts, 20 already done, 0 to generate" in printed
    assert "vLLM engine" not in printed
    assert "filter: kept 3 of 5 prompts (pass rate in [0.25, 0.75])" in printed
    assert (out / "samples.jsonl").read_bytes() == before
    rates = read_jsonl(out / "rates.jsonl")
    assert [(r["id"], r["pass_rate"], r["kept"]) for r in rates] == \
        [("q0", 0.0, False), ("q1", 0.25, True), ("q2", 0.5, True), ("q3", 0.75, True), ("q4", 1.0, False)]
    kept_rows = read_jsonl(out / "filtered.jsonl")
    # the rows as stored, plus their rates
    assert kept_rows == [{**ROWS[i], "source": "x", "pass_rate": N_CORRECT[i] / 4, "n_correct": N_CORRECT[i],
                          "n_samples": 4} for i in (1, 2, 3)]
    back = sources.load(DatasetConfig(type="jsonl", path=str(out / "filtered.jsonl")))
    assert [(r["id"], r["prompt"], r["answer"]) for r in back] == [("q1", "1 + 1 =", "2"), ("q2", "2 + 1 =", "3"),
                                                                   ("q3", "3 + 1 =", "4")]
    # another --keep: nothing generated, the selection redone
    main(filter_args(toy_model, data, out, "--keep", "0-0"))
    assert "kept 1 of 5" in capsys.readouterr().out
    assert [r["id"] for r in read_jsonl(out / "filtered.jsonl")] == ["q0"]
    # fewer samples: the first two of each
    main(filter_args(toy_model, data, out, "--keep", "0.5-0.5", num_samples=2))
    assert "10 samples over 5 prompts, 10 already done, 0 to generate" in capsys.readouterr().out
    assert [r["pass_rate"] for r in read_jsonl(out / "rates.jsonl")] == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert [r["id"] for r in read_jsonl(out / "filtered.jsonl")] == ["q1"]
    assert (out / "samples.jsonl").read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("change,needle", [
    (["--temperature", "0.7"], "temperature: 0.6 -> 0.7"),
    (["--seed", "1"], "seed: 0 -> 1"),
    (["--max_gen_tokens", "8"], "max_gen_tokens: 16384 -> 8"),
    (["--top_p", "0.9"], "top_p: 1.0 -> 0.9"),
    (["CHANGED_DATA"], "dataset_sha256: "),
])
def test_a_rerun_with_other_settings_is_refused(change, needle, toy_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    out = tmp_path / "out"
    prefill(out, zip([r["id"] for r in ROWS], N_CORRECT))
    main(filter_args(toy_model, data, out))
    config = (out / "run_config.json").read_text()
    outputs = {p: (out / p).read_bytes() for p in ("samples.jsonl", "rates.jsonl", "filtered.jsonl")}
    if change == ["CHANGED_DATA"]:
        write_jsonl(data, [ROWS[0], {**ROWS[1], "answer": "7"}, *ROWS[2:]])
        change = []
    capsys.readouterr()
    code, _, err = run_cli(filter_args(toy_model, data, out, *change), capsys)
    assert_one_line_error(code, err, "holds samples made with other settings", needle)
    assert (out / "run_config.json").read_text() == config
    assert {p: (out / p).read_bytes() for p in outputs} == outputs


@pytest.mark.slow
def test_chat_template_without_one_is_one_line(toy_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    code, _, err = run_cli(filter_args(toy_model, data, tmp_path / "out", "--apply_chat_template"), capsys)
    assert_one_line_error(code, err, "--apply_chat_template: the tokenizer of", "has no chat template")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_areal_run_writes_rows_and_id2info_training_reads(toy_model, tmp_path, capsys):
    src = tmp_path / "boba"
    src.mkdir()
    rows = [{"prompt": r["question"], "query_id": f"{r['id']}@idx:0", "task": "math"} for r in ROWS]
    write_jsonl(src / "boba.jsonl", rows)
    info = {r["id"]: {"solutions": [f"\\boxed{{{r['answer']}}}"], "extra": r["id"]} for r in ROWS}
    info["unused"] = {"solutions": ["\\boxed{0}"]}
    (src / "id2info.json").write_text(json.dumps(info))
    out = tmp_path / "out"
    prefill(out, zip([r["query_id"] for r in rows], N_CORRECT))
    main(filter_args(toy_model, src / "boba.jsonl", out, "--type", "areal", "--keep", "0.5-1"))
    assert "kept 3 of 5" in capsys.readouterr().out
    assert read_jsonl(out / "filtered.jsonl") == [{**rows[i], "pass_rate": N_CORRECT[i] / 4, "n_correct": N_CORRECT[i],
                                                   "n_samples": 4} for i in (2, 3, 4)]
    assert json.loads((out / "id2info.json").read_text()) == {k: info[k] for k in ("q2", "q3", "q4")}
    back = sources.load(DatasetConfig(type="areal", path=str(out / "filtered.jsonl")))
    assert [(r["id"], r["solutions"]) for r in back] == [(f"q{i}@idx:0", [f"\\boxed{{{i + 1}}}"]) for i in (2, 3, 4)]


@pytest.mark.slow
def test_hf_folder_is_read_and_written_as_jsonl(toy_model, tmp_path, capsys):
    pytest.importorskip("datasets")
    src = tmp_path / "hub"
    src.mkdir()
    write_jsonl(src / "train.jsonl", [{"problem": r["question"], "solution": int(r["answer"]), "id": r["id"]}
                                      for r in ROWS])
    out = tmp_path / "out"
    prefill(out, zip([r["id"] for r in ROWS], N_CORRECT))
    main(filter_args(toy_model, src, out, "--type", "hf", "--question_field", "problem", "--answer_field",
                     "solution", "--keep", "0-0.25"))
    assert "kept 2 of 5" in capsys.readouterr().out
    back = sources.load(DatasetConfig(type="jsonl", path=str(out / "filtered.jsonl"), question_field="problem",
                                      answer_field="solution"))
    assert [(r["id"], r["prompt"], r["answer"], r["pass_rate"]) for r in back] == \
        [("q0", "0 + 1 =", "1", 0.0), ("q1", "1 + 1 =", "2", 0.25)]
    listing = sorted(p.name for p in src.iterdir())
    code, _, err = run_cli(filter_args(toy_model, src, src / "out", "--type", "hf"), capsys)
    assert_one_line_error(code, err, "is the dataset's folder")  # its files would become the dataset's
    assert sorted(p.name for p in src.iterdir()) == listing


def test_filter_has_help(capsys):
    main(["filter", "--help"])
    out = capsys.readouterr().out
    assert "areal-kit filter" in out and "--keep" in out and "--num_samples" in out

"""`areal-kit eval` bad input (one line, exit 2, before any engine starts), its table in a pipe,
and `areal-kit grade`.

    .venv/bin/python -m pytest tests/unit/test_eval_cli.py -q
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, run_cli

from areal_kit.cli import main
from areal_kit.eval import engine as eval_engine
from areal_kit.eval import report
from areal_kit.eval.data import EVAL_DIR, Question, sample_keys
from areal_kit.eval.options import EvalConfig


def ok_cli(args, capsys):
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_unknown_data_name_lists_known(capsys, fake_model, tmp_path):
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--output_path",
                            str(tmp_path / "o"), "--data_names", "math_500,mathh"], capsys)
    assert_one_line_error(code, err, "unknown dataset 'mathh'", "math_500, aime24, amc23, gsm8k")


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run_cli(["eval", "--model_path", str(tmp_path / "nope"), "--data_names",
                            "gsm8k"], capsys)
    assert_one_line_error(code, err, "model path", "not found")


def test_model_folder_without_config(capsys, tmp_path):
    (tmp_path / "m").mkdir()
    code, _, err = run_cli(["eval", "--model_path", str(tmp_path / "m")], capsys)
    assert_one_line_error(code, err, "no config.json")


def test_row_without_question_field(capsys, fake_model, tmp_path):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"prompt": "2+2?", "answer": "#### 4"}]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--data_dir",
                            str(tmp_path / "data"), "--data_names", "gsm8k", "--output_path",
                            str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "test.jsonl:2", "no 'question' field")


def test_missing_dataset_file_and_bad_options(capsys, fake_model, tmp_path):
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--data_dir",
                            str(tmp_path), "--data_names", "aime24"], capsys)
    assert_one_line_error(code, err, "aime24/test.jsonl not found")
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--prompt_type", "chatty"], capsys)
    assert_one_line_error(code, err, "unknown prompt_type 'chatty'", "deepscaler")
    code, _, err = run_cli(["eval", "--model_path", str(fake_model), "--top_p", "0"], capsys)
    assert_one_line_error(code, err, "top_p")


def test_grade_pred_ref_prints_verdict_and_parsed_forms(capsys):
    code, out, _ = ok_cli(["grade", "\\frac{1}{2}", "0.5"], capsys)
    assert code == 0
    assert "verdict:   CORRECT" in out
    assert "parsed ['1/2'" in out
    code, out, _ = ok_cli(["grade", "the result is \\boxed{7}", "8"], capsys)
    assert "WRONG" in out
    assert "extracted '7'" in out


def test_grade_file_summary(capsys, tmp_path):
    rows = [{"pred": "\\frac{1}{2}", "ref": "0.5", "expected": True},
            {"pred": "2,125", "ref": "2125", "expected": True},
            {"pred": "3", "ref": "4", "expected": False},
            {"pred": "3", "ref": "4", "expected": True}]  # a wrong expectation: counted as failed
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = ok_cli(["grade", "--file", str(f)], capsys)
    lines = out.strip().splitlines()
    verdicts = [json.loads(line) for line in lines[:-1]]
    assert [v["correct"] for v in verdicts] == [True, True, False, False]
    assert [v["ok"] for v in verdicts] == [True, True, True, False]
    assert lines[-1] == "3 passed, 1 failed"
    assert code == 1


def test_grade_bad_input(capsys, tmp_path):
    code, _, err = run_cli(["grade"], capsys)
    assert_one_line_error(code, err, "PRED and REF")
    code, _, err = run_cli(["grade", "--file", str(tmp_path / "none.jsonl")], capsys)
    assert_one_line_error(code, err, "not found")
    f = tmp_path / "bad.jsonl"
    f.write_text('{"pred": "1", "ref": "1"}\n{"pred": "1"}\n')
    code, _, err = run_cli(["grade", "--file", str(f)], capsys)
    assert_one_line_error(code, err, "bad.jsonl:2")



# ------------------------------------------------------------------ the AReaL guide's flags
ROWS = [{"idx": i, "question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]


class Answers:
    """A stand-in for the vLLM engines, which cannot start on a model built in a unit test's time:
    it answers \\boxed{1} to every request and keeps what open_engines was given. The runner, the
    records, the grading and the CLI are the real code (the real engine: test_eval_tiny.py)."""

    num_engines = 1

    def __init__(self, answer: tuple[int, ...]):
        self.answer, self.opened, self.requests = answer, [], []

    def open(self, *args, **kwargs):
        self.opened.append((args, kwargs))
        return self

    def generate(self, requests):
        self.requests += requests
        return [eval_engine.GenResult(r.key, self.answer, "stop") for r in requests]

    def close(self):
        pass


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    return build(str(tmp_path_factory.mktemp("tiny") / "bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))


@pytest.fixture
def engines(bpe_model, monkeypatch):
    from areal_kit.data.tokenizer import load_tokenizer

    stand_in = Answers(tuple(load_tokenizer(bpe_model)("\\boxed{1}", add_special_tokens=False)["input_ids"]))
    monkeypatch.setattr(eval_engine, "open_engines", stand_in.open)
    return stand_in


def guide_eval(model, tmp_path, *flags) -> list[str]:
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return ["eval", "--model_path", str(model), "--output_path", str(tmp_path / "out"), "--data_dir",
            str(tmp_path / "data"), "--data_names", "gsm8k", "--prompt_type", "plain", "--max_gen_tokens", "4",
            *flags]


def test_the_guides_sampling_flags_set_the_samples_per_question(engines, bpe_model, tmp_path, capsys):
    """--num_sample_nodes N --samples_per_node M --n_sampling K (the guide's line): N x M sampled
    answers a question, each with its own seed, and one greedy; vLLM eager by default."""
    code, out, err = ok_cli(guide_eval(bpe_model, tmp_path, "--num_sample_nodes", "2", "--samples_per_node", "3",
                                       "--n_sampling", "6"), capsys)
    assert code == 0, err
    modes = [r.temperature == 0 for r in engines.requests]
    assert (modes.count(True), modes.count(False)) == (len(ROWS), 6 * len(ROWS))
    assert len({r.seed for r in engines.requests if r.temperature}) == 6 * len(ROWS)
    assert engines.opened[0][0][-1] is True  # enforce_eager
    agg = json.loads((tmp_path / "out" / "aggregate.json").read_text())["results"]["gsm8k"]
    assert agg["sample_pass@1"] == pytest.approx(100 / len(ROWS), abs=1e-3)  # right on "0 + 1" only
    # --n_sampling alone is --num_samples; the same samples: nothing to generate
    code, out, _ = ok_cli(guide_eval(bpe_model, tmp_path, "--n_sampling", "6"), capsys)
    assert code == 0 and "0 to generate" in out and len(engines.opened) == 1


def test_overwrite_evaluates_from_scratch_and_no_enforce_eager_reaches_the_engine(engines, bpe_model, tmp_path,
                                                                                  capsys):
    args = guide_eval(bpe_model, tmp_path, "--num_samples", "2")
    assert ok_cli(args, capsys)[0] == 0
    n = len(engines.requests)
    assert n == 3 * len(ROWS)
    assert ok_cli(args, capsys)[0] == 0 and len(engines.requests) == n  # a re-run resumes: nothing anew
    keep = tmp_path / "out" / "notes.txt"
    keep.write_text("mine")
    code, out, _ = ok_cli([*args, "--overwrite", "--no-enforce-eager"], capsys)
    assert code == 0
    assert f"--overwrite: deleted the {n} records of an earlier evaluation" in out
    assert len(engines.requests) == 2 * n  # every sample again
    assert engines.opened[-1][0][-1] is False
    assert keep.read_text() == "mine"  # nothing but eval's own records
    lines = (tmp_path / "out" / "gsm8k" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == n
    assert ok_cli([*args, "--no_enforce_eager", "--overwrite"], capsys)[0] == 0
    assert engines.opened[-1][0][-1] is False


@pytest.mark.parametrize("flags, message", [
    (["--num_samples", "4", "--n_sampling", "8"], "--num_samples 4 and --n_sampling 8 disagree"),
    (["--num_sample_nodes", "8", "--samples_per_node", "4", "--n_sampling", "64"],
     "--n_sampling 64 is more than --num_sample_nodes 8 x --samples_per_node 4 = 32 sampled answers"),
    (["--num_sample_nodes", "8", "--num_samples", "16"],
     "--num_samples 16 is not --num_sample_nodes 8 x --samples_per_node 4 = 32"),
    (["--samples_per_node", "0"], "--num_sample_nodes 8 x --samples_per_node 0 is not valid"),
])
def test_the_guides_sampling_flags_that_disagree(flags, message, fake_model, tmp_path, capsys):
    code, _, err = run_cli(guide_eval(fake_model, tmp_path, *flags), capsys)
    assert_one_line_error(code, err, message)


LONG_NAME = "olympiad_geometry_competition_level_5_hard"
SCRIPT = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "areal-kit"


@pytest.mark.slow
def test_eval_table_in_a_pipe_keeps_names_and_numbers_whole(tmp_path):
    """A finished evaluation (every sample recorded: no engine starts) re-printed by the installed
    script with its stdout piped: one markdown row a dataset, every name and number whole."""
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (run bash .ci/install.sh)")
    manifest_dir = tmp_path / "evaluation"
    manifest_dir.mkdir()
    shutil.copy(EVAL_DIR / "prompts.yaml", manifest_dir)
    (manifest_dir / "manifest.yaml").write_text(
        f"datasets:\n  {LONG_NAME}:\n    question_field: question\n    answer_field: answer\n"
        "    id_field: idx\n")
    model = tmp_path / "Qwen2.5-Math-1.5B-grpo-trial-with-a-long-name-globalstep600"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data, out = tmp_path / "data" / LONG_NAME, tmp_path / "out"
    data.mkdir(parents=True)
    (out / LONG_NAME).mkdir(parents=True)
    rows = [{"question": f"{i}+1?", "answer": str(i + 1), "idx": i} for i in range(4)]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig(model_path=str(model), output_path=str(out), data_names=[LONG_NAME], prompt_type="plain",
                     greedy=True, num_samples=2)
    records = [{"key": key, "correct": i == 0, "tokens": 1234 + idx, "finish_reason": "stop", "mode": mode}
               for i in range(4) for key, mode, idx in sample_keys(Question(LONG_NAME, str(i), "", "", ""), cfg)]
    (out / LONG_NAME / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    r = subprocess.run([str(SCRIPT), "eval", "--model_path", str(model), "--output_path", str(out), "--data_names",
                        LONG_NAME, "--data_dir", str(tmp_path / "data"), "--prompt_type", "plain",
                        "--num_samples", "2"], capture_output=True, text=True, cwd=tmp_path, check=False,
                       timeout=120, env={**env, "AREAL_EVAL_MANIFEST_DIR": str(manifest_dir)})
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr}"
    assert "…" not in r.stdout, "a cell was cut with an ellipsis"
    assert model.name in r.stdout, "the title lost the model's name"
    header = next((ln for ln in r.stdout.splitlines() if ln.startswith("| dataset ")), None)
    assert header is not None, f"no header row: {r.stdout}"
    assert [c.strip() for c in header.strip("| ").split(" | ")] == report.COLUMNS, header
    row = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"| {LONG_NAME} ")), None)
    assert row is not None, f"no row starts with the whole dataset name: {r.stdout}"
    cells = [c.strip() for c in row.strip("| ").split(" | ")]
    # greedy tokens 1234, sampled 1234 and 1235; greedy and pass@1 right on 1 question of 4
    assert cells == [LONG_NAME, "4", "1234.0", "1234.5", "25.0", "25.0", "-", "-"], row


@pytest.mark.parametrize("command, config", [("eval_", "EvalConfig"), ("filter_", "FilterConfig")])
def test_every_option_of_the_config_is_a_flag_of_its_command(command, config):
    """eval and filter take their options from their config's fields (eval/options.py): each one
    declared on a field is a flag of the command, with the field's default."""
    import inspect

    from areal_kit import flags
    from areal_kit.eval import cmd, options

    declared = {p.name: p.default.default for p in flags.params(getattr(options, config))}
    given = {name: p.default.default for name, p in inspect.signature(getattr(cmd, command)).parameters.items()}
    assert len(declared) >= 10
    assert {name: given.get(name) for name in declared} == declared

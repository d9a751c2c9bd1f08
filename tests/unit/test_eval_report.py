"""Aggregation, table files and resumable records, on synthetic records (no engine)."""

import csv
import json

from areal_kit.eval import report
from areal_kit.eval.data import Question, sample_keys
from areal_kit.eval.evaluation import EvalConfig, load_records, run, sample_seed


def make_cfg(tmp_path, **kw):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return EvalConfig(model_path=str(model), output_path=str(tmp_path / "out"), **kw)


def synthetic(cfg, correct_by_q):
    """questions q0..: greedy correct iff q index even; sampled: correct_by_q[q] of them."""
    qs = [Question("gsm8k", f"q{i}", "?", "1", "?") for i in range(len(correct_by_q))]
    recs = {}
    for i, q in enumerate(qs):
        for key, mode, idx in sample_keys(q, cfg):
            ok = (i % 2 == 0) if mode == "greedy" else idx < correct_by_q[i]
            recs[key] = {"key": key, "correct": ok, "tokens": 10 + idx if mode == "sample" else 7,
                         "finish_reason": "stop", "mode": mode}
    return {"gsm8k": qs}, {"gsm8k": recs}


def test_aggregate_values(tmp_path):
    cfg = make_cfg(tmp_path, num_samples=16, data_names=["gsm8k"])
    questions, recs = synthetic(cfg, [16, 0, 1, 8])
    r = report.aggregate(cfg, questions, recs)["results"]["gsm8k"]
    assert r["num_questions"] == 4
    assert r["greedy_length"] == 7.0
    assert r["sample_length"] == 17.5                     # mean of 10..25
    assert r["greedy_acc"] == 50.0
    assert r["sample_pass@1"] == round(100 * (1 + 0 + 1 / 16 + 0.5) / 4, 4)
    # pass@8: 1, 0, 8/16 (one correct), 1 - C(8,8)/C(16,8)
    assert r["pass@8"] == round(100 * (1 + 0 + 0.5 + 1 - 1 / 12870) / 4, 4)
    assert r["pass@16"] == 75.0


def test_pass_at_k_only_where_num_samples_allows(tmp_path):
    cfg = make_cfg(tmp_path, num_samples=4, data_names=["gsm8k"])
    questions, recs = synthetic(cfg, [4, 0])
    agg = report.aggregate(cfg, questions, recs)
    r = agg["results"]["gsm8k"]
    assert r["pass@8"] is None
    assert r["pass@16"] is None
    assert report.rows(agg)[0][-2:] == ["-", "-"]
    assert report.markdown(agg).splitlines()[0] == "| " + " | ".join(report.COLUMNS) + " |"
    table = list(csv.reader(report.csv_text(agg).splitlines()))
    assert table[0] == report.COLUMNS
    assert table[1][0] == "gsm8k"
    assert table[1][-1] == ""


def test_load_records_cuts_a_torn_last_line(tmp_path):
    p = tmp_path / "samples.jsonl"
    p.write_text('{"key": "a", "x": 1}\n{"key": "b", "x": 2}\n{"key": "c", "x"')
    recs = load_records(p)
    assert set(recs) == {"a", "b"}
    assert p.read_text().endswith('"x": 2}\n')


def test_finished_output_rebuilds_table_without_an_engine(tmp_path, monkeypatch):
    """A re-run over complete records opens no engine and writes the same aggregate."""
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    data.joinpath("test.jsonl").write_text(
        "".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}", "idx": i}) + "\n"
                for i in range(3)))
    cfg = make_cfg(tmp_path, num_samples=2, data_names=["gsm8k"], data_dir=str(tmp_path / "data"),
                   prompt_type="plain")
    out = tmp_path / "out" / "gsm8k"
    out.mkdir(parents=True)
    with open(out / "samples.jsonl", "w") as f:
        for i in range(3):
            f.writelines(json.dumps({"key": key, "correct": i == 0, "tokens": 5,
                                    "finish_reason": "stop", "mode": mode}) + "\n" for key, mode, idx in [(f"gsm8k/{i}/greedy", "greedy", 0), (f"gsm8k/{i}/s0", "sample", 0),
                                   (f"gsm8k/{i}/s1", "sample", 1)])

    def no_engine(*a, **k):
        raise AssertionError("an engine was started although every sample was done")

    monkeypatch.setattr("areal_kit.eval.engine.open_engines", no_engine)
    agg1 = run(cfg)
    first = (tmp_path / "out" / "aggregate.json").read_text()
    agg2 = run(cfg)
    assert agg1 == agg2
    assert (tmp_path / "out" / "aggregate.json").read_text() == first
    assert agg1["results"]["gsm8k"]["greedy_acc"] == round(100 / 3, 4)


def test_changed_settings_are_refused(tmp_path):
    import pytest

    from areal_kit.errors import UserError

    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    data.joinpath("test.jsonl").write_text(json.dumps({"question": "1?", "answer": "#### 1"}) + "\n")
    (tmp_path / "out").mkdir()
    cfg = make_cfg(tmp_path, data_names=["gsm8k"], data_dir=str(tmp_path / "data"), temperature=1.0)
    (tmp_path / "out" / "run_config.json").write_text(json.dumps({**cfg.identity(), "temperature": 0.6}))
    with pytest.raises(UserError, match="temperature: 0.6 -> 1.0"):
        run(cfg)


def test_sample_seed_depends_only_on_seed_and_key():
    assert sample_seed(0, "gsm8k/1/s3") == sample_seed(0, "gsm8k/1/s3")
    assert sample_seed(0, "gsm8k/1/s3") != sample_seed(1, "gsm8k/1/s3")
    assert sample_seed(0, "gsm8k/1/s3") != sample_seed(0, "gsm8k/1/s4")

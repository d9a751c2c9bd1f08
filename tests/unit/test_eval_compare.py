"""`areal-kit eval` over several checkpoints: which folders it takes, in what order, the table
comparing them, and bad input refused before anything is written."""

import csv
import json

import pytest

from areal_kit.errors import UserError
from areal_kit.eval import compare


def model(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_a_folder_of_checkpoints_is_taken_in_global_step_order(tmp_path):
    run = tmp_path / "actor"
    for name in ("epoch1epochstep10globalstep10", "epoch1epochstep2globalstep2", "epoch2epochstep1globalstep101"):
        model(run / name)
    (run / "notes").mkdir()  # not a model: left out
    model(run / "epoch2epochstep2globalstep102.tmp")  # a save under way: left out
    base = model(tmp_path / "base")
    got = compare.expand([str(base), str(run)])
    assert [p.name for p in got] == ["base", "epoch1epochstep2globalstep2", "epoch1epochstep10globalstep10",
                                     "epoch2epochstep1globalstep101"]


@pytest.mark.parametrize("case,needle", [("missing", "not found"), ("empty", "no checkpoint folders inside"),
                                         ("same name", "two checkpoints are named 'm'")])
def test_bad_model_paths(tmp_path, case, needle):
    if case == "missing":
        paths = [tmp_path / "nope"]
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        paths = [tmp_path / "empty"]
    else:
        paths = [model(tmp_path / "a" / "m"), model(tmp_path / "b" / "m")]
    with pytest.raises(UserError, match=needle):
        compare.expand([str(p) for p in paths])


def agg(name, greedy, pass1):
    results = {d: {"dataset": d, "greedy_acc": g, "sample_pass@1": p} for d, g, p in zip(("math_500", "gsm8k"), greedy, pass1)}
    return {"settings": {"model_path": f"/runs/actor/{name}", "prompt_type": "plain", "num_samples": 4},
            "results": results}


def test_table_has_a_row_per_checkpoint_and_a_column_per_dataset_and_metric(tmp_path):
    cmp = compare.table([agg("base", (10.0, 50.0), (12.5, 40.0)), agg("globalstep9", (30.0, 70.0), (27.25, 65.0))])
    assert cmp["columns"] == ["checkpoint", "math_500:greedy_acc", "math_500:sample_pass@1", "gsm8k:greedy_acc",
                              "gsm8k:sample_pass@1"]
    assert cmp["rows"][1] == {"checkpoint": "globalstep9", "math_500:greedy_acc": 30.0,
                              "math_500:sample_pass@1": 27.25, "gsm8k:greedy_acc": 70.0, "gsm8k:sample_pass@1": 65.0}
    compare.write(tmp_path, cmp)
    assert json.loads((tmp_path / "compare.json").read_text())["rows"] == cmp["rows"]
    rows = list(csv.reader((tmp_path / "compare.csv").read_text().splitlines()))
    assert rows[0] == cmp["columns"]
    assert rows[2] == ["globalstep9", "30.0", "27.25", "70.0", "65.0"]
    assert (tmp_path / "compare.md").read_text().splitlines()[3] == "| globalstep9 | 30.0 | 27.2 | 70.0 | 65.0 |"


def test_a_metric_no_checkpoint_has_gets_no_column():
    cmp = compare.table([agg("a", (10.0, 50.0), (None, None)), agg("b", (20.0, 60.0), (None, None))])
    assert cmp["columns"] == ["checkpoint", "math_500:greedy_acc", "gsm8k:greedy_acc"]


def test_several_checkpoints_into_a_single_checkpoints_folder_is_refused(tmp_path, capsys):
    from areal_kit.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "run_config.json").write_text("{}")
    a, b = model(tmp_path / "a"), model(tmp_path / "b")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model_path", str(a), "--model_path", str(b), "--output_path", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.startswith("error: ")
    assert "holds the evaluation of one checkpoint" in err
    assert sorted(p.name for p in out.iterdir()) == ["run_config.json"], "nothing written"

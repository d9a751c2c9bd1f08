"""bench/run.py's plumbing on trivial benchmarks: JSON line, table, latest.json merge, PERFORMANCE.md.

No engines start: the benchmarks here are plain functions returning a Result.
"""

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import run as bench_run
from bench.report import Result, load_latest, run_all


def _demo(ratio=2.0, checks=None):
    return lambda: Result("demo", "demo thing vs baseline", {"ours_s": 1.0, "base_s": ratio},
                          ratio=ratio, target=1.5, columns=["side", "seconds"],
                          rows=[["ours", 1.0], ["baseline", ratio]], notes=["a note"], checks=checks or {})


def _run(registry, names, tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None)
    done = run_all(registry, names, out_dir=str(tmp_path), markdown_path=str(tmp_path / "PERF.md"),
                   about={"demo": "What demo measures."}, console=console)
    return done, out.getvalue()


def test_json_line_table_and_latest(tmp_path, capsys):
    _, table = _run({"demo": _demo()}, ["demo"], tmp_path)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["name"] == "demo"
    assert line["ratio"] == 2.0
    assert line["met"] is True
    assert "demo thing vs baseline" in table
    assert "ratio 2.00x" in table
    assert "target met" in table
    latest = load_latest(str(tmp_path))
    assert latest["demo"]["ours_s"] == 1.0
    assert latest["demo"]["ratio"] == 2.0
    assert latest["demo"]["rows"] == [["ours", 1.0], ["baseline", 2.0]]
    md = (tmp_path / "PERF.md").read_text()
    assert "## Performance" in md
    assert "What demo measures." in md
    assert "python bench/run.py demo" in md
    assert "| ours | 1.000 |" in md


def test_missed_target_and_failed_check(tmp_path, capsys):
    done, table = _run({"demo": _demo(1.2)}, ["demo"], tmp_path)
    assert done["demo"]["met"] is False
    assert "target missed" in table
    done, _ = _run({"demo": _demo(2.0, {"within 2x of raw": False})}, ["demo"], tmp_path)
    assert done["demo"]["met"] is False
    assert "not met" in (tmp_path / "PERF.md").read_text()


def test_merge_keeps_other_entries_and_errors_keep_previous(tmp_path, capsys):
    def boom():
        raise ValueError("engine exploded")

    _run({"demo": _demo(), "other": _demo(3.0)}, ["demo", "other"], tmp_path)
    done, text = _run({"demo": boom, "other": _demo(4.0)}, ["demo", "other"], tmp_path)
    assert done["demo"] == {"error": "ValueError: engine exploded"}
    assert "demo failed" in text
    latest = load_latest(str(tmp_path))
    assert latest["demo"]["ratio"] == 2.0  # the failed run left the previous figures
    assert latest["other"]["ratio"] == 4.0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert {"name": "demo", "error": "ValueError: engine exploded"} in lines


def test_unknown_name_and_registry():
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all({"demo": _demo()}, ["nope"])
    assert list(bench_run.MODULES) == ["rollout", "weight_sync", "pipeline", "streaming", "peer", "packing", "learning",
                                       "faults", "lora", "tool", "cpu", "engine_core", "endpoint"]


def test_learning_counts_from_the_command_start_to_the_step_that_reached_the_target():
    """The learning benchmark's clock: start-up up to the first step's start, the target's time at
    the end of the step whose 10-step mean first reaches 0.8, the shutdown after the last step apart."""
    from bench import learning

    start = 1000.0
    rewards = [0.0] * 5 + [1.0] * 10 + [0.5] * 5  # the mean of steps 6-15 is 1.0; of steps 4-13 0.8
    rows = [{"time": start + 20.0 + i + 1, "e2e_time": 1.0, "task_reward": r} for i, r in enumerate(rewards)]
    s = learning.side(rows, wall=20.0 + len(rows) + 7.0, start=start)
    assert s["start_up"] == pytest.approx(20.0)
    assert (s["steps_to_target"], s["wall_to_target"]) == (13, pytest.approx(33.0))
    assert s["shutdown"] == pytest.approx(7.0)
    assert learning.reached([{**r, "task_reward": 0.7} for r in rows], start) == (None, None)


def test_the_learning_ratio_falls_back_to_the_peers_whole_run():
    """Both learning benchmarks' ratio: the peer's wall time to the target over ours; a peer that never
    gets there counts its whole run; ours never getting there gives no ratio."""
    from bench.learning import ratio_to_target

    assert ratio_to_target({"wall_to_target": 10.0}, {"wall_to_target": 25.0, "wall": 99.0}) == 2.5
    assert ratio_to_target({"wall_to_target": 10.0}, {"wall_to_target": None, "wall": 40.0}) == 4.0
    assert ratio_to_target({"wall_to_target": None}, {"wall_to_target": 5.0, "wall": 9.0}) is None


def test_the_learning_ceiling_is_vllms_own_time_over_our_steps_against_the_peer():
    """The most the learning ratio could be: the peer's time over vLLM's start plus our steps to the
    target at vLLM's own call time; none where ours never gets there."""
    from bench.engine_floor import least
    from bench.learning import ratio_to_target

    floor = {"start_s": 8.0, "call_s": 0.1}
    assert least(floor, 600) == pytest.approx(68.0)
    assert least(floor, None) is None
    assert ratio_to_target({"wall_to_target": least(floor, 600)}, {"wall_to_target": 170.0, "wall": 300.0}) == 2.5


def test_the_fault_campaign_counts_each_injected_kind_against_its_own_lines():
    """Each kind's draws against the run's lines that say that kind fired, whatever the order."""
    from bench.faults import campaign_checks, draw

    kinds = draw(20, seed=7)
    fired = {"full_disk_failures": kinds.count("disk-full"), "ooms_at_load": kinds.count("oom-at-load"),
             "ray_start_timeouts": kinds.count("ray-start-timeout"), "torn_passed_over": kinds.count("torn-checkpoint")}
    t = {"resumed": 20, "faults": 20, "steps_lost": 0, "steps_twice_in_metrics": 0, "failed_resumes": 0,
         "exit_code": 0, "steps_unlike_uninterrupted": 0, **fired}
    assert all(campaign_checks(t, kinds).values())
    assert not campaign_checks({**t, "torn_passed_over": 0}, kinds)["every injected fault fired"]

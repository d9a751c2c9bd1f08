"""The GPU acceptance suite's parts that run without a GPU (tests/gpu/acceptance.py): which layouts
a node runs, their settings (each a valid config that the dry run accepts on GPUs), the table it
prints, and the eval accuracy recomputed from the graded records.

    .venv/bin/python -m pytest tests/unit/test_gpu_acceptance_helpers.py -q
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import acceptance

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.rl.workers import placement, turns

pytestmark = pytest.mark.unit
CUDA = hardware.Platform("cuda", "nccl", "vllm")


def test_one_gpu_runs_the_tiny_preset_and_the_small_model_taking_turns():
    names = [c.name for c in acceptance.cases_for(1)]
    assert names == ["tiny_1gpu", "shared_1gpu_zero2"]
    assert all(c.shared for c in acceptance.cases_for(1))
    eight = {c.name for c in acceptance.cases_for(8)}
    assert {"zero2", "zero3", "two_engines_zero2", "tp2_zero3", "shared_tp2_zero2"} <= eight


@pytest.mark.parametrize("case", acceptance.CASES, ids=[c.name for c in acceptance.CASES])
def test_every_case_is_a_layout_the_gpu_run_accepts(case):
    cfg = load_config("tiny", case.overrides("/models/small", 2))
    a = parse_allocation(cfg.allocation_mode)
    a.check(cfg.n_nodes, cfg.n_gpus_per_node)
    assert (a.gen.dp, a.gen.tp, a.kind != "decoupled") == (case.engines, case.tp, case.shared)
    turns.check(cfg, CUDA)  # no setting a shared layout refuses
    assert case.used <= case.gpus
    layout = placement.on_nodes(a, CUDA, 1, case.used)
    assert layout.shared == case.shared
    assert cfg.actor.zero_stage == case.zero and cfg.exp_ctrl.total_train_steps == 2


def test_the_table_times_each_check_and_says_which_failed():
    t = acceptance.Table(header="node: 1 x H100")
    with t.check("a", "first") as info:
        info["detail"] = "gap 1e-3 | fine"
    with pytest.raises(AssertionError), t.check("a", "second"):
        raise AssertionError("gap 0.3\nmore lines")
    assert [(r.check, r.outcome, r.detail) for r in t.rows] == [("first", "ok", "gap 1e-3 | fine"),
                                                                 ("second", "FAILED", "gap 0.3")]
    lines = t.render().splitlines()
    assert lines[0] == "node: 1 x H100" and lines[1].startswith("| case | check | seconds |")
    assert lines[3].startswith("| a | first | 0.0 | ok | gap 1e-3 / fine |")


def test_the_eval_accuracy_comes_from_the_graded_greedy_records(tmp_path):
    recs = [{"mode": "greedy", "correct": c} for c in (True, False, False, True)]
    recs += [{"mode": "sample", "correct": True}] * 3
    f = tmp_path / "samples.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert acceptance.greedy_acc_from(f) == (50.0, 4)

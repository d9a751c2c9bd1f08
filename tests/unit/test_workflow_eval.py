"""In-training eval (rl/driver/validation.py): references from each row format and the `areal-kit eval`
grader it shares (reward/grading.py), when it runs, and its config checks."""

from __future__ import annotations

import pytest

from areal_kit.config.loader import load_config
from areal_kit.config.schema import ConfigError
from areal_kit.reward.grading import grade_completion, grade_row, references
from areal_kit.rl.driver.validation import Validator


def test_references_from_each_row_format():
    assert references({"solutions": ["The answer: \\boxed{\\frac12}.", "\\boxed{0.5}"]}) == ["\\frac12", "0.5"]
    assert references({"answer": "She pays 9 * 2 = 18.\n#### 1,018"}) == ["1018"]
    assert references({"answer": "7"}) == ["7"]
    assert references({"answer": None}) == []


def test_grade_row_is_the_eval_grader():
    row = {"solutions": ["\\boxed{4}", "\\boxed{-4}"]}
    assert grade_row("so x = \\boxed{-4}", row)
    assert not grade_row("so x = \\boxed{5}", row)
    assert grade_row("... #### 18", {"answer": "#### 18"})
    assert grade_completion("so \\boxed{1/2}", ["0.5"]) == ("1/2", True)
    assert grade_completion("no answer", ["0.5"]) == (None, False)


def test_due_every_n_steps_and_at_the_end():
    cfg, tiny = load_config("tiny", ["exp_ctrl.eval_every=3", "dataset.eval_size=8"]), load_config("tiny")
    rows = [{"id": "q"}]

    def due(cfg, rows):  # the validator of that config's exp_ctrl section
        return [s for s in range(1, 11) if Validator(cfg.exp_ctrl, cfg.ppo.gen, cfg.seed, rows, None, None, 10).due(s)]

    assert due(cfg, rows) == [3, 6, 9, 10]
    assert due(tiny, rows) == []
    assert due(cfg, []) == [], "no eval rows: never due"


@pytest.mark.parametrize("overrides, msg", [
    (["exp_ctrl.eval_every=2"], "needs an eval split; set dataset.eval_size"),
    (["exp_ctrl.eval_max_new_tokens=5"], "expected <= ppo.gen.max_new_tokens"),
    (["dataset.eval_size=-1"], "dataset.eval_size=-1"),
])
def test_eval_config_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config("tiny", overrides)


def test_dry_run_reports_the_held_out_split(capsys):
    from areal_kit.cli import main

    try:
        main(["train", "tiny", "--dry-run", "dataset.eval_size=200", "exp_ctrl.eval_every=5"])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert "dataset: 3000 prompts (built-in toy task; eval split 200 prompts held out); 93 steps per epoch" in out

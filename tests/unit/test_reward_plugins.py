"""Reward plug-ins (reward/plugins.py, reward/scoring.py): dotted paths, the process pool with a
per-sample timeout, failures counted by kind, format reward and non-stop penalty, and bad input
rejected in one line before training starts."""

from __future__ import annotations

import textwrap

import pytest

from areal_kit.config.schema import ConfigError, PPOConfig
from areal_kit.errors import UserError
from areal_kit.reward import plugins
from areal_kit.reward.scoring import RewardScorer, as_reward
from areal_kit.rl.algo.batch import shape_rewards, step_stats
from areal_kit.rl.sample import Sample

PLUGIN = textwrap.dedent("""
    import os, signal, time

    def exact(prompt, completion, sample):
        return {"reward": 1.0 if completion == sample["answer"] else 0.0, "length": len(completion)}

    def picky(prompt, completion, sample):
        if completion == "raise":
            raise ValueError("cannot score " + completion)
        if completion == "hang":
            time.sleep(60)
        if completion == "stuck":  # ignores the alarm, as C code would: the process is killed
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            time.sleep(60)
        if completion == "die":
            os._exit(3)
        if completion == "text":
            return "high"
        return 0.5
""")


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def _ppo(**kw):
    return PPOConfig(**{"reward_timeout_s": 1.0, "reward_workers": 2, **kw})


@pytest.mark.slow
def test_named_plugin_and_dotted_path_sum_with_builtins(plugin):
    r = RewardScorer(_ppo(reward_fns=["math", "mine", f"{plugin}:picky"], reward_plugins={"mine": f"{plugin}:exact"}))
    try:
        got = r.score([("p", "\\boxed{3}", {"answer": "\\boxed{3}"}), ("p", "x", {"answer": "3"})])
    finally:
        r.close()
    assert got[0] == (1.0 + 1.0 + 0.5, {"length": 9.0})
    assert got[1] == (0.0 + 0.0 + 0.5, {"length": 1.0})
    assert r.take_failures() == {}
    assert r.specs[1] == ("mine", f"{plugin}:exact")


@pytest.mark.slow
def test_failures_give_zero_and_are_counted_by_kind(plugin):
    r = RewardScorer(_ppo(reward_fns=["bad"], reward_plugins={"bad": f"{plugin}:picky"}))
    try:
        items = [("p", c, {}) for c in ("ok", "raise", "raise", "hang", "stuck", "die", "text", "ok")]
        got = [x[0] for x in r.score(items)]
        failures = r.take_failures()
        # the pool recovers: later calls still work after kills and deaths
        again = r.score([("p", "ok", {})])
    finally:
        r.close()
    assert got == [0.5, 0, 0, 0, 0, 0, 0, 0.5]
    assert again == [(0.5, {})]
    assert {k: n for k, (n, _) in failures.items()} == {
        "bad: ValueError": 2, "bad: timeout": 2, "bad: crash": 1, "bad: bad return": 1}
    assert failures["bad: ValueError"][1] == "bad: ValueError: cannot score raise"
    assert r.take_failures() == {}  # taken


def test_as_reward_shapes():
    assert as_reward(1) == (1.0, {})
    assert as_reward({"reward": 0.25, "fmt": 1, "note": "x"}) == (0.25, {"fmt": 1.0})
    for bad in (None, "1", True, float("nan"), {"score": 1.0}):
        with pytest.raises(ValueError):
            as_reward(bad)


@pytest.mark.parametrize("spec, expect", [
    ("no_such_pkg.rewards:score", "does not import (ModuleNotFoundError"),
    ("json:no_such_fn", "has no 'no_such_fn'"),
    ("json:__doc__", "not a function"),
    ("/nonexistent/r.py:score", "file /nonexistent/r.py not found"),
    ("nope", "unknown reward 'nope' in ppo.reward_fns; known rewards: calc, gsm8k, math, toy; or give"),
])
def test_bad_reward_specs_are_one_line_user_errors(spec, expect):
    with pytest.raises(UserError, match=expect.replace("(", r"\(")) as e:
        plugins.reward_specs(_ppo(reward_fns=[spec]))
    assert "\n" not in str(e.value)


def test_plugin_raising_at_import_is_reported(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('no config')\n")
    with pytest.raises(UserError, match=r"does not import \(RuntimeError: no config\)"):
        plugins.reward_specs(_ppo(reward_fns=[f"{tmp_path}/broken.py:f"]))


def test_config_fields_validated_and_file_paths_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    p = PPOConfig(reward_fns=["math", "r.py:score"], reward_plugins={"m": "sub/x.py:f"}, workflow="w.py:flow")
    assert p.reward_fns == ["math", f"{tmp_path}/r.py:score"]
    assert p.reward_plugins == {"m": f"{tmp_path}/sub/x.py:f"}
    assert p.workflow == f"{tmp_path}/w.py:flow"
    for kw, msg in [({"format_pattern": "(unclosed"}, "not a valid regex"),
                    ({"reward_timeout_s": 0}, "reward_timeout_s=0"),
                    ({"reward_workers": 0}, "reward_workers=0"),
                    ({"reward_plugins": {"m": "nocolon"}}, "expected name: pkg.module:function")]:
        with pytest.raises(ConfigError, match=msg):
            PPOConfig(**kw)


def _samples(task, no_eos, fmt=None):
    return [Sample(f"p{i // 2}", i // 2, [0], [1, 2], [0.0, 0.0], e, 0, t, format_reward=None if fmt is None else fmt[i])
            for i, (t, e) in enumerate(zip(task, no_eos))]


def test_format_reward_and_non_stop_penalty_in_shaping():
    ppo = PPOConfig(group_size=2, adv_norm=False, format_reward=0.5, non_stop_penalty=True,
                    non_stop_penalty_value=-1.0)
    ss = _samples([1.0, 0.0, 1.0, 1.0], [False, False, True, False], fmt=[0.5, 0.0, 0.5, 0.0])
    shaped = shape_rewards(ss, ppo)
    assert [s.final_reward for s in shaped.samples] == [1.5, 0.0, -1.0, 1.0]
    row = step_stats(shaped.samples, shaped, {})
    assert row["format_reward"] == 0.25
    assert row["task_reward"] == 0.75  # task_reward stays the verifier's
    off = PPOConfig(group_size=2, adv_norm=False)
    shaped = shape_rewards(_samples([1.0, 0.0], [True, False]), off)
    assert [s.final_reward for s in shaped.samples] == [1.0, 0.0]
    assert "format_reward" not in step_stats(shaped.samples, shaped, {})


def test_default_format_pattern_matches_r1_style_answers():
    import re

    pat = PPOConfig().format_pattern
    assert re.search(pat, "think...</think>\nSo the answer is $\\boxed{4}$", re.DOTALL)
    assert not re.search(pat, "\\boxed{4} without closing the thought", re.DOTALL)


@pytest.mark.slow
def test_train_rejects_bad_reward_path_before_any_worker(tmp_path, capsys):
    from areal_kit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "tiny", f"fileroot={tmp_path}", "ppo.reward_fns=[toy,no_such_pkg.mod:score]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1
    assert "no_such_pkg.mod:score" in err[0]
    assert "does not import" in err[0]
    import ray

    assert not ray.is_initialized()

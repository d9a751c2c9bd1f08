"""A run that cannot learn stops instead of burning hours: rewards that all fail, step after step,
end the run with exit 1 and one line naming the first error, with no checkpoint written during
the streak (a resume would only continue it). A real tiny run through the CLI, with a reward
plug-in that always raises.

    .venv/bin/python -m pytest tests/integration/test_cannot_learn.py
"""

import os
import re
import subprocess
import sys

from areal_kit import runlog

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_plugins.py")


def test_rewards_that_always_fail_stop_the_run_with_the_first_error(tmp_path):
    proc = subprocess.run(
        [EXE, "train", "tiny", f"fileroot={tmp_path}", "trial_name=broken", "tensorboard=false",
         "exp_ctrl.total_train_steps=8", "exp_ctrl.stop_after_failed_reward_steps=3", "ppo.reward_fns=[broken]",
         f"ppo.reward_plugins={{broken: {PLUGINS}:broken}}", "ppo.reward_workers=1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=900, check=False)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert err[-1].startswith("error: run tiny/broken failed: CannotLearn: every sample's reward failed in 3 steps"), \
        err[-1]
    assert "broken: ValueError: the grading service is down" in err[-1]
    p = runlog.run_paths(str(tmp_path), "tiny", "broken")
    rows = runlog.read_metrics(p.metrics_file)
    assert [r["global_step"] for r in rows] == [1, 2], "steps 1 and 2 trained; the third stopped the run"
    assert all(r["reward_failures"] == r["n_seqs"] for r in rows)
    # Global step 2 writes a recover checkpoint in a healthy run; not inside a failing streak.
    assert not os.path.isdir(p.recover_dir) or not os.listdir(p.recover_dir)


def test_a_loss_that_is_not_finite_stops_the_run_before_the_engines_take_the_weights(tmp_path):
    """actor.lr=1e30 blows the weights up; the first step whose loss or gradient is NaN stops the run."""
    proc = subprocess.run(
        [EXE, "train", "tiny", f"fileroot={tmp_path}", "trial_name=nan", "tensorboard=false",
         "exp_ctrl.total_train_steps=5", "actor.lr=1e30"],
        capture_output=True, text=True, cwd=tmp_path, timeout=900, check=False)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    # Step 2's forward can stay finite through the RMSNorms while its gradient is already NaN: the
    # run stops there, before that step's NaN weights reach the engines or a recover checkpoint.
    assert re.search(r"CannotLearn: the (loss|gradient norm) is nan at global step 2;", err[-1]), err[-1]
    p = runlog.run_paths(str(tmp_path), "tiny", "nan")
    assert not os.path.isdir(os.path.join(p.recover_dir, "globalstep2"))
    rows = runlog.read_metrics(p.metrics_file)
    assert [r["global_step"] for r in rows] == [1], \
        "the step with the NaN loss is not logged as a step"

"""A run that hangs does not wait forever: a real hang (an engine whose generate call blocks for an
hour in the middle of step 4) is caught by the watchdog within its bound, every worker's stacks are
written, and the run relaunches from its last recover checkpoint and finishes, each step logged once.

    .venv/bin/python -m pytest tests/integration/test_hang_relaunch.py
"""

import os
import subprocess
import sys
from pathlib import Path

from areal_kit import logs

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_plugins.py")
STEPS, PROMPTS = 6, 32  # the tiny preset's prompts per step: one engine runs 32 episodes a step


def test_a_hung_engine_is_named_dumped_and_the_run_resumes_to_the_end(tmp_path):
    marker = tmp_path / "hung"
    env = dict(os.environ, AREAL_TEST_HANG_MARKER=str(marker), AREAL_TEST_HANG_AFTER=str(3 * PROMPTS))
    proc = subprocess.run(
        [EXE, "train", "tiny", f"fileroot={tmp_path}", "trial_name=hang", "tensorboard=false",
         f"exp_ctrl.total_train_steps={STEPS}", "exp_ctrl.ckpt_freq_steps=1", f"ppo.workflow={PLUGINS}:stuck_once",
         "exp_ctrl.hang_factor=5", "exp_ctrl.hang_floor_s=20", "exp_ctrl.hang_first_s=300", "exp_ctrl.hang_warmup=2",
         "recover_retries=1"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the engine never hung: the test did not test anything"
    p = logs.run_paths(str(tmp_path), "tiny", "hang")
    log = Path(p.log_file).read_text()
    [hang] = [ln for ln in log.splitlines() if "Worker failure (" in ln]
    assert "rollout engine 0 ran generate for" in hang, hang
    assert "relaunching from the last recover checkpoint (retry 1/1)" in hang
    stacks = os.path.join(p.log_dir, "stacks")
    assert f"stacks of every worker in {stacks}" in hang
    assert "stuck_once" in Path(stacks, "rollout_engine_0.txt").read_text()
    assert os.path.exists(os.path.join(stacks, "trainer_rank_0.txt"))
    assert [r["global_step"] for r in logs.read_metrics(p.metrics_file)] == list(range(1, STEPS + 1))

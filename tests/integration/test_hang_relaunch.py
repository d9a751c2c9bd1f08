"""A run that hangs does not wait forever. Real hangs, each caught within its bound:
- an engine whose generate call blocks for an hour in the middle of step 4;
- a trainer rank that stops before step 4's first collective, its peer waiting inside it;
both caught by the watchdog, every worker's stacks written, the run relaunched from its last
recover checkpoint and finished, each step logged once;
- a reward that never returns: cut at ppo.reward_timeout_s by the reward pool, counted as one
failed sample (reward 0), and the run goes on without a relaunch.

    .venv/bin/python -m pytest tests/integration/test_hang_relaunch.py
"""

import os
import subprocess
import sys
from pathlib import Path

from areal_kit import runlog

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_plugins.py")
STEPS, PROMPTS = 6, 32  # the tiny preset's prompts per step: one engine runs 32 episodes a step
# Bounds that catch a hang in 20 s once two calls of a kind set the median.
WATCHDOG = ["exp_ctrl.hang_factor=5", "exp_ctrl.hang_floor_s=20", "exp_ctrl.hang_first_s=300",
            "exp_ctrl.hang_warmup=2", "recover_retries=1"]


def run(tmp_path, trial: str, args: list[str], **env) -> runlog.RunPaths:
    proc = subprocess.run(
        [EXE, "train", "tiny", f"fileroot={tmp_path}", f"trial_name={trial}", "tensorboard=false",
         f"exp_ctrl.total_train_steps={STEPS}", "exp_ctrl.ckpt_freq_steps=1", *args],
        capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, **env), timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = runlog.run_paths(str(tmp_path), "tiny", trial)
    assert [r["global_step"] for r in runlog.read_metrics(p.metrics_file)] == list(range(1, STEPS + 1))
    return p


def the_hang(p: runlog.RunPaths) -> str:
    """The one hang the run reported, checked for what every report says."""
    [hang] = [ln for ln in Path(p.log_file).read_text().splitlines() if "Worker failure (" in ln]
    assert "relaunching from the last recover checkpoint (retry 1/1)" in hang
    assert f"stacks of every worker in {os.path.join(p.log_dir, 'stacks')}" in hang
    assert "past its bound of 20s" in hang, hang
    return hang


def test_a_hung_engine_is_named_dumped_and_the_run_resumes_to_the_end(tmp_path):
    marker = tmp_path / "hung"
    p = run(tmp_path, "hang", [f"ppo.workflow={PLUGINS}:stuck_once", *WATCHDOG],
            AREAL_TEST_HANG_MARKER=str(marker), AREAL_TEST_HANG_AFTER=str(3 * PROMPTS))
    assert marker.exists(), "the engine never hung: the test did not test anything"
    assert "rollout engine 0 ran generate for" in the_hang(p)
    stacks = os.path.join(p.log_dir, "stacks")
    assert "stuck_once" in Path(stacks, "rollout_engine_0.txt").read_text()
    assert os.path.exists(os.path.join(stacks, "trainer_rank_0.txt"))


def test_a_trainer_rank_that_stops_entering_the_collective_is_caught(tmp_path):
    """Two ranks: rank 1 stops before step 4's first collective, rank 0 waits inside it (gloo's
    own timeout is hang_first_s, 300 s, far later). The watchdog names the train step; the stacks
    show where each rank was."""
    marker = tmp_path / "stalled"
    p = run(tmp_path, "stall", ["n_gpus_per_node=3", "allocation_mode=vllm.d1p1m1+d2p1m1", *WATCHDOG],
            AREAL_TEST_STALL=f"1:4:{marker}")
    assert marker.exists(), "rank 1 never stopped: the test did not test anything"
    assert "trainer rank 0, trainer rank 1 ran train_step for" in the_hang(p)
    stacks = os.path.join(p.log_dir, "stacks")
    assert "_test_stall" in Path(stacks, "trainer_rank_1.txt").read_text()
    assert "in allreduce" in Path(stacks, "trainer_rank_0.txt").read_text(), "rank 0 waits in the collective"


def test_a_reward_that_never_returns_costs_one_sample_not_the_run(tmp_path):
    """A reward is cut at ppo.reward_timeout_s in its own process (the pool replaces the process),
    so a hung reward never reaches the watchdog: the run finishes without a relaunch."""
    marker = tmp_path / "reward-hung"
    p = run(tmp_path, "reward", ["ppo.reward_fns=[toy,stuck]", f"ppo.reward_plugins={{stuck: {PLUGINS}:stuck_once_reward}}",
                                 "ppo.reward_timeout_s=3", *WATCHDOG], AREAL_TEST_REWARD_MARKER=str(marker))
    assert marker.exists(), "the reward never hung: the test did not test anything"
    rows = runlog.read_metrics(p.metrics_file)
    assert [r["reward_failures"] for r in rows] == [1] + [0] * (STEPS - 1)
    assert 3 <= rows[0]["reward_time"] < 3 + 15, "cut at its timeout, not waited for"
    log = Path(p.log_file).read_text()
    assert "Worker failure (" not in log
    [failure] = [ln for ln in log.splitlines() if "Reward failure (" in ln]
    assert "stuck" in failure

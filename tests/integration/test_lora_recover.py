"""A LoRA run (tiny_lora, synchronous) SIGKILLed while it writes its step-4 recover checkpoint
resumes from step 2 with the same metrics as the killed run; its checkpoints hold the adapter
and its optimizer state, not the base. Two launches of `areal-kit train` (~1 minute each here).

    .venv/bin/python -m pytest tests/integration/test_lora_recover.py -v
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_kit import runlog
from bench.faults import kill_session

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
# The tiny preset's model as the base: resuming needs no prior, and it skips building the preset's.
ARGS = ["exp_ctrl.total_train_steps=4", "exp_ctrl.ckpt_freq_secs=0", "exp_ctrl.ckpt_freq_steps=2",
        "ppo.max_head_offpolicyness=0", "exp_ctrl.save_freq_epochs=0", "actor.path=tiny://toy"]
LOSS_TOL = 1e-7  # as tests/integration/test_recover_tiny.py: float32 summation-order noise at most


def _start(root, pause: str = ""):
    env = {**os.environ, "AREAL_USER": "t"}
    env.pop("AREAL_TEST_PAUSE", None)
    if pause:
        env["AREAL_TEST_PAUSE"] = pause
    with open(root / "run.out", "ab") as out:
        return subprocess.Popen([EXE, "train", "tiny_lora", f"fileroot={root}", "trial_name=kill", *ARGS], cwd=root,
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _rows(p):
    return [json.loads(line) for line in Path(p.metrics_file).read_text().splitlines()]


def test_a_killed_lora_run_resumes_with_identical_metrics(tmp_path):
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    p = runlog.run_paths(str(tmp_path), "tiny_lora", "kill", "t")
    proc = _start(tmp_path, "before_commit:4")
    try:
        marker = os.path.join(p.log_dir, "PAUSED-before_commit-4")
        deadline = time.time() + 900
        while not os.path.exists(marker):
            assert proc.poll() is None, (tmp_path / "run.out").read_text()[-2000:]
            assert time.time() < deadline, "the run never reached its step-4 checkpoint"
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        kill_session(proc.pid)
    killed = {r["global_step"]: r for r in _rows(p)}
    assert sorted(killed) == [1, 2, 3, 4]

    # The checkpoint holds the adapter and its AdamW state, no base weight but the tied LM head:
    # DeepSpeed leaves frozen parameters out by name, and a tied head is the embedding's second name.
    states = glob.glob(os.path.join(p.recover_dir, "globalstep2", "**", "*model_states.pt"), recursive=True)
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    base = [k for k in module if ".lora_" not in k]
    assert base == ["base_model.model.lm_head.weight"], base
    assert sum(".lora_" in k for k in module) == 2 * 7 * 2  # A and B of 7 linear layers x 2 blocks

    proc = _start(tmp_path)
    try:
        assert proc.wait(timeout=1200) == 0, (tmp_path / "run.out").read_text()[-2000:]
    finally:
        kill_session(proc.pid)
    log = Path(p.log_file).read_text()
    assert f"Will recover from: {p.recover_dir}/globalstep2 (global step 2" in log
    after = _rows(p)
    assert [r["global_step"] for r in after] == [1, 2, 3, 4]
    for r in after[2:]:
        ref = killed[r["global_step"]]
        assert r["task_reward"] == ref["task_reward"], r["global_step"]
        assert abs(r["actor_loss"] - ref["actor_loss"]) <= LOSS_TOL, (r["global_step"], r["actor_loss"], ref["actor_loss"])
        assert r["avg_seq_len"] == ref["avg_seq_len"]

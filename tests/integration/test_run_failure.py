"""Runs that fail after they started: the real vLLM engine refuses to start (its KV cache asks for
more memory than the machine has), through the installed command, for train and for eval.

The user must get one line naming where it failed and vLLM's own reason, exit code 1 and no
traceback on the terminal; the traceback must be in the run's log (train.log, OUT/error.log), and
`areal-kit logs` must say failed.

    .venv/bin/python -m pytest tests/integration/test_run_failure.py
"""

import json
import os
import subprocess
import sys
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
    assert "VLLM_CPU_KVCACHE_SPACE" in lines[0] and lines[0].endswith(f"(traceback in {run / 'train.log'})")

    log = (run / "train.log").read_text()
    assert " ERROR Run failed: RolloutWorker.setup: ValueError: " in log
    assert "Traceback (most recent call last):" in log and "determine_available_memory" in log

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
    assert len(errors) == 1 and errors[0].startswith("error: eval failed: ValueError: "), proc.stderr[-2000:]
    assert "VLLM_CPU_KVCACHE_SPACE" in errors[0] and errors[0].endswith(f"(traceback in {out}/error.log)")
    assert "determine_available_memory" in (out / "error.log").read_text()

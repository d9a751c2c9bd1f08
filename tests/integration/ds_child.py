"""One DeepSpeed rank in a child process, for tests that need a fresh process group: `run(code, tmp_path)`
runs `code` with the model folder `tmp_path/tiny` as its argument and returns the JSON it prints after
`RESULT ` (a plain module: conftest.py names clash across folders)."""

import json
import os
import subprocess
import sys

from areal_kit.hardware import free_port


def run(code: str, tmp_path) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "tiny")], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])

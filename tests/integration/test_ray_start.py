"""A run without ray_address starts a Ray of its own, even where another is up on the machine.

Run: pytest tests/integration/test_ray_start.py (about 20 s: a `ray start` head, then a driver's start).
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRIVER = ("import ray; from areal_kit.config.loader import load_config; "
          "from areal_kit.rl.driver.raystart import start_ray; "
          "start_ray(load_config('tiny', [])); print(ray.get_runtime_context().gcs_address)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_starts_its_own_ray_beside_one_that_ray_start_left():
    """`ray start` (another user's cluster, another test's) records its address on the machine, and
    Ray's default joins it, where the run's own CPU count is refused. The run's Ray is its own, as
    ray_address="" says. RAY_TMPDIR keeps both in a folder of this test's own (short: Ray's sockets
    live there), so no other test's Ray sees this head."""
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={_free_port()}", "--num-cpus=1", "--include-dashboard=false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recorded = Path(tmp, "ray", "ray_current_cluster")
    try:
        deadline = time.monotonic() + 120
        while not recorded.exists():
            assert head.poll() is None and time.monotonic() < deadline, "ray start never recorded its address"
            time.sleep(0.2)
        r = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300,
                           check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        own = r.stdout.strip().splitlines()[-1]
        assert own and own != recorded.read_text().strip(), (own, recorded.read_text())
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

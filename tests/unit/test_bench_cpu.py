"""bench/cpu.py's sampler: a process started below the sampled one is found, and its CPU-seconds
go to the role its command line names (real processes, a second of busy loop).

    .venv/bin/python -m pytest tests/unit/test_bench_cpu.py
"""

import subprocess
import sys
import time

import pytest

from bench.cpu import Sampler

pytestmark = pytest.mark.unit

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"


def test_a_grandchilds_cpu_goes_to_the_role_its_command_line_names():
    t0 = time.time()
    # The shell is the sampled root (the driver's place); the busy child is named as Ray names a
    # trainer actor's process, and starts after the sampler does.
    root = subprocess.Popen(["sh", "-c", f'sleep 0.5; "{sys.executable}" -c "$0" ray::TrainerWorker; sleep 0.5', BUSY])
    sampler = Sampler(root.pid, every_s=0.05)
    root.wait(timeout=30)
    t1 = time.time()
    sampler.stop()
    used = sampler.by_role(t0, t1)
    assert 0.8 <= used["trainer"] <= 1.5, used
    assert used["rollout engine"] == 0 and used["driver"] < 0.2, used

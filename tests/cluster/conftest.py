"""Fixtures for the cluster tests: the 3-node testbed (testbed.py), the CPU image (image.py),
and a helper that runs `areal-kit` as a user would, as a subprocess. The Slurm tests bring up
their own Slurm on the testbed (slurm.py).

Needs root and .ci/cluster_deps.sh's packages. Without them the tests skip, except when
CI or AREAL_REQUIRE_CLUSTER_TESTS is set: then a missing prerequisite is an error, so a CI
machine can never silently skip them.

    sudo .venv/bin/pytest tests/cluster -x -m "not long"   # ~13 minutes on 2 cores; -m long: ~17 more
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from image import IMAGE_TAG, build
from kit import Kit
from testbed import Testbed

REQUIRED = bool(os.environ.get("CI") or os.environ.get("AREAL_REQUIRE_CLUSTER_TESTS"))
TOOLS = ("/usr/sbin/sshd", "/usr/sbin/dockerd", "/usr/sbin/debootstrap", "/usr/bin/nsenter")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "cluster tests need root (network namespaces, sshd, dockerd)"
    absent = [t for t in TOOLS if not os.path.exists(t)]
    if absent:
        return f"missing {', '.join(absent)}: run `bash .ci/cluster_deps.sh`"
    return None


@pytest.fixture(scope="session")
def testbed():
    why = _missing()
    if why:
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    tb = Testbed(3)
    tb.down()  # leftovers of an interrupted run
    t0 = time.monotonic()
    tb.up()
    for i in range(1, 4):
        tb.dockerd_up(i)
    tb.up_seconds = time.monotonic() - t0
    print(f"\n[testbed] 3 nodes with sshd + dockerd in {tb.up_seconds:.1f}s", file=sys.stderr)
    yield tb
    tb.down()


@pytest.fixture(scope="session")
def cpu_image(testbed):
    """areal-kit:cpu-test built from docker/Dockerfile (ACCELERATOR=cpu) on node1, saved on shared storage."""
    tar = testbed.storage / "images" / "areal-kit-cpu.tar"
    times = build(testbed.docker_sock(1), tar)
    # node1 built it, and node state survives between runs: remove it everywhere so every
    # node goes through `docker load` in setup.
    for i in (1, 2, 3):
        subprocess.run(["/usr/bin/docker", "rmi", "-f", IMAGE_TAG],
                       env=dict(os.environ, DOCKER_HOST=testbed.docker_sock(i)), capture_output=True, check=False)
    return IMAGE_TAG, tar, times


@pytest.fixture
def kit(testbed, tmp_path):
    return Kit(tmp_path / "kit-home", testbed)

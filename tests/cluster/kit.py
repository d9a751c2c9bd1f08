"""Helpers the cluster tests share: run areal-kit as a user would, setup arguments, output lines.

A plain module (not conftest.py): `from conftest import ...` is ambiguous when pytest collects
tests/ as a whole, since tests/conftest.py has the same module name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from image import IMAGE_TAG, venv_mounts
from testbed import Testbed


@dataclass
class Kit:
    """Runs areal-kit with a private state dir and known_hosts, like a user on a laptop."""

    home: Path
    tb: Testbed

    @property
    def known_hosts(self) -> Path:
        return self.home / "known_hosts"

    def conn_args(self, hosts: list[str] | None = None) -> list[str]:
        return ["--hostnames", ",".join(hosts or self.tb.ips), "--private_key_file", str(self.tb.key),
                "--known-hosts", str(self.known_hosts)]

    def run(self, *args: str, timeout: float = 600, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """areal-kit ARGS; `prefix` runs it under another command (e.g. nsenter into a namespace)."""
        env = dict(os.environ, AREAL_KIT_HOME=str(self.home), COLUMNS="200")
        t0 = time.monotonic()
        r = subprocess.run([*prefix, sys.executable, "-m", "areal_kit.cli", *args], capture_output=True, text=True,
                           env=env, timeout=timeout, check=False)
        r.seconds = time.monotonic() - t0
        print(f"\n$ areal-kit {' '.join(args)}  [{r.seconds:.1f}s rc={r.returncode}]\n{r.stdout[-6000:]}"
              f"{r.stderr[-3000:]}", file=sys.stderr)
        return r



def setup_args(tb: Testbed, runtime: str) -> list[str]:
    """Frugal settings for 2 shared cores: 1 CPU and a 100 MiB object store per Ray node."""
    venv, mounts = venv_mounts()
    args = ["--runtime", runtime, "--storage", str(tb.storage), "--python", f"{venv}/bin/python",
            "--num-cpus", "1", "--object-store-memory", "100m", "--no-dashboard", "--min-disk-gb", "1",
            "--min-shm-gb", "0.25", "--min-nofile", "10000",  # this sandbox's dockerd allows 20000
            "--ray-wait", "120"]
    if runtime == "docker":
        args += ["--image", IMAGE_TAG, "--image-tar", str(tb.storage / "images" / "areal-kit-cpu.tar"),
                 "--shm-size", "512m"]
        for m in mounts:
            args += ["--mount", m]
    return args


def lines(r: subprocess.CompletedProcess, status: str) -> list[str]:
    """Per-host event lines of one status: 'changed: [host] step: ...'."""
    return [ln for ln in r.stdout.splitlines() if ln.startswith(f"{status}: [")]

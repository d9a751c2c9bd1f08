"""`areal-kit view RUN --cluster NAME` over a real sshd: this machine is the cluster's one host (a
host-runtime head reached as root@127.0.0.1 on a private port, with its own host and user keys, as
setup saves a cluster), so the command connects through fabric as every cluster command does,
starts the viewer on the head, forwards a local port to it, the page answers on that port, and
Ctrl-C ends both. Skipped where there is no OpenSSH server or the test does not run as root (sshd
serves the user it runs as only when root)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from areal_kit import runlog
from areal_kit.cluster.options import SetupOptions, save_state
from areal_kit.cluster.target import Hosts

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(not os.path.exists(SSHD) or os.geteuid() != 0 or not shutil.which("ssh-keygen"),
                                reason="needs an OpenSSH server, ssh-keygen and root")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sshd(tmp_path):
    """An sshd on 127.0.0.1:PORT that lets in the user key it makes; yields (port, key file)."""
    d = tmp_path / "sshd"
    d.mkdir()
    for key in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "user.pub", d / "authorized_keys")
    port = _free_port()
    (d / "config").write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\nAuthorizedKeysFile "
                              f"{d / 'authorized_keys'}\nPasswordAuthentication no\nPermitRootLogin prohibit-password\n"
                              f"StrictModes no\nUsePAM no\nAllowTcpForwarding yes\nPidFile {d / 'pid'}\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation folder
    proc = subprocess.Popen([SSHD, "-D", "-f", str(d / "config"), "-E", str(d / "log")])
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield port, str(d / "user")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_page_of_a_clusters_run_through_its_ssh_route(sshd, tmp_path, kit_home):
    port, key = sshd
    # The head's python: this interpreter with this checkout's areal_kit (as the head's has its own).
    py = tmp_path / "python"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={os.pathsep.join(p for p in sys.path if p)} exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    opts = SetupOptions(spec=Hosts(hostnames=["127.0.0.1"], name="loc", storage=str(tmp_path / "storage"),
                                   username="root", ssh_port=port, private_key_file=key).spec(),
                        runtime="host", python=str(py))
    save_state(opts)
    log = runlog.RunLogger(runlog.run_paths(opts.spec.fileroot, "tiny", "run0", "ci"), tensorboard=False, console=False)
    for g in (1, 2, 3):
        log.step(g, {"task_reward": g / 10})
    log.close()
    home = tmp_path / "home"  # known_hosts: accept-new writes the test's sshd key here, not in the user's
    (home / ".ssh").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "areal_kit.cli", "view", "tiny/run0", "--cluster", "loc", "--user", "ci", "--port", "0"]
    bad = subprocess.run([*cmd[:4], "tiny/nosuch", *cmd[5:]], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no run tiny/nosuch" in bad.stderr, bad.stderr
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"\(its 127\.0\.0\.1:(\d+)\) at http://127\.0\.0\.1:(\d+)/", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        remote, local = int(m[1]), int(m[2])
        with urllib.request.urlopen(f"http://127.0.0.1:{local}/api/status", timeout=30) as r:
            st = json.loads(r.read())
        assert st["n_steps"] == 3 and st["log_dir"].endswith("logs/ci/tiny/run0")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        for _ in range(100):  # the session's end stops the head's viewer: its port closes
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", remote)) != 0:
                    break
            time.sleep(0.1)
        else:
            pytest.fail(f"the head's viewer still serves on {remote} after the page here stopped")
    finally:
        if proc.poll() is None:
            proc.kill()

"""A fake cluster on one machine for the cluster tests: N "hosts" with real sshd and dockerd.

Each node is a network namespace on a bridge (10.232.0.1/24 on the host side, node i at
10.232.0.(i+1), no default route: nodes reach only each other and the host), with its own
sshd (key auth, own host key) running as PID 1 of new UTS + PID + mount namespaces: its own
hostname, a private /run, /dev/shm, /tmp/ray and /var/lib/docker, so each node's dockerd and
Ray are separate, and `ray stop` on one node cannot kill another node's Ray. The rest of the
filesystem is shared, like NFS-mounted storage on a real cluster.

Why these choices (found the hard way on these machines):
- enter the namespace with `nsenter --net`, not `ip netns exec`, which remounts /sys and hides
  the cgroup mounts dockerd needs;
- a PID namespace per node, or `ray stop` on node 2 kills the Ray processes of node 1;
- dockerd with --iptables=false --bridge=none: containers use --network host anyway, and the
  host's firewall is left alone.

`jump_up()` adds a login node: a namespace on the same bridge whose sshd listens only on a
second link, to a controller namespace that has no other route. A controller there reaches the
nodes only through the login node (`ctl_cmd` prefixes a command to run there).

Needs root, openssh-server, docker.io, iproute2 (.ci/cluster_deps.sh). By hand:

    python tests/cluster/testbed.py up 3      # prints node addresses and the key
    python tests/cluster/testbed.py down 3
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASE = Path(os.environ.get("AK_TESTBED", "/tmp/areal-kit-testbed"))
NET = os.environ.get("AK_TESTBED_NET", "10.232.0")
BRIDGE = os.environ.get("AK_TESTBED_BRIDGE", "akbr0")
NS = os.environ.get("AK_TESTBED_NS", "ak")  # prefix of namespace and link names: two testbeds can coexist
JUMP_NET = os.environ.get("AK_TESTBED_JUMP_NET", "10.233.0")  # controller <-> login node only

# PID 1 of a node: hostname, private mounts, then sshd in the foreground.
NODE_INIT = """#!/bin/sh
set -e
name=$1; d=$2
hostname "$name"
mount -t tmpfs -o mode=755,size=256m tmpfs /run
mount -t tmpfs -o mode=1777,size=2g tmpfs /dev/shm
for p in /var/lib/docker /tmp/ray; do
  mkdir -p "$d/priv$p" "$p"
  mount --bind "$d/priv$p" "$p"
done
mkdir -p /run/sshd
exec /usr/sbin/sshd -D -f "$d/sshd_config" -E "$d/sshd.log"
"""

SSHD_CONFIG = """Port 22
ListenAddress {ip}
HostKey {d}/ssh_host_ed25519_key
PidFile {d}/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AuthorizedKeysFile {keys}/authorized_keys
MaxStartups 100:30:200
MaxSessions 50
Subsystem sftp internal-sftp
LogLevel ERROR
"""


def sh(cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], check=check, text=True, capture_output=True, **kw)


class Testbed:
    def __init__(self, n: int = 3, base: Path = BASE):
        self.n, self.base = n, base
        self.keys = base / "keys"
        self.key = self.keys / "id_ed25519"
        self.storage = base / "storage"

    # -- addresses ---------------------------------------------------------------------------
    def ip(self, i: int) -> str:
        return f"{NET}.{i + 1}"

    @property
    def ips(self) -> list[str]:
        return [self.ip(i) for i in range(1, self.n + 1)]

    def node_dir(self, i: int) -> Path:
        return self.base / "nodes" / f"node{i}"

    def docker_sock(self, i: int) -> str:
        return f"unix://{self.node_dir(i)}/docker.sock"

    # -- ssh into a node (plain OpenSSH client: independent of the code under test) ----------
    def ssh(self, i: int, cmd: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        args = ["ssh", "-q", "-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", f"root@{self.ip(i)}", cmd]
        r = subprocess.run(args, text=True, capture_output=True, timeout=timeout, check=False)
        if check and r.returncode:
            raise RuntimeError(f"node{i}: {cmd!r} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    # -- lifecycle ---------------------------------------------------------------------------
    def up(self) -> Testbed:
        t0 = time.monotonic()
        self.keys.mkdir(parents=True, exist_ok=True)
        self.keys.chmod(0o755)  # sshd reads authorized_keys for non-root users too
        self.storage.mkdir(parents=True, exist_ok=True)
        if not self.key.exists():
            sh(f"ssh-keygen -q -t ed25519 -N '' -f {self.key} -C areal-kit-testbed")
        shutil.copy(f"{self.key}.pub", self.keys / "authorized_keys")
        (self.keys / "authorized_keys").chmod(0o644)
        (self.base / "node_init.sh").write_text(NODE_INIT)
        Path("/run/sshd").mkdir(exist_ok=True)
        if sh(f"ip link show {BRIDGE}", check=False).returncode:
            sh(f"ip link add {BRIDGE} type bridge && ip addr add {NET}.1/24 dev {BRIDGE} && ip link set {BRIDGE} up")
        for i in range(1, self.n + 1):
            self._node_up(i)
        for i in range(1, self.n + 1):
            self.wait_ssh(i)
        print(f"testbed: {self.n} nodes with sshd in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return self

    def _node_up(self, i: int) -> None:
        ns, ip = f"{NS}-node{i}", self.ip(i)
        if sh(f"ip netns list | grep -qw {ns}", check=False).returncode:
            sh(f"ip netns add {ns} && ip link add {NS}v{i} type veth peer name eth0 netns {ns} && "
               f"ip link set {NS}v{i} master {BRIDGE} up && ip -n {ns} link set lo up && "
               f"ip -n {ns} addr add {ip}/24 dev eth0 && ip -n {ns} link set eth0 up")
        self._boot(ns, f"node{i}", self.node_dir(i), ip)

    def _boot(self, ns: str, name: str, d: Path, listen: str) -> None:
        """Start the node's PID 1 (own hostname and mounts, sshd on `listen`), once."""
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "ssh_host_ed25519_key").exists():
            sh(f"ssh-keygen -q -t ed25519 -N '' -f {d}/ssh_host_ed25519_key")
        (d / "sshd_config").write_text(SSHD_CONFIG.format(ip=listen, d=d, keys=self.keys))
        pidf = d / "node.pid"
        if pidf.exists() and sh(f"kill -0 {pidf.read_text().strip()}", check=False).returncode == 0:
            return
        # --kill-child: killing this host-side unshare kills the node's PID 1 and so the node.
        p = subprocess.Popen(["setsid", "nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--pid",
                              "--mount", "--fork", "--mount-proc", "--kill-child", "sh",
                              str(self.base / "node_init.sh"), name, str(d)],
                             stdin=subprocess.DEVNULL, stdout=open(d / "node.out", "w"),  # noqa: SIM115 - lives with the node
                             stderr=subprocess.STDOUT)
        pidf.write_text(str(p.pid))

    # -- a login node: the only host a controller in namespace ak-ctl can reach ---------------
    @property
    def jump_ip(self) -> str:
        return f"{JUMP_NET}.2"

    @staticmethod
    def ctl_cmd() -> list[str]:
        """Prefix that runs a command in the controller's namespace."""
        return ["nsenter", f"--net=/run/netns/{NS}-ctl"]

    def jump_up(self) -> None:
        if sh(f"ip netns list | grep -qw {NS}-jump", check=False).returncode:
            sh(f"ip netns add {NS}-jump && ip netns add {NS}-ctl && "
               f"ip link add {NS}vj type veth peer name eth0 netns {NS}-jump && ip link set {NS}vj master {BRIDGE} up && "
               f"ip -n {NS}-jump addr add {NET}.250/24 dev eth0 && ip -n {NS}-jump link set eth0 up && "
               f"ip -n {NS}-jump link set lo up && ip -n {NS}-ctl link set lo up && "
               f"ip -n {NS}-ctl link add eth0 type veth peer name eth1 netns {NS}-jump && "
               f"ip -n {NS}-ctl addr add {JUMP_NET}.1/24 dev eth0 && ip -n {NS}-ctl link set eth0 up && "
               f"ip -n {NS}-jump addr add {self.jump_ip}/24 dev eth1 && ip -n {NS}-jump link set eth1 up")
        self._boot(f"{NS}-jump", "login", self.base / "nodes" / "jump", self.jump_ip)
        end = time.monotonic() + 20
        while self.ctl_ssh(self.jump_ip, "true").returncode:
            if time.monotonic() > end:
                raise RuntimeError(f"login node: sshd not answering; see {self.base}/nodes/jump/sshd.log")
            time.sleep(0.2)

    def ctl_ssh(self, ip: str, cmd: str) -> subprocess.CompletedProcess:
        """Plain OpenSSH from the controller's namespace, straight to `ip` (no jump)."""
        args = [*self.ctl_cmd(), "ssh", "-q", "-i", str(self.key), "-o", "BatchMode=yes", "-o",
                "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=3",
                f"root@{ip}", cmd]
        return subprocess.run(args, text=True, capture_output=True, timeout=30, check=False)

    def jump_down(self) -> None:
        pidf = self.base / "nodes" / "jump" / "node.pid"
        if pidf.exists():
            sh(f"kill {pidf.read_text().strip()}", check=False)
            pidf.unlink()
        for _ in range(30):
            pids = sh(f"ip netns pids {NS}-jump", check=False).stdout.split()
            if not pids:
                break
            sh(f"kill -KILL {' '.join(pids)}", check=False)
            time.sleep(0.2)
        sh(f"ip netns del {NS}-jump; ip netns del {NS}-ctl; ip link del {NS}vj", check=False)

    def wait_ssh(self, i: int, timeout: float = 20) -> None:
        end = time.monotonic() + timeout
        while self.ssh(i, "true", check=False, timeout=10).returncode:
            if time.monotonic() > end:
                raise RuntimeError(f"node{i}: sshd not answering; see {self.node_dir(i)}/node.out, sshd.log")
            time.sleep(0.2)

    def dockerd_up(self, i: int) -> None:
        """Start the node's own dockerd (on a real host: the docker service). Idempotent."""
        d = self.node_dir(i)
        self.ssh(i, f"""
            docker info >/dev/null 2>&1 && exit 0
            setsid /usr/sbin/dockerd -H unix:///var/run/docker.sock -H unix://{d}/docker.sock \
              --storage-driver overlay2 --iptables=false --ip-masq=false --ip-forward=false --bridge=none \
              --cgroup-parent /{NS}-docker-node{i} </dev/null >{d}/dockerd.log 2>&1 &
            for t in $(seq 1 150); do docker info >/dev/null 2>&1 && exit 0; sleep 0.2; done
            echo "dockerd did not start"; tail -5 {d}/dockerd.log; exit 1""")

    def dockerd_down(self, i: int) -> None:
        self.ssh(i, "p=$(cat /var/run/docker.pid 2>/dev/null) || exit 0; kill $p; "
                    "for t in $(seq 1 100); do kill -0 $p 2>/dev/null || exit 0; sleep 0.2; done", check=False)

    def down(self) -> None:
        """Kill every process of every node (by PID, via the netns), delete namespaces and bridge."""
        self.jump_down()
        for i in range(1, self.n + 1):
            ns = f"{NS}-node{i}"
            if sh(f"ip netns list | grep -qw {ns}", check=False).returncode:
                continue
            self.dockerd_down(i)  # lets dockerd stop its containers and unmount its layers
            pidf = self.node_dir(i) / "node.pid"
            if pidf.exists():
                sh(f"kill {pidf.read_text().strip()}", check=False)
            for sig in ("TERM", "KILL"):
                pids = sh(f"ip netns pids {ns}", check=False).stdout.split()
                if pids:
                    sh(f"kill -{sig} {' '.join(pids)}", check=False)
                for _ in range(30):
                    if not sh(f"ip netns pids {ns}", check=False).stdout.strip():
                        break
                    time.sleep(0.2)
            sh(f"ip netns del {ns}; ip link del {NS}v{i}", check=False)
            pidf.unlink(missing_ok=True)
        sh(f"ip link show {BRIDGE} >/dev/null 2>&1 && ip link del {BRIDGE}", check=False)
        # dockerd's overlay mounts live in the node's (now gone) mount namespace; the layer
        # files remain under priv/ and are reused by the next run.


if __name__ == "__main__":
    what, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tb = Testbed(n)
    if what == "up":
        tb.up()
        for i in range(1, n + 1):
            tb.dockerd_up(i)
        print(" ".join(tb.ips), tb.key)
    else:
        tb.down()

"""A real Slurm on the testbed (testbed.py): slurmctld on node1, a slurmd on every node, munge.

Debian's slurm-wlm and munge packages, nothing built here. Each daemon runs inside its node
(through the node's sshd, so in its network, UTS, PID and mount namespaces: slurmd takes the
node's hostname as its node name, and /run is the node's own), with the testbed's slurm.conf
given by -f and SLURM_CONF (nothing under /etc/slurm is written). munged runs in every node
and on this machine with one key, its socket at /run/akmunge/munge.sock, which is private in a
node and does not touch a munged this machine may run already. Partitions:

- `ak`: node1-node3, the default;
- `one`: node1 alone (a partition too small for a 3-node run).

slurmctld starts with its state cleared (-c: no job of an earlier session comes back), and
cred_expire=10: a requeued job may start again 11 s after, not Slurm's default 121.

Needs root, slurm-wlm and munge (.ci/cluster_deps.sh). By hand, on a testbed that is up:

    python tests/cluster/slurm.py up      # prints the SLURM_CONF to export
    python tests/cluster/slurm.py down
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from testbed import Testbed, sh

SOCKET = "/run/akmunge/munge.sock"
PARTITION, SMALL = "ak", "one"

CONF = """ClusterName=aktest
SlurmctldHost=node1({head})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket},cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=120
MinJobAge=600
JobRequeue=1
{nodes}
PartitionName={part} Nodes=node[1-{n}] Default=YES MaxTime=INFINITE State=UP
PartitionName={small} Nodes=node1 MaxTime=INFINITE State=UP
"""


class Slurm:
    """slurmctld + slurmd + munged on a Testbed that is up; `env` is what a client needs."""

    def __init__(self, tb: Testbed):
        self.tb = tb
        self.dir = tb.base / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.key = self.dir / "munge" / "munge.key"

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def cmd(self, args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command on this machine (sinfo, squeue, scontrol, scancel)."""
        r = subprocess.run(["bash", "-c", args], env=self.env, text=True, capture_output=True, check=False,
                           timeout=60)
        if check and r.returncode:
            raise RuntimeError(f"{args!r} exited {r.returncode}: {r.stderr[-2000:]}")
        return r

    def up(self) -> Slurm:
        t0 = time.monotonic()
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        (self.dir / "spool").mkdir(exist_ok=True)
        self.key.parent.mkdir(exist_ok=True)
        if not self.key.exists():
            self.key.write_bytes(os.urandom(1024))
        sh(f"chown -R munge:munge {self.key.parent} && chmod 700 {self.key.parent} && chmod 400 {self.key}")
        n = self.tb.n
        nodes = "\n".join(f"NodeName=node{i} NodeAddr={self.tb.ip(i)} CPUs=2 RealMemory=4000 State=UNKNOWN"
                          for i in range(1, n + 1))
        self.conf.write_text(CONF.format(head=self.tb.ip(1), socket=SOCKET, d=self.dir, nodes=nodes, part=PARTITION,
                                         small=SMALL, n=n))
        sh(self._munged("host"))
        for i in range(1, n + 1):
            self.tb.ssh(i, self._munged(f"node{i}"))
        self.tb.ssh(1, f"pgrep -x slurmctld >/dev/null || slurmctld -f {self.conf} -c")
        for i in range(1, n + 1):
            self.tb.ssh(i, f"pgrep -x slurmd >/dev/null || slurmd -f {self.conf}")
        end = time.monotonic() + 60
        while True:
            idle = self.cmd(f"sinfo -h -p {PARTITION} -t idle -o %D", check=False).stdout.strip()
            if idle == str(n):
                break
            if time.monotonic() > end:
                raise RuntimeError(f"slurm: {idle or 0} of {n} nodes idle after 60 s; see {self.dir}/*.log")
            time.sleep(0.5)
        print(f"slurm: {n} nodes idle in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        return self

    def _munged(self, name: str) -> str:
        d = self.key.parent
        return (f"mkdir -p {os.path.dirname(SOCKET)} && chown munge:munge {os.path.dirname(SOCKET)} && "
                f"{{ [ -S {SOCKET} ] && munge -n -S {SOCKET} >/dev/null 2>&1 || "
                f"runuser -u munge -- munged -S {SOCKET} --key-file={self.key} --log-file={d}/munged-{name}.log "
                f"--seed-file={d}/munged-{name}.seed --pid-file={os.path.dirname(SOCKET)}/munged.pid; }}")

    def down(self) -> None:
        """Cancel every job, stop the daemons (the testbed's own down kills whatever is left)."""
        self.cmd("scancel --full -u root", check=False)
        for i in range(1, self.tb.n + 1):
            self.tb.ssh(i, "pkill -x slurmd; pkill -x slurmctld; pkill -x munged; true", check=False)
        pid = Path(os.path.dirname(SOCKET)) / "munged.pid"
        if pid.exists():
            sh(f"kill {shlex.quote(pid.read_text().strip())}", check=False)


if __name__ == "__main__":
    s = Slurm(Testbed(3))
    if sys.argv[1] == "up":
        s.up()
        print(f"export SLURM_CONF={s.conf}")
    else:
        s.down()

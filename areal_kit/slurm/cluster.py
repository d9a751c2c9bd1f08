"""What Slurm says, through its client commands (sinfo, scontrol, sbatch) on this machine:
a partition's nodes, whether a preset fits them, a job's state, areal-kit's jobs.

    python -m areal_kit.slurm.cluster [PARTITION]     # the partition's nodes as areal-kit reads them
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from areal_kit.errors import RunFailed, UserError

# A node Slurm can give a job now or soon; others (down, drained, failing) cannot run one.
USABLE = ("idle", "mixed", "allocated", "completing", "planned", "reserved")
COMMENT = "areal-kit:"  # the comment of areal-kit's jobs: the run's log folder follows


@dataclass
class Node:
    name: str
    state: str  # sinfo's long form, without the flags (*, ~, #, ...)
    cpus: int
    gpus: int  # from the node's generic resources (gres), 0 without GPUs

    @property
    def usable(self) -> bool:
        return self.state in USABLE


@dataclass
class Partition:
    name: str
    nodes: list[Node]

    @property
    def usable(self) -> list[Node]:
        return [n for n in self.nodes if n.usable]


def run(args: list[str], timeout: float = 60) -> str:
    """A Slurm command's stdout; its own error as RunFailed (one line), or UserError where it is absent."""
    if shutil.which(args[0]) is None:
        raise UserError(f"{args[0]} not found: --slurm needs Slurm's client commands (sbatch, sinfo, scontrol, srun) "
                        "on this machine, as a login node has them")
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{' '.join(args[:2])}: no answer from Slurm in {timeout:g} s") from None
    if r.returncode:
        raise RunFailed(f"{args[0]}: {_why(args[0], r.stderr or r.stdout) or f'exit code {r.returncode}'}")
    return r.stdout


def _why(cmd: str, said: str) -> str:
    """A failed command's reason in one line: its fatal line where it has one (an unconfigured
    client says several errors first, each a step of its search for a controller), else all it said."""
    lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "fatal:" in ln]
    return (fatal[-1] if fatal else " ".join(" ".join(lines).split())).removeprefix(f"{cmd}: ")


def gpus_of(gres: str) -> int:
    """GPUs in a sinfo %G field: 'gpu:4', 'gpu:a100:8(S:0-1)', 'gpu:2,shard:8' or '(null)'."""
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
    return total


def partition(name: str | None) -> Partition:
    """The named partition, or Slurm's default one; UserError (naming the ones there are) if absent."""
    out = run(["sinfo", "-h", "-N", "-o", "%P|%N|%T|%c|%G"])
    rows = [ln.split("|") for ln in out.splitlines() if ln.count("|") == 4]
    names = {p.rstrip("*") for p, *_ in rows}
    default = next((p.rstrip("*") for p, *_ in rows if p.endswith("*")), None)
    want = name or default
    if want is None:
        raise UserError(f"Slurm has no default partition; expected --partition, one of {', '.join(sorted(names))}")
    if want not in names:
        raise UserError(f"--partition {want}: Slurm has no such partition; expected one of "
                        f"{', '.join(sorted(names)) or '(none)'}")
    nodes = [Node(n, re.sub(r"[^a-z_]", "", state), int(cpus), gpus_of(gres))
             for p, n, state, cpus, gres in rows if p.rstrip("*") == want]
    return Partition(want, nodes)


def refusal(part: Partition, what: str, n_nodes: int, gpus_per_node: int) -> str | None:
    """Why `what` (a preset's n_nodes x gpus_per_node, 0: CPU) cannot run on the partition, or None."""
    if len(part.nodes) < n_nodes:
        return (f"partition {part.name} has {len(part.nodes)} node(s), {what} needs {n_nodes} (n_nodes); expected a "
                f"partition with {n_nodes} or more, or n_nodes={len(part.nodes)} with an allocation_mode that fits")
    if gpus_per_node:
        fit = [n for n in part.nodes if n.gpus >= gpus_per_node]
        if len(fit) < n_nodes:
            most = max((n.gpus for n in part.nodes), default=0)
            return (f"partition {part.name} has {len(fit)} node(s) with {gpus_per_node} GPUs, {what} needs {n_nodes} "
                    f"(its nodes have at most {most}); expected a GPU partition, or n_gpus_per_node={most} with an "
                    "allocation_mode that fits")
    usable = part.usable
    if len(usable) < n_nodes:
        down = ", ".join(f"{n.name} {n.state}" for n in part.nodes if not n.usable)
        return (f"partition {part.name} has {len(usable)} node(s) up, {what} needs {n_nodes} ({down}); expected them "
                "back (scontrol update nodename=... state=resume), or another partition")
    return None


@dataclass
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, ... ("" when Slurm no longer knows the job)
    elapsed: str = ""
    limit: str = ""
    nodes: str = ""  # the nodes it runs on, or why it waits
    restarts: int = 0
    comment: str = ""

    @property
    def active(self) -> bool:
        return self.state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING",
                              "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED")

    def line(self) -> str:
        state = self.state or "no longer known to Slurm"
        more = [f"elapsed {self.elapsed}" + (f" of {self.limit}" if self.limit not in ("", "UNLIMITED") else "")
                if self.elapsed else "", f"on {self.nodes}" if self.nodes else "",
                f"requeued {self.restarts}x" if self.restarts else ""]
        return f"slurm job {self.job_id}: {state}" + "".join(f", {m}" for m in more if m)


def _from_scontrol(line: str) -> tuple[JobState, str]:
    """A job of `scontrol show job -o` (one line a job), and the user it belongs to."""
    f = dict(re.findall(r"(\w+)=(\S*)", line))
    waits = f.get("Reason", "None")
    st = JobState(f.get("JobId", ""), f.get("JobState", ""), f.get("RunTime", ""), f.get("TimeLimit", ""),
                  f.get("NodeList", "") if f.get("JobState") != "PENDING" or waits == "None" else f"({waits})",
                  int(f.get("Restarts", "0") or 0), f.get("Comment", ""))
    return st, f.get("UserId", "").split("(")[0]


def job_state(job_id: str) -> JobState:
    """scontrol's view of a job (it keeps finished ones for MinJobAge); state "" once it is purged."""
    try:
        return _from_scontrol(run(["scontrol", "show", "job", "-o", job_id]))[0]
    except RunFailed:
        return JobState(job_id, "")


def jobs() -> list[JobState]:
    """areal-kit's jobs of this user that Slurm holds (pending, running, requeued): one scontrol call."""
    me = getpass.getuser()
    found = [_from_scontrol(ln) for ln in run(["scontrol", "show", "job", "-o"]).splitlines() if "JobId=" in ln]
    return [st for st, user in found if user == me and st.active and st.comment.startswith(COMMENT)]


def sbatch(script: str) -> str:
    """Submit the script file; the job id."""
    return run(["sbatch", "--parsable", script]).strip().split(";")[0]


if __name__ == "__main__":
    p = partition(sys.argv[1] if len(sys.argv) > 1 else None)
    for n in p.nodes:
        print(f"{p.name} {n.name} {n.state} cpus={n.cpus} gpus={n.gpus}")

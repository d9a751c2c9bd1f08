"""`areal-kit doctor --slurm`: a Slurm partition checked from the login node, and through srun on
every node of it: the nodes' state, their GPUs against a preset, the shared storage each one sees
and the Python that runs areal-kit there.

    areal-kit doctor --slurm --partition gpu --preset 1.5B_n4 --storage /storage
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import tempfile
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from areal_kit.errors import RunFailed
from areal_kit.findings import Finding
from areal_kit.slurm import cluster

if TYPE_CHECKING:
    from rich.console import Console

PROBE_WAIT_S = 120  # srun --immediate: how long the probe may wait for the partition's nodes
_PROBE = ('echo "AKNODE $SLURMD_NODENAME $(cat {token} 2>/dev/null || echo -) '
          '$({py} -c "import areal_kit, torch; print(torch.__version__)" 2>/dev/null || echo -)"')


@dataclass
class Report:
    partition: str
    nodes: dict[str, dict] = field(default_factory=dict)  # node -> state, cpus, gpus, storage, python
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def as_json(self) -> str:
        return json.dumps({"partition": self.partition, "ok": self.ok, "nodes": self.nodes,
                           "findings": [asdict(f) for f in self.findings]}, indent=1)


def check(partition: str | None, storage: str, python: str, preset: tuple[str, int, int] | None) -> Report:
    """preset: (name, n_nodes, GPUs per node; 0 on CPU) to hold the partition to, or None."""
    part = cluster.partition(partition)
    rep = Report(part.name, {n.name: {"state": n.state, "cpus": n.cpus, "gpus": n.gpus} for n in part.nodes})
    for n in part.nodes:
        if not n.usable:
            rep.findings.append(Finding(n.name, "state", n.state, "idle, mixed or allocated",
                                        f"see why (sinfo -R -n {n.name}), then scontrol update nodename={n.name} "
                                        "state=resume"))
    if preset is not None:
        name, n_nodes, gpus = preset
        gpus = gpus if any(n.gpus for n in part.nodes) else 0  # a partition without GPU gres runs on CPU
        for n in part.nodes:
            if gpus and n.gpus < gpus:
                rep.findings.append(Finding(n.name, "gpus", f"{n.gpus} GPU(s) in its gres", f"{gpus} ({name})",
                                            "a partition of GPU nodes (--partition), or gres.conf"))
        why = cluster.refusal(part, name, n_nodes, gpus)
        if why:
            rep.findings.append(Finding(f"partition {part.name}", "preset", why.split(";")[0], f"room for {name}",
                                        why.split("; expected ")[-1]))
    usable = [n.name for n in part.usable]
    if usable:
        _probe(rep, part.name, usable, storage, python)
    return rep


def _probe(rep: Report, partition: str, nodes: list[str], storage: str, python: str) -> None:
    """One srun task a node: does it see the token written here in storage, and import areal-kit?"""
    token = secrets.token_hex(8)
    try:
        fd, path = tempfile.mkstemp(prefix=".areal-kit-doctor-", dir=storage)
    except OSError as e:
        rep.findings.append(Finding("login node", "storage", f"cannot write in {storage} ({e.strerror})",
                                    "a writable shared folder", "--storage PATH on the shared storage"))
        return
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
        probe = _PROBE.format(token=shlex.quote(path), py=shlex.quote(python))
        out = cluster.run(["srun", f"--partition={partition}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
                           "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", f"--immediate={PROBE_WAIT_S}",
                           "--time=5", "bash", "-c", probe], timeout=PROBE_WAIT_S + 120)
    except RunFailed as e:
        rep.findings.append(Finding(f"partition {partition}", "srun", str(e), "a probe task on every node",
                                    "free nodes (squeue -p), or a partition you may run on"))
        return
    finally:
        os.unlink(path)
    seen = {p[1]: p[2:] for ln in out.splitlines() if (p := ln.split()) and p[0] == "AKNODE" and len(p) == 4}
    for node in nodes:
        got, torch = seen.get(node, ["-", "-"])
        rep.nodes[node].update(storage=got == token, python=torch if torch != "-" else None)
        if got != token:
            rep.findings.append(Finding(node, "storage", f"does not see {path}, written here", "the storage this "
                                        "machine has, at the same path", f"mount the shared storage at {storage} "
                                        "there (runs write logs and checkpoints on it)"))
        if torch == "-":
            rep.findings.append(Finding(node, "python", f"{python} cannot import areal_kit and torch there",
                                        "areal-kit's Python on every node", "--python PATH of an environment on "
                                        "shared storage, or --container"))


def print_report(rep: Report, console: Console) -> None:
    for node, facts in rep.nodes.items():
        py = facts.get("python")
        console.out(f"{node}: {facts['state']}, {facts['cpus']} CPUs, {facts['gpus']} GPUs"
                    + ("" if "storage" not in facts else f", storage {'shared' if facts['storage'] else 'NOT seen'}")
                    + ("" if "python" not in facts else f", torch {py}" if py else ", no areal-kit"))
    for f in rep.findings:
        console.out(f"FAIL {f.line()}")
    console.out(f"doctor --slurm {rep.partition}: " + ("every check passed" if rep.ok else
                                                         f"{len(rep.findings)} check(s) failed"))

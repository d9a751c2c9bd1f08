"""The network figures `areal-kit doctor` saves, and the dry run's weight-sync estimate made of them.

doctor (cluster/doctor.py) writes its report to $AREAL_KIT_HOME/clusters/<cluster>.doctor.json;
`areal-kit train PRESET --dry-run` (rl/plan.py) reads the newest one that measured links and
turns the model's size into seconds a step. Both sides read and write through this module, so
neither imports the other.

    areal-kit doctor
    areal-kit train 1.5B_n4 --dry-run | grep "weight sync estimate"
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from areal_kit.durable import replace_lines
from areal_kit.home import state_dir


def result_path(cluster_name: str) -> Path:
    return state_dir() / "clusters" / f"{cluster_name}.doctor.json"


def save(cluster_name: str, rep: dict) -> None:
    p = result_path(cluster_name)
    p.parent.mkdir(parents=True, exist_ok=True)
    replace_lines(p, [json.dumps(rep, indent=1)])


def latest() -> dict | None:
    """The newest doctor result on this machine with network figures (for the dry run's estimate)."""
    found = []
    for p in (state_dir() / "clusters").glob("*.doctor.json"):
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if (rep.get("network") or {}).get("links_gbps"):
            found.append(rep)
    return max(found, key=lambda r: r.get("time", 0), default=None)


def sync_estimate_line(model_bytes: int | None, rep: dict | None) -> str | None:
    """The dry run's weight-sync time a step, from the bandwidth doctor measured."""
    if rep is None:
        return None
    links = rep["network"]["links_gbps"]
    slowest, med = min(links.values()), statistics.median(links.values())
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rep.get("time", 0)))
    where = f"doctor of cluster {rep['cluster']} at {when}: links {slowest:.3g}-{max(links.values()):.3g} GB/s"
    if not model_bytes:
        return f"weight sync estimate: model size unknown here ({where})"
    return (f"weight sync estimate: {model_bytes / 1e9:.3g} GB a step, {model_bytes / (med * 1e9):.3g}s at the median "
            f"link, {model_bytes / (slowest * 1e9):.3g}s at the slowest ({where})")

"""Recover checkpoint folders on disk: durable writes, and which checkpoints are complete.

Used by rl/checkpoint/recover.py (writing, resuming) and monitor.py (`areal-kit logs`, which reads them
without importing the engine). A folder `globalstep{g}` with a readable state.json is complete:
it only gets that name by a rename after everything in it was fsynced.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from areal_kit.runlog import tail_lines

PREFIX = "globalstep"
TMP_PREFIX = ".tmp-"
STATE_FILE = "state.json"
FORMAT = 2  # 2: the driver's RNG state is a torch file, as the ranks' are


@dataclass(frozen=True)
class Checkpoint:
    path: str
    state: dict

    @property
    def global_step(self) -> int:
        return int(self.state["global_step"])


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def list_checkpoints(recover_dir: str) -> list[Checkpoint]:
    """Complete checkpoints, oldest first. Temporary folders and unreadable ones are skipped."""
    out: list[Checkpoint] = []
    if not os.path.isdir(recover_dir):
        return out
    for name in os.listdir(recover_dir):
        if not name.startswith(PREFIX) or not name[len(PREFIX):].isdigit():
            continue
        path = os.path.join(recover_dir, name)
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue  # not ours, or damaged after the fact: never resumed from
        out.append(Checkpoint(path, state))
    return sorted(out, key=lambda c: c.global_step)


def latest(recover_dir: str) -> Checkpoint | None:
    cks = list_checkpoints(recover_dir)
    return cks[-1] if cks else None


def remove_tmp(recover_dir: str) -> None:
    if os.path.isdir(recover_dir):
        for name in os.listdir(recover_dir):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(recover_dir, name), ignore_errors=True)


def last_metrics_row(path: str, global_step: int | None = None) -> dict | None:
    """The last row of metrics.jsonl (of global_step, if given), reading only the file's tail."""
    lines = tail_lines(path, 65536)
    for line in reversed(lines or []):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # torn last line, or a partial first one
        if isinstance(row, dict) and (global_step is None or row.get("global_step") == global_step):
            return row
    return None

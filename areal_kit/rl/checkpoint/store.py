"""Recover checkpoint folders on disk: durable writes, which checkpoints are complete, and the
ones a fresh start set aside.

Used by rl/driver/recover.py (writing, resuming) and monitor.py (`areal-kit logs`, which reads them
without importing the engine). A folder `globalstep{g}` with a readable state.json is complete:
it only gets that name by a rename after everything in it was fsynced. Its state.json lists each
file's size as written ("files"): one that is shorter or gone since (a disk that lost a write, a
copy cut short) makes the checkpoint torn, and `latest` passes over it to the newest whole one;
recover.write keeps the one before the newest for that (two checkpoints on disk, not one).

A start over (--fresh, recover_mode=fault's first launch) deletes nothing: it moves the
checkpoints into `set-aside-{YYYYmmdd-HHMMSS}/` in the same folder, with a copy of the run's
metrics.jsonl and samples.jsonl of that moment (the new run rewrites them from global step 1).
Those names are not `globalstep{g}`, so no resume reads them; recover.write deletes all but the
newest once the new run has a checkpoint of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from areal_kit.durable import fsync_dir, fsync_tree
from areal_kit.runlog import tail_lines

PREFIX = "globalstep"
TMP_PREFIX = ".tmp-"
SET_ASIDE_PREFIX = "set-aside-"
TORN_PREFIX = "torn-"  # a torn checkpoint moved out of the way: a resume passed over it
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


def file_sizes(root: str) -> dict[str, int]:
    """Each file under root (but state.json), by its path relative to root: its size in bytes."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root)
            if rel != STATE_FILE:
                out[rel] = os.path.getsize(path)
    return out


def torn(ck: Checkpoint) -> str:
    """'' when every file the checkpoint's state.json lists is there at the size written (a
    checkpoint from before the list: assumed whole); else what is not, in a few words."""
    for rel, size in sorted(ck.state.get("files", {}).items()):
        try:
            now = os.path.getsize(os.path.join(ck.path, rel))
        except OSError:
            return f"{rel} is gone"
        if now != size:
            return f"{rel} has {now} bytes, {size} were written"
    return ""


def latest(recover_dir: str) -> Checkpoint | None:
    """The newest checkpoint that is complete and whole (see torn)."""
    for ck in reversed(list_checkpoints(recover_dir)):
        if not torn(ck):
            return ck
    return None


def torn_newer(recover_dir: str) -> list[tuple[Checkpoint, str]]:
    """The torn checkpoints newer than the latest whole one, newest first, each with what is torn."""
    out = []
    for ck in reversed(list_checkpoints(recover_dir)):
        why = torn(ck)
        if not why:
            break
        out.append((ck, why))
    return out


def move_torn(ck: Checkpoint) -> str:
    """Rename a torn checkpoint out of the resumable names (kept to look at; recover.write deletes
    it once the run has written past its step); its new path."""
    dest = os.path.join(os.path.dirname(ck.path), TORN_PREFIX + os.path.basename(ck.path))
    shutil.rmtree(dest, ignore_errors=True)  # an earlier torn one of the same step
    os.rename(ck.path, dest)
    fsync_dir(os.path.dirname(ck.path))
    return dest


def _named(recover_dir: str, prefix: str) -> list[str]:
    """The entries of recover_dir whose names start with prefix, sorted by name ([] without the folder)."""
    if not os.path.isdir(recover_dir):
        return []
    return sorted(n for n in os.listdir(recover_dir) if n.startswith(prefix))


def torn_folders(recover_dir: str) -> list[str]:
    return [os.path.join(recover_dir, n) for n in _named(recover_dir, TORN_PREFIX)]


def remove_tmp(recover_dir: str) -> None:
    for name in _named(recover_dir, TMP_PREFIX):
        shutil.rmtree(os.path.join(recover_dir, name), ignore_errors=True)


def set_aside(recover_dir: str, run_files: list[str]) -> str | None:
    """Move every complete checkpoint into a new set-aside folder, with a copy of each of
    run_files that exists; its path, or None where there was no checkpoint (nothing is made)."""
    cks = list_checkpoints(recover_dir)
    if not cks:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = os.path.join(recover_dir, f"{SET_ASIDE_PREFIX}{stamp}"), 1
    while os.path.exists(dest):  # two starts over within a second
        n += 1
        dest = os.path.join(recover_dir, f"{SET_ASIDE_PREFIX}{stamp}-{n}")
    os.makedirs(dest)
    for f in run_files:
        if os.path.exists(f):
            shutil.copy2(f, os.path.join(dest, os.path.basename(f)))
    fsync_tree(dest)
    for ck in cks:  # a rename within the folder: nothing is copied, nothing half-moved
        os.rename(ck.path, os.path.join(dest, os.path.basename(ck.path)))
    fsync_dir(dest)
    fsync_dir(recover_dir)
    return dest


def set_asides(recover_dir: str) -> list[str]:
    """The set-aside folders, oldest first (their names sort by the time they were made)."""
    stamp = len(SET_ASIDE_PREFIX) + len("YYYYmmdd-HHMMSS")
    names = sorted(_named(recover_dir, SET_ASIDE_PREFIX),
                   key=lambda n: (n[:stamp], len(n), n))  # a second one of the same second, "-2", after it
    return [os.path.join(recover_dir, n) for n in names]


def prune_set_asides(recover_dir: str, keep: int) -> list[str]:
    """Delete all set-aside folders but the newest `keep`; the ones deleted."""
    old = set_asides(recover_dir)
    gone = old[:max(len(old) - keep, 0)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


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

"""Writes that survive a crash: what is written is on disk (fsynced) before the call returns.

Every file areal-kit relies on after a crash goes through here: recover checkpoints (a folder
fsynced file by file, then renamed), metrics.jsonl when a resume rewrites it, eval's graded
samples appended chunk by chunk. A rename is only durable once its folder is fsynced too.

    append_lines(path, [json.dumps(r) + "\\n" for r in rows])
    replace_lines(path, lines)            # a temporary file, fsynced, renamed over path
    replace_bytes(path, data)             # the same, of bytes
    fsync_tree(tmp); os.replace(tmp, final); fsync_dir(parent)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

AnyPath = str | os.PathLike[str]  # a str or a pathlib.Path


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file, then every folder bottom-up (a rename is only durable once its folder is)."""
    for d, _, files in os.walk(root, topdown=False):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(d)


def _write(path: AnyPath, mode: str, lines: Iterable[str]) -> None:
    with open(path, mode, encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def append_lines(path: AnyPath, lines: Iterable[str]) -> None:
    _write(path, "a", lines)


def replace_lines(path: AnyPath, lines: Iterable[str]) -> None:
    """path holds exactly lines, or (after a crash) what it held before: never a mix."""
    replace_bytes(path, "".join(lines).encode("utf-8"))


def replace_bytes(path: AnyPath, data: bytes) -> None:
    """path holds exactly data, or (after a crash) what it held before: never a mix."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_json(path: str) -> dict | None:
    """What write_json wrote there; None where the file is missing or not whole JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, obj: dict) -> None:
    _write(path, "w", [json.dumps(obj, indent=1, sort_keys=True)])

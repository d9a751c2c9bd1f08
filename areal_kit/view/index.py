"""Where each step's rows of samples.jsonl lie, so that `areal-kit view` opens a step of a long run
with one seek: samples.index, appended to by the run as it dumps (and by this reader for rows it
scanned), kept beside the file, extended from where it stopped, and read again when the file was
rewritten or cut (a resume drops the steps after its checkpoint). view/metrics.py does the same
for metrics.jsonl's columns.

    idx = SampleIndex(paths.samples_file, paths.samples_index_file); idx.update()
    rows, bad = idx.rows(12)          # the rows of global step 12 (bad: lines that did not parse)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from areal_kit.runlog import INDEX_RECORD

_STEP = re.compile(rb'\{"global_step": (-?\d+)')
_CHUNK = 1 << 24  # bytes read at a time when scanning
_PREFIX = 24  # the first bytes of a line that tell its step: {"global_step": N, up to 7 digits


class Entry(NamedTuple):
    step: int
    offset: int  # of the step's first row in samples.jsonl
    length: int  # bytes of its rows
    rows: int  # how many


def inode_size(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size


class SampleIndex:
    """Each dumped step's place in samples.jsonl, read from samples.index (which the run appends to
    as it writes) and extended by scanning what the file has past it; the file itself is never read
    whole after the first scan."""

    def __init__(self, samples_file: str, index_file: str):
        self.samples_file, self.index_file = samples_file, index_file
        self.end = 0  # bytes of samples.jsonl covered by the entries (each whole line)
        self.torn = False  # the file ends in a line without its newline (a write cut short, or one under way)
        self.writable = True  # False when samples.index cannot be written (a read-only folder): kept in memory
        self._ino: int | None = None
        self.scanned_bytes = 0  # read by scans (not from the index): the cost of a missing index
        self._clear()

    def _clear(self) -> None:
        # The records as one array (100,000 Entry tuples would cost the open ~0.3 s), and each step's row
        # in it (a step recorded twice: the later record)
        self._recs = np.zeros((0, 4), dtype=np.int64)
        self._row: dict[int, int] = {}
        self._sorted: list[int] | None = None

    def __len__(self) -> int:
        return len(self._row)

    @property
    def steps(self) -> list[int]:
        if self._sorted is None:
            self._sorted = sorted(self._row)
        return self._sorted

    @property
    def by_step(self) -> dict[int, Entry]:
        return {g: Entry._make(self._recs[i].tolist()) for g, i in sorted(self._row.items())}

    def entry(self, step: int) -> Entry | None:
        i = self._row.get(step)
        return None if i is None else Entry._make(self._recs[i].tolist())

    def _add(self, recs: np.ndarray) -> None:
        n0 = len(self._recs)
        self._recs = np.concatenate((self._recs, recs)) if n0 else recs
        self._row.update(zip(recs[:, 0].tolist(), range(n0, n0 + len(recs))))
        self._sorted = None

    def update(self) -> bool:
        """Take in what was written since the last call; True when steps were added or the file changed."""
        got = inode_size(self.samples_file)
        if got is None:
            changed = bool(self._row)
            self.end, self._ino, self.torn = 0, None, False
            self._clear()
            return changed
        ino, size = got
        changed = False
        if ino != self._ino or size < self.end:  # a new or rewritten file: start from the index on disk
            self.end, self._ino, changed = 0, ino, True
            self._clear()
            self._load_index(size)
        if size > self.end:
            changed = self._scan(size) or changed
        return changed

    def _load_index(self, size: int) -> None:
        try:
            with open(self.index_file, "rb") as f:
                data = f.read()
        except OSError:
            return
        n = len(data) // INDEX_RECORD.size  # a torn last record is left out
        recs = np.frombuffer(data[:n * INDEX_RECORD.size], dtype="<i8").reshape(n, 4).astype(np.int64)
        if n == 0 or not self._agrees(recs, size):
            self._drop_index()
            return
        self._add(recs)
        self.end = int((recs[:, 1] + recs[:, 2]).max())

    def _agrees(self, recs: np.ndarray, size: int) -> bool:
        """The index's records cover the file from its start, one after another (a record written
        twice, by the run and by a reader, counts once), and its first and last point at rows of
        their step: else it is of another file (a resume rewrote it) and the file is scanned again."""
        by_offset = recs[np.argsort(recs[:, 1], kind="stable")]
        by_offset = by_offset[np.concatenate(([True], by_offset[1:, 1] != by_offset[:-1, 1]))]
        if by_offset[0, 1] != 0 or np.any(by_offset[1:, 1] != by_offset[:-1, 1] + by_offset[:-1, 2]):
            return False
        with open(self.samples_file, "rb") as f:
            for step, offset, length, _ in (recs[0].tolist(), recs[-1].tolist()):
                if offset + length > size:
                    return False
                f.seek(offset)
                m = _STEP.match(f.read(40))
                if not m or int(m[1]) != step:
                    return False
        return True

    def _drop_index(self) -> None:
        try:
            os.remove(self.index_file)
        except FileNotFoundError:
            pass
        except OSError:
            self.writable = False

    def _scan(self, size: int) -> bool:
        """Index the whole lines from self.end on. A step's rows are contiguous (one dump each): the
        lines are grouped by their first bytes, compared in bulk, and only each group's first line
        is read for its step; a line that does not start as a row (garbled) stays with the step before."""
        new: list[list[int]] = []  # [step, offset, length, count]
        pos, rest = self.end, b""
        with open(self.samples_file, "rb") as f:
            f.seek(pos)
            while (want := size - pos - len(rest)) > 0:
                chunk = f.read(min(_CHUNK, want))
                if not chunk:
                    break
                self.scanned_bytes += len(chunk)
                buf = rest + chunk
                cut = buf.rfind(b"\n") + 1
                if cut:
                    self._groups(buf[:cut], pos, new)
                    pos += cut
                rest = buf[cut:]
        self.torn = bool(rest)
        self.end = pos
        if not new:
            return False
        entries = [Entry(*e) for e in new]
        self._add(np.array(new, dtype=np.int64).reshape(-1, 4))
        self._append_index(entries)
        return True

    def _groups(self, buf: bytes, base: int, out: list[list[int]]) -> None:
        """The steps of buf's lines (buf ends with a newline; base: its offset in the file), into out."""
        arr = np.frombuffer(buf, dtype=np.uint8)
        ends = np.flatnonzero(arr == 10) + 1  # each line's end (past its newline)
        starts = np.concatenate(([0], ends[:-1]))
        pre = arr[np.minimum(starts[:, None] + np.arange(_PREFIX), len(arr) - 1)]
        first = np.concatenate(([0], np.flatnonzero(np.any(pre[1:] != pre[:-1], axis=1)) + 1))
        last = np.concatenate((first[1:], [len(starts)]))
        for i, j in zip(first.tolist(), last.tolist()):
            m = _STEP.match(buf, int(starts[i]))
            step = int(m[1]) if m else (out[-1][0] if out else None)
            length = int(ends[j - 1] - starts[i])
            if step is None:  # garbled lines before any row: not a step's
                continue
            if out and out[-1][0] == step and out[-1][1] + out[-1][2] == base + int(starts[i]):
                out[-1][2] += length
                out[-1][3] += j - i
            else:
                out.append([step, base + int(starts[i]), length, j - i])

    def _append_index(self, entries: list[Entry]) -> None:
        if not self.writable:
            return
        try:
            with open(self.index_file, "ab") as f:
                f.write(b"".join(INDEX_RECORD.pack(e.step, e.offset, e.length, e.rows) for e in entries))
        except OSError:
            self.writable = False

    def rows(self, step: int) -> tuple[list[dict], int]:
        """The rows of one step, and how many of its lines did not parse (a line cut mid-write)."""
        e = self.entry(step)
        if e is None:
            return [], 0
        with open(self.samples_file, "rb") as f:
            f.seek(e.offset)
            data = f.read(e.length)
        out, bad, other = json_rows(data, lambda row: row.get("global_step") == step)
        return out, bad + other


def json_rows(data: bytes, keep: Callable[[dict], bool]) -> tuple[list[dict], int, int]:
    """The JSON objects of data's lines that keep() accepts; how many lines were not JSON (a line
    cut mid-write); how many were JSON that keep() refused."""
    rows, bad, refused = [], 0, 0
    for line in data.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict) and keep(row):
            rows.append(row)
        else:
            refused += 1
    return rows, bad, refused

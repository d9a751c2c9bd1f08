"""What `areal-kit view` keeps of a run's files so that a long run opens fast: where each step's
rows of samples.jsonl lie (samples.index) and the metrics' columns (metrics.view.npz). Both are
kept beside the files they index, extended from where they stopped, and rebuilt when the file was
rewritten (a resume rewrites metrics.jsonl and samples.jsonl without the steps after its checkpoint).

    idx = SampleIndex(paths.samples_file, paths.samples_index_file); idx.update()
    rows, bad = idx.rows(12)          # the rows of global step 12 (bad: lines that did not parse)
    table = MetricsTable(paths.metrics_file); table.update(); table.steps, table.cols["task_reward"]
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import NamedTuple, TypeGuard

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


def _inode(path: str) -> tuple[int, int] | None:
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
        self.by_step: dict[int, Entry] = {}
        self.end = 0  # bytes of samples.jsonl covered by the entries (each whole line)
        self.torn = False  # the file ends in a line without its newline (a write cut short, or one under way)
        self.writable = True  # False when samples.index cannot be written (a read-only folder): kept in memory
        self._ino: int | None = None
        self.scanned_bytes = 0  # read by scans (not from the index): the cost of a missing index

    @property
    def steps(self) -> list[int]:
        return sorted(self.by_step)

    def update(self) -> bool:
        """Take in what was written since the last call; True when steps were added or the file changed."""
        got = _inode(self.samples_file)
        if got is None:
            changed = bool(self.by_step)
            self.by_step, self.end, self._ino, self.torn = {}, 0, None, False
            return changed
        ino, size = got
        changed = False
        if ino != self._ino or size < self.end:  # a new or rewritten file: start from the index on disk
            self.by_step, self.end, self._ino, changed = {}, 0, ino, True
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
        recs = np.frombuffer(data[:n * INDEX_RECORD.size], dtype="<i8").reshape(n, 4) if n else np.zeros((0, 4))
        if n == 0 or not self._agrees(recs, size):
            self._drop_index()
            return
        self.by_step = {int(r[0]): Entry(*map(int, r)) for r in recs.tolist()}
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
        for e in entries:
            self.by_step[e.step] = e
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
        e = self.by_step.get(step)
        if e is None:
            return [], 0
        with open(self.samples_file, "rb") as f:
            f.seek(e.offset)
            data = f.read(e.length)
        out, bad = [], 0
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict) and row.get("global_step") == step:
                out.append(row)
            else:
                bad += 1
        return out, bad


_CACHE_EVERY = 2000  # rows parsed since the cache was last written that make it worth writing again


class MetricsTable:
    """metrics.jsonl as numeric columns (numpy, NaN where a row lacks the key), one row per global
    step (a step logged twice: the later row), read from where the last read stopped; a cache beside
    the file (metrics.view.npz) spares a long run's reopening the parse of every row."""

    def __init__(self, metrics_file: str, cache_file: str = ""):
        self.path = metrics_file
        self.cache_file = cache_file or os.path.join(os.path.dirname(metrics_file), "metrics.view.npz")
        self._reset(None)

    def _reset(self, ino: int | None) -> None:
        self.steps = np.zeros(0, dtype=np.int64)
        self.times = np.zeros(0)
        self.cols: dict[str, np.ndarray] = {}
        self._row_of: dict[int, int] = {}
        self.end, self._ino, self.torn, self.bad, self._since_cache = 0, ino, False, 0, 0

    def update(self) -> bool:
        got = _inode(self.path)
        if got is None:
            changed = bool(len(self.steps))
            self._reset(None)
            return changed
        ino, size = got
        changed = False
        if ino != self._ino or size < self.end:
            self._reset(ino)
            self._load_cache(ino, size)
            changed = True
        if size > self.end:
            changed = self._read(size) or changed
        if self._since_cache >= _CACHE_EVERY:
            self.save_cache()
        return changed

    def _read(self, size: int) -> bool:
        with open(self.path, "rb") as f:
            f.seek(self.end)
            data = f.read(size - self.end)
        cut = data.rfind(b"\n") + 1
        self.torn = cut < len(data)
        self.end += cut
        rows = []
        for line in data[:cut].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                self.bad += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("global_step"), int):
                rows.append(row)
        self._since_cache += len(rows)
        if rows:
            self._add(rows)
        return bool(rows)

    def _add(self, rows: list[dict]) -> None:
        """Append the rows (a step already here: its row replaced in place), column by column."""
        fresh: dict[int, dict] = {}
        for r in rows:
            g = r["global_step"]
            if g in self._row_of:
                self._replace(self._row_of[g], r)
            else:
                fresh.pop(g, None)
                fresh[g] = r  # a step twice among the new rows: the later row
        if not fresh:
            return
        new = list(fresh.values())
        n0 = len(self.steps)
        keys = set().union(*(r.keys() for r in new)) - {"global_step", "time"}
        for k in sorted(keys | set(self.cols)):
            vals = [r.get(k) for r in new]
            try:  # numbers, with None where a row lacks the key: NaN
                col = np.array(vals, dtype=np.float64)
            except (TypeError, ValueError):  # some are not numbers (a string, a list): NaN there
                col = np.array([float(v) if _numeric(v, k) else np.nan for v in vals], dtype=np.float64)
            if k not in self.cols:
                if np.isnan(col).all():
                    continue
                self.cols[k] = np.full(n0, np.nan)
            self.cols[k] = np.concatenate((self.cols[k], col))
        self.steps = np.concatenate((self.steps, np.array(list(fresh), dtype=np.int64)))
        self.times = np.concatenate((self.times, np.array([float(r.get("time", np.nan)) for r in new])))
        self._row_of.update({g: n0 + i for i, g in enumerate(fresh)})

    def _replace(self, i: int, row: dict) -> None:
        for k in [k for k, v in row.items() if _numeric(v, k) and k not in self.cols]:
            self.cols[k] = np.full(len(self.steps), np.nan)
        for k, col in self.cols.items():
            v = row.get(k)
            col[i] = float(v) if _numeric(v, k) else np.nan

    def row(self, step: int) -> dict:
        i = self._row_of.get(step)
        if i is None:
            return {}
        return {k: float(v[i]) for k, v in self.cols.items() if not np.isnan(v[i])}

    # ------------------------------------------------------------ the cache
    def save_cache(self) -> None:
        if not len(self.steps) or self._ino is None:
            return
        keys = sorted(self.cols)
        meta = json.dumps({"ino": self._ino, "end": self.end, "keys": keys, "saved": time.time()})
        tmp = self.cache_file + ".tmp.npz"
        try:
            np.savez(tmp, meta=np.array(meta), steps=self.steps, times=self.times,
                     cols=np.stack([self.cols[k] for k in keys]) if keys else np.zeros((0, len(self.steps))))
            os.replace(tmp, self.cache_file)
            self._since_cache = 0
        except OSError:  # a read-only folder: no cache, every open parses the file
            self._since_cache = -(1 << 62)

    def _load_cache(self, ino: int, size: int) -> None:
        try:
            with np.load(self.cache_file) as z:
                meta = json.loads(str(z["meta"]))
                if meta["ino"] != ino or meta["end"] > size:
                    return
                steps, times, cols = z["steps"], z["times"], z["cols"]
        except (OSError, ValueError, KeyError):
            return
        self.steps, self.times, self.end = steps, times, int(meta["end"])
        self._row_of = dict(zip(steps.tolist(), range(len(steps))))
        self.cols = {k: cols[j].copy() for j, k in enumerate(meta["keys"])}


def _numeric(v: object, key: str) -> TypeGuard[float]:
    return key not in ("global_step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)

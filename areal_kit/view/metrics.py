"""metrics.jsonl as numeric columns for `areal-kit view`'s trend: read once, kept in a cache beside
the file (metrics.view.npz), then only its new rows read. The first read of a long run's file (no
cache yet: 100,000 steps are ~120 MB) runs in a thread, in blocks parsed by pyarrow's JSON reader;
until it ends the table holds an even sample of the rows and the latest rows whole.

    table = MetricsTable(paths.metrics_file); table.update(); table.steps, table.cols["task_reward"]
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TypeGuard

import numpy as np

from areal_kit.view.index import inode_size, json_rows

_CACHE_EVERY = 2000  # rows parsed since the cache was last written that make it worth writing again
_BULK = 4 << 20  # unread bytes of metrics.jsonl past which they are parsed in blocks by pyarrow (not row by row)
_BACKGROUND = 16 << 20  # unread bytes past which that parse runs in a thread, the page showing a sample of rows meanwhile
_SAMPLED = 1000  # rows the sample reads, evenly spread (and the last _TAIL bytes whole: the latest steps exact)
_TAIL = 1 << 18

_Cols = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]  # steps, times, {key: values}: one row each


class MetricsTable:
    """metrics.jsonl as numeric columns (numpy, NaN where a row lacks the key), one row per global
    step (a step logged twice: the later row), read from where the last read stopped; a cache beside
    the file (metrics.view.npz) spares a long run's reopening the parse of every row. The first read
    of a long file (no cache yet: 100,000 steps are ~120 MB) runs in a thread; until it ends the
    table holds an even sample of the rows and the latest rows whole (`sampled` says so), so the page
    opens at once and redraws when the read is done."""

    def __init__(self, metrics_file: str, cache_file: str = "", background: bool = True):
        self.path = metrics_file
        self.cache_file = cache_file or os.path.join(os.path.dirname(metrics_file), "metrics.view.npz")
        self.background = background
        self._reset(None)

    def _reset(self, ino: int | None) -> None:
        self.steps = np.zeros(0, dtype=np.int64)
        self.times = np.zeros(0)
        self.cols: dict[str, np.ndarray] = {}
        self._row_of: dict[int, int] = {}
        self.end, self._ino, self.torn, self.bad, self._since_cache = 0, ino, False, 0, 0
        self.sampled = False  # the table holds a sample of the rows while a thread reads them all
        self.rows_estimate = 0  # while sampled: how many rows the file has, from the sample's line length
        self._job: _Job | None = None

    def update(self) -> bool:
        got = inode_size(self.path)
        if got is None:
            changed = bool(len(self.steps))
            self._reset(None)
            return changed
        ino, size = got
        changed = False
        if ino != self._ino or size < self.end:
            self._reset(ino)  # a job under way for the old file finishes unheard
            self._load_cache(ino, size)
            changed = True
        if self._job is not None:
            if not self._job.done.is_set():
                return changed
            changed = self._adopt(self._job) or changed
        if size > self.end:
            changed = self._read(size) or changed
        if self._since_cache >= _CACHE_EVERY and not self.sampled:
            self.save_cache()
        return changed

    def _read(self, size: int) -> bool:
        if size - self.end > _BULK:
            cut = _whole_lines_end(self.path, self.end, size)
            self.torn = cut < size
            # what the table held, copied: the sample's rows may replace a row in place
            before = (self.steps, self.times, {k: v.copy() for k, v in self.cols.items()}, dict(self._row_of))
            job = _Job(self.path, self.end, cut, before)
            if self.background and size - self.end > _BACKGROUND:
                self._sample(self.end, cut)  # before the thread starts: it would slow the page's first answer
                self._job = job
                threading.Thread(target=job.run, name="metrics-read", daemon=True).start()
                return True
            job.run()
            return self._adopt(job)
        with open(self.path, "rb") as f:
            f.seek(self.end)
            data = f.read(size - self.end)
        cut = data.rfind(b"\n") + 1
        self.torn = cut < len(data)
        self.end += cut
        rows, bad = _parse_rows(data[:cut])
        self.bad += bad
        self._since_cache += len(rows)
        if rows:
            self._merge(*_columns(rows))
        return bool(rows)

    def _sample(self, start: int, stop: int) -> None:
        """Rows at _SAMPLED even offsets of [start, stop) and the last _TAIL bytes' rows, into the
        table (the job keeps what it held before, and replaces this when it ends)."""
        rows, lengths = [], []
        with open(self.path, "rb") as f:
            tail = max(start, stop - _TAIL)
            for off in np.linspace(start, tail, _SAMPLED, endpoint=False).astype(np.int64).tolist():
                f.seek(off)
                buf = f.read(1 << 13)
                a = buf.find(b"\n") + 1 if off > start else 0
                b = buf.find(b"\n", a)
                if a and b > a or off == start and b > 0:
                    lengths.append(b + 1 - a)
                    rows.append(buf[a:b])
            f.seek(tail)
            buf = f.read(stop - tail)
        lines = rows + buf[(buf.find(b"\n") + 1 if tail > start else 0):].splitlines()
        data = b"\n".join(lines) + b"\n"
        got = _columns(_parse_rows(data)[0])  # json (pyarrow's import alone is ~0.5 s); the job counts the bad lines
        self.sampled = True
        self.rows_estimate = len(self.steps) + int((stop - start) / (np.mean(lengths) if lengths else 1.0))
        self._merge(*got)

    def _adopt(self, job: _Job) -> bool:
        self._job = None
        self.steps, self.times, self.cols, self._row_of = job.before
        self.cols, self.sampled = dict(self.cols), False
        if job.error is not None:  # unreadable now (a file replaced under it): read again from the same place
            return True
        self.end, self.bad = job.stop, self.bad + job.bad
        for cols in job.parts:
            self._merge(*cols)
            self._since_cache += len(cols[0])
        return True

    def _merge(self, steps: np.ndarray, times: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        """Rows given as columns into the table: a step already here has its row replaced in place; a
        step twice among them: the later row, at the earlier's place."""
        if not len(steps):
            return
        _, first = np.unique(steps, return_index=True)
        _, last = np.unique(steps[::-1], return_index=True)
        order = np.argsort(first)
        at, use = first[order], (len(steps) - 1 - last)[order]  # each step's place in file order, and its row
        known = np.array([g in self._row_of for g in steps[at].tolist()], dtype=bool)
        if known.any():
            self.times = self.times.copy()  # (the array a job keeps to go back to)
        for i in use[known].tolist():
            self._replace(self._row_of[int(steps[i])], {k: v[i] for k, v in cols.items()})
            self.times[self._row_of[int(steps[i])]] = times[i]
        fresh = use[~known]
        if not len(fresh):
            return
        n0 = len(self.steps)
        for k in sorted(set(cols) | set(self.cols)):
            col = cols[k][fresh] if k in cols else np.full(len(fresh), np.nan)
            if k not in self.cols:
                if np.isnan(col).all():
                    continue
                self.cols[k] = np.full(n0, np.nan)
            self.cols[k] = np.concatenate((self.cols[k], col))
        new_steps = steps[fresh].astype(np.int64)
        self.steps = np.concatenate((self.steps, new_steps))
        self.times = np.concatenate((self.times, times[fresh]))
        self._row_of.update(zip(new_steps.tolist(), range(n0, n0 + len(fresh))))

    def _replace(self, i: int, row: dict[str, float]) -> None:
        for k in [k for k, v in row.items() if not np.isnan(v) and k not in self.cols]:
            self.cols[k] = np.full(len(self.steps), np.nan)
        for k, col in self.cols.items():
            col[i] = row.get(k, np.nan)

    def row(self, step: int) -> dict:
        i = self._row_of.get(step)
        if i is None:
            return {}
        return {k: float(v[i]) for k, v in self.cols.items() if not np.isnan(v[i])}

    # ------------------------------------------------------------ the cache
    def save_cache(self) -> None:
        if not len(self.steps) or self._ino is None or self.sampled:
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


class _Job:
    """A read of metrics.jsonl's bytes [start, stop) (whole lines) into columns, in blocks: pyarrow's
    JSON reader (C++, the GIL released: the page answers meanwhile) where a block is all objects of
    one type a key, else json row by row (a block with a line that is not JSON, or a key that is a
    number here and a string there). before: the table it extends, as it was."""

    def __init__(self, path: str, start: int, stop: int, before: tuple):
        self.path, self.start, self.stop, self.before = path, start, stop, before
        self.parts: list[_Cols] = []
        self.bad = 0
        self.error: OSError | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.start)
                pos, rest = self.start, b""
                while pos < self.stop:
                    chunk = rest + f.read(min(_BULK, self.stop - pos))
                    pos += len(chunk) - len(rest)
                    cut = chunk.rfind(b"\n") + 1 if pos < self.stop else len(chunk)
                    if len(chunk) == len(rest):  # the file got shorter under the read
                        raise OSError(f"{self.path} shrank while read")
                    block, rest = chunk[:cut], chunk[cut:]
                    if block:
                        self.parts.append(self._block(block))
        except OSError as e:
            self.error = e
        finally:
            self.done.set()

    def _block(self, data: bytes) -> _Cols:
        got = _arrow_columns(data)
        if got is not None:
            return got
        rows, bad = _parse_rows(data)
        self.bad += bad
        return _columns(rows)


def _arrow_columns(data: bytes) -> _Cols | None:
    import pyarrow as pa  # here, in the reading thread: the import alone takes ~0.5 s
    import pyarrow.json as pj

    try:
        table = pj.read_json(pa.BufferReader(data), read_options=pj.ReadOptions(block_size=len(data) + 1))
    except (pa.ArrowException, ValueError):
        return None
    if "global_step" not in table.column_names or not pa.types.is_integer(table.schema.field("global_step").type):
        return None
    steps = _numpy(table.column("global_step").cast(pa.float64()))
    valid = ~np.isnan(steps)
    cols: dict[str, np.ndarray] = {}
    for name in table.column_names:
        t = table.schema.field(name).type
        if name != "global_step" and (pa.types.is_integer(t) or pa.types.is_floating(t)):
            cols[name] = _numpy(table.column(name).cast(pa.float64()))[valid]
    times = cols.pop("time", np.full(int(valid.sum()), np.nan))
    return steps[valid].astype(np.int64), times, cols


def _numpy(col: Any) -> np.ndarray:
    """A float64 pyarrow column as numpy, NaN where null, from its buffers (pyarrow's own to_numpy
    imports pandas: a second on the page's first answer)."""
    arr = col.combine_chunks()
    n, off = len(arr), arr.offset
    validity, data = arr.buffers()
    out = np.frombuffer(data, dtype=np.float64)[off:off + n].copy() if n else np.zeros(0)
    if validity is not None and arr.null_count:
        bits = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), bitorder="little")[off:off + n]
        out[bits == 0] = np.nan
    return out


def _parse_rows(data: bytes) -> tuple[list[dict], int]:
    """The rows of data's lines (objects with a global_step), and how many lines were not JSON."""
    rows, bad, _ = json_rows(data, lambda row: isinstance(row.get("global_step"), int))
    return rows, bad


def _columns(rows: list[dict]) -> _Cols:
    steps = np.array([r["global_step"] for r in rows], dtype=np.int64)
    times = np.array([float(r["time"]) if _numeric(r.get("time"), "") else np.nan for r in rows])
    cols = {}
    for k in set().union(*(r.keys() for r in rows)) - {"global_step", "time"}:
        vals = [r.get(k) for r in rows]
        try:  # numbers, with None where a row lacks the key: NaN
            col = np.array(vals, dtype=np.float64)
            if any(isinstance(v, bool) for v in vals):
                raise TypeError
        except (TypeError, ValueError):  # some are not numbers (a string, a list, a bool): NaN there
            col = np.array([float(v) if _numeric(v, k) else np.nan for v in vals], dtype=np.float64)
        cols[k] = col
    return steps, times, cols


def _whole_lines_end(path: str, start: int, size: int) -> int:
    """The end of the last whole line of path's bytes [start, size)."""
    with open(path, "rb") as f:
        pos = size
        while pos > start:
            at = max(start, pos - (1 << 16))
            f.seek(at)
            buf = f.read(pos - at)
            nl = buf.rfind(b"\n")
            if nl >= 0:
                return at + nl + 1
            pos = at
    return start


def _numeric(v: object, key: str) -> TypeGuard[float]:
    return key not in ("global_step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)

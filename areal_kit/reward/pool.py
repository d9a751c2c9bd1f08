"""Worker processes that run a function under a time limit, for code that may hang or crash.

Two callers share it: the math grader sends math-verify calls made outside the main thread
(sympy can run for minutes on adversarial input, and SIGALRM, the only way to stop pure Python
in-process, works in the main thread only), and the reward scorer sends every user reward.

    pool = Pool(size=2)
    pool.map("mypkg.rewards:exact", [(prompt, completion, sample), ...], timeout_s=5)
    # -> [("ok", 1.0), ("timeout", "took longer than 5s (process killed)"), ...]

A worker runs each call in its own main thread under an alarm; if it still does not answer in
time (stuck in C code) or dies, it is killed and replaced, and the call is reported as
"timeout" or "crash". A call that raises is reported by its exception's name, a function that
cannot be imported as "import error". Functions are named "module:function" and imported once
per worker.

Workers are plain subprocesses (`python -m areal_kit.reward.pool`) speaking pickled frames on
stdin/stdout, not multiprocessing: spawn/forkserver would re-import the caller's __main__ in
every worker, and fork is unsafe in a threaded process. A worker exits when its stdin closes,
so none outlives its parent. Any thread may call a pool; each call takes the workers it uses.
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Literal, overload

from areal_kit.reward.alarm import alarm

STARTUP_GRACE_S = 60.0  # a fresh worker imports the function (sympy, math-verify) on a busy machine
KILL_GRACE_S = 2.0  # beyond the worker's own alarm, before we kill it

Result = tuple[str, object]  # ("ok", value) or (failure kind, message)


class CallTimeout(BaseException):
    """Raised by the alarm in a worker; a BaseException so that the function's own
    `except Exception` cannot swallow it."""


def _write(stream: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _read(fd: int) -> Any:  # whatever the other side pickled
    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    return pickle.loads(_read_exact(fd, n))


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        # The package without an install, then the caller's sys.path (a Ray worker's, a test's),
        # so that a user's module imports here as it does in the caller.
        paths = [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", ""), *sys.path]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "areal_kit.reward.pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        assert self.proc.stdin and self.proc.stdout  # both piped
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.fd = self.stdout.fileno()
        self.answered = False
        self.task: tuple[int, float] | None = None  # (index, deadline) of the call in flight

    def send(self, index: int, msg: tuple, timeout_s: float) -> None:
        grace = KILL_GRACE_S if self.answered else STARTUP_GRACE_S
        self.task = (index, time.monotonic() + timeout_s + grace)
        _write(self.stdin, msg)

    @property
    def in_flight(self) -> tuple[int, float]:
        """(index, deadline) of the call it was sent."""
        assert self.task is not None, "a busy worker has a call"
        return self.task

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for s in (self.stdin, self.stdout):
            try:
                s.close()
            except OSError:
                pass


class Pool:
    """Up to `size` worker processes, started when first needed and kept for later calls."""

    def __init__(self, size: int):
        self.size = max(1, int(size))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._live: list[_Worker] = []

    @overload
    def _take(self, block: Literal[True]) -> _Worker: ...

    @overload
    def _take(self, block: Literal[False]) -> _Worker | None: ...

    def _take(self, block: bool) -> _Worker | None:
        """An idle worker, a new one while fewer than `size` live, else wait (or None)."""
        while True:
            try:
                w = self._idle.get(timeout=0.05 if block else 0)
                if w.alive():
                    return w
                w.kill()  # died while idle (killed from outside): reap it, take another
                continue
            except queue.Empty:
                pass
            with self._lock:
                self._live[:] = [w for w in self._live if w.alive()]
                if len(self._live) < self.size:
                    w = _Worker()
                    self._live.append(w)
                    return w
            if not block:
                return None

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        with self._lock:
            self._live[:] = [x for x in self._live if x is not w]
            new = _Worker()
            self._live.append(new)
        return new

    def map(self, fn: str, calls: list[tuple], timeout_s: float) -> list[Result]:
        """fn(*args) for each args of `calls`, spread over the workers; one Result per call."""
        results: list = [None] * len(calls)
        todo = list(range(len(calls)))[::-1]
        idle = [self._take(block=True)] if calls else []
        while len(idle) < min(self.size, len(calls)) and (w := self._take(block=False)):
            idle.append(w)
        busy: list[_Worker] = []
        try:
            while todo or busy:
                while todo and idle:
                    w, i = idle.pop(), todo.pop()
                    try:
                        w.send(i, (fn, calls[i], timeout_s), timeout_s)
                        busy.append(w)
                    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
                        results[i] = ("crash", f"could not send the call ({type(e).__name__}: {e})")
                        idle.append(self._replace(w))
                if busy:
                    self._collect(busy, idle, results, timeout_s)
        finally:
            for w in busy:  # interrupted mid-call: its answer would reach the next caller
                w.kill()
            for w in idle:
                self._idle.put(w)
        return results

    def _collect(self, busy: list[_Worker], idle: list[_Worker], results: list, timeout_s: float) -> None:
        wait = max(0.0, min(w.in_flight[1] for w in busy) - time.monotonic())
        ready, _, _ = select.select([w.fd for w in busy], [], [], wait)
        for w in list(busy):
            i, deadline = w.in_flight
            if w.fd in ready:
                try:
                    results[i] = _read(w.fd)
                    w.answered, w.task = True, None
                    busy.remove(w)
                    idle.append(w)
                    continue
                except (EOFError, OSError, pickle.UnpicklingError, AttributeError, ImportError):
                    results[i] = ("crash", f"the worker process died (exit code {w.proc.poll()}) during the call")
            elif time.monotonic() >= deadline:
                results[i] = ("timeout", f"took longer than {timeout_s:g}s (process killed)")
            else:
                continue
            busy.remove(w)
            idle.append(self._replace(w))

    def pids(self) -> list[int]:
        """The process ids of the live workers."""
        with self._lock:
            return [w.proc.pid for w in self._live if w.alive()]

    def call(self, fn: str, args: tuple, timeout_s: float) -> Result:
        """fn(*args) in one worker."""
        return self.map(fn, [args], timeout_s)[0]

    def close(self) -> None:
        with self._lock:
            for w in self._live:
                w.kill()
            self._live = []
        self._idle = queue.Queue()


def _resolve(fn: str) -> Callable[..., Any]:
    module, _, name = fn.partition(":")
    obj: Any = importlib.import_module(module)  # then the attributes the name walks
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _serve() -> None:
    inp, out = sys.stdin.buffer.fileno(), sys.stdout.buffer
    # A function that prints must not corrupt the frames: its stdout goes to stderr (discarded).
    sys.stdout = sys.stderr
    fns: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            fn, args, timeout_s = _read(inp)
        except EOFError:
            return
        try:
            if fn not in fns:
                fns[fn] = _resolve(fn)
        except BaseException as e:  # noqa: BLE001 - reported per call, the worker lives on
            _write(out, ("import error", f"cannot import {fn}: {type(e).__name__}: {e}"[:300]))
            continue
        try:
            with alarm(timeout_s, CallTimeout):
                res = ("ok", fns[fn](*args))
        except CallTimeout:
            res = ("timeout", f"took longer than {timeout_s:g}s")
        except BaseException as e:  # noqa: BLE001 - SystemExit too: a call must not end the worker
            res = (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        try:
            _write(out, res)
        except (pickle.PicklingError, TypeError, AttributeError):
            _write(out, ("bad return", f"returned a {type(res[1]).__name__}, which cannot be sent back"))


if __name__ == "__main__":
    _serve()

"""Scoring samples with the configured rewards, so that a bad reward cannot hang or crash a run.

`RewardRunner(ppo).score(items)` sums every reward of ppo.reward_fns for each
(prompt, completion, sample). Built-in rewards (math, gsm8k, toy: bounded time, never raise)
run in this process. Plug-ins run in a pool of worker processes (ppo.reward_workers), one call
at a time each, with a per-call budget (ppo.reward_timeout_s): the worker stops an overrunning
call with SIGALRM, and a worker stuck in C code is killed and replaced. A call that raises,
overruns or returns something that is not a number gives that reward 0 for the sample, and is
counted by kind ("mine: ValueError", "mine: timeout") in `failures`; the caller logs each kind
once.

A reward returns a float, or a dict with "reward" and other numbers (averaged and logged as
reward/<key>).

Workers are `python -m areal_kit.reward.runner` subprocesses speaking pickled frames on
stdin/stdout, like reward/pool.py: no multiprocessing re-import of the caller's __main__, no
fork of a threaded process, and a worker exits when its parent's pipe closes.
"""

from __future__ import annotations

import math
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from areal_kit.reward.alarm import alarm

STARTUP_GRACE_S = 60.0  # a fresh worker imports the plug-in (and maybe sympy) on a busy machine
KILL_GRACE_S = 2.0  # beyond the worker's own alarm, before we kill it


class RewardTimeout(BaseException):
    """Raised by the alarm in a worker; a BaseException so a reward's `except Exception` cannot
    swallow it."""


def as_reward(value) -> tuple[float, dict]:
    """(reward, extra numbers) from what a reward returned; ValueError when it is neither."""
    extras = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without 'reward' (keys: {', '.join(map(str, value))[:80]})")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {type(value).__name__} {str(value)[:40]!r}, expected a finite number")
    return float(value), extras


def _write(stream, obj) -> None:
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


def _read(fd: int):
    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    return pickle.loads(_read_exact(fd, n))


class _Worker:
    def __init__(self, specs: list[str]):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # importable without an install
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # The caller's sys.path (a Ray worker's, a test's) so plug-in modules import the same here.
        env["PYTHONPATH"] += os.pathsep + os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "areal_kit.reward.runner"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.fd = self.proc.stdout.fileno()
        self.answered = False
        self.task = None  # (index, deadline) of the call in flight
        _write(self.proc.stdin, specs)

    def send(self, index: int, msg: tuple, timeout_s: float) -> None:
        grace = KILL_GRACE_S if self.answered else STARTUP_GRACE_S
        self.task = (index, time.monotonic() + timeout_s + grace)
        _write(self.proc.stdin, msg)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass


class RewardRunner:
    def __init__(self, ppo):
        from areal_kit.reward import plugins

        self.specs = plugins.reward_specs(ppo)
        self.fns = {spec: plugins.load_reward(spec) for _, spec in self.specs}
        self.trusted = {spec for _, spec in self.specs if plugins.is_trusted(spec)}
        self.untrusted = [spec for _, spec in self.specs if spec not in self.trusted]
        self.timeout_s = float(ppo.reward_timeout_s)
        self.n_workers = int(ppo.reward_workers)
        self.workers: list[_Worker] = []
        self.failures: Counter = Counter()  # kind -> count since the last take_failures()
        self.first_error: dict[str, str] = {}  # kind -> the first message of that kind

    # ------------------------------------------------------------ failures
    def _fail(self, name: str, kind: str, message: str) -> None:
        key = f"{name}: {kind}"
        self.failures[key] += 1
        self.first_error.setdefault(key, f"{key}: {message}"[:300])

    def take_failures(self) -> dict[str, tuple[int, str]]:
        """{kind: (count, first message)} since the last call."""
        out = {k: (n, self.first_error[k]) for k, n in self.failures.items()}
        self.failures.clear()
        return out

    # ------------------------------------------------------------ scoring
    def score(self, items: list[tuple[str, str, dict]]) -> list[tuple[float, dict]]:
        """(summed reward, extra numbers) for each (prompt, completion, sample)."""
        names = {spec: name for name, spec in self.specs}
        totals = [0.0] * len(items)
        extras: list[dict] = [{} for _ in items]
        for spec in self.trusted:
            for i, (p, c, s) in enumerate(items):
                try:
                    r, ex = as_reward(self.fns[spec](p, c, s))
                except Exception as e:  # noqa: BLE001 - counted, never fatal
                    self._fail(names[spec], type(e).__name__, str(e))
                    continue
                totals[i] += r
                extras[i].update(ex)
        for spec in self.untrusted:
            for i, res in enumerate(self._in_pool(spec, items)):
                status, value = res
                if status == "ok":
                    try:
                        r, ex = as_reward(value)
                    except ValueError as e:
                        self._fail(names[spec], "bad return", str(e))
                        continue
                    totals[i] += r
                    extras[i].update(ex)
                else:
                    self._fail(names[spec], status, value)
        return list(zip(totals, extras))

    def _in_pool(self, spec: str, items) -> list[tuple[str, object]]:
        """(status, value) per item: ("ok", returned) or (failure kind, message)."""
        results: list = [None] * len(items)
        todo = list(range(len(items)))[::-1]
        while len(self.workers) < min(self.n_workers, len(items)):
            self.workers.append(_Worker(self.untrusted))
        busy: list[_Worker] = []
        idle = list(self.workers)
        while todo or busy:
            while todo and idle:
                w = idle.pop()
                i = todo.pop()
                p, c, s = items[i]
                try:
                    w.send(i, (spec, p, c, s, self.timeout_s), self.timeout_s)
                    busy.append(w)
                except (OSError, pickle.PicklingError, TypeError) as e:
                    results[i] = ("crash", f"could not send the sample ({type(e).__name__}: {e})")
                    idle.append(self._replace(w))
            if not busy:
                continue
            now = time.monotonic()
            wait = max(0.0, min(w.task[1] for w in busy) - now)
            ready, _, _ = select.select([w.fd for w in busy], [], [], wait)
            for w in list(busy):
                i = w.task[0]
                if w.fd in ready:
                    try:
                        results[i] = _read(w.fd)
                        w.answered = True
                        w.task = None
                        busy.remove(w)
                        idle.append(w)
                        continue
                    except (EOFError, OSError, pickle.UnpicklingError):
                        why = f"the reward process died (exit code {w.proc.poll()}) while scoring"
                        results[i] = ("crash", why)
                elif time.monotonic() >= w.task[1]:
                    results[i] = ("timeout", f"took longer than {self.timeout_s:g}s (process killed)")
                else:
                    continue
                busy.remove(w)
                idle.append(self._replace(w))
        return results

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        new = _Worker(self.untrusted)
        self.workers[self.workers.index(w)] = new
        return new

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing left to clean
            pass


def _serve() -> None:
    from areal_kit.reward import plugins

    inp, out = sys.stdin.buffer.fileno(), sys.stdout.buffer
    # A reward that prints must not corrupt the frames: its stdout goes to stderr (discarded).
    sys.stdout = sys.stderr
    specs = _read(inp)
    fns, load_errors = {}, {}
    for spec in specs:
        try:
            fns[spec] = plugins.load_reward(spec)
        except Exception as e:  # noqa: BLE001 - reported per call
            load_errors[spec] = str(e)
    while True:
        try:
            spec, prompt, completion, sample, timeout_s = _read(inp)
        except EOFError:
            return
        if spec in load_errors:
            res = ("import error", load_errors[spec])
        else:
            try:
                with alarm(timeout_s, RewardTimeout):
                    value = fns[spec](prompt, completion, sample)
                res = ("ok", value if isinstance(value, (int, float, dict)) else repr(value)[:80])
            except RewardTimeout:
                res = ("timeout", f"took longer than {timeout_s:g}s")
            except BaseException as e:  # noqa: BLE001 - SystemExit too: a reward must not end the worker
                res = (type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        try:
            _write(out, res)
        except (pickle.PicklingError, TypeError, AttributeError):
            _write(out, ("bad return", "returned an object that cannot be sent back"))


if __name__ == "__main__":
    _serve()

"""The page's server: one HTML page and its static files (areal_kit/view/static, uPlot vendored) and
the JSON it polls, read from the run's own files through the indexes of view/index.py.

    GET /api/status          steps so far, dumped steps, notes (what the page cannot show, and why)
    GET /api/trend?keys=a,b  metric columns against the step (at most `points` points: bucket means)
    GET /api/steps           the global steps with dumped samples
    GET /api/step/G          step G's metrics and its groups (each answer without its tokens)
    GET /api/sample/G/I      answer I of step G, with its per-token fields
    GET /api/timeline/G      step G's spans per process (timeline.jsonl): [lane, what, start, end]
    GET /api/run             the run's config (config.json, each value's source), driver.json, where it
                             stands, its launches and relaunches (train.log), its checkpoints
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from areal_kit.durable import read_json
from areal_kit.runlog import RunPaths
from areal_kit.view.index import SampleIndex
from areal_kit.view.metrics import MetricsTable
from areal_kit.view.runinfo import LogEvents, checkpoints, config_rows

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_ANSWER_CHARS = 600  # of an answer's text in the step view (the sample view has it whole)
_REFRESH_S = 1.0  # the files are looked at no more often than this


def _num(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(f"{v:.6g}")


class RunData:
    """One run's files as the page reads them; every reader takes the lock (uvicorn's threadpool)."""

    def __init__(self, paths: RunPaths, name: str, summary: Callable[[], list[str]] | None = None):
        self.files, self.name, self._summary = paths, name, summary
        self.samples = SampleIndex(paths.samples_file, paths.samples_index_file)
        self.metrics = MetricsTable(paths.metrics_file)
        self.timeline = SampleIndex(paths.timeline_file, os.path.join(paths.log_dir, "timeline.index"))
        self.events = LogEvents(paths.log_file)
        self.lock = threading.Lock()
        self.checked = 0.0
        self.generation = 0  # bumped when the files gave something new: the page refetches
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        with self.lock:
            now = time.monotonic()
            if not force and now - self.checked < _REFRESH_S:
                return
            self.checked = now
            changed = self.metrics.update()
            changed = self.samples.update() or changed
            changed = self.timeline.update() or changed
            if changed:
                self.generation += 1

    def notes(self) -> list[str]:
        """What the page cannot show, one line each (the command prints them at start too)."""
        out = []
        m, s = self.metrics, self.samples
        if not os.path.exists(m.path):
            out.append(f"no metrics.jsonl yet in {self.files.log_dir}: the run has not finished a step")
        if not os.path.exists(s.samples_file):
            out.append(f"no samples.jsonl in {self.files.log_dir}: the run dumps none (exp_ctrl.dump_samples_every=0) "
                       "or has not reached its first dump; the trend is shown alone")
        elif not len(s) and not s.torn:
            out.append(f"{s.samples_file} holds no step's rows")
        for name, torn in (("metrics.jsonl", m.torn), ("samples.jsonl", s.torn)):
            if torn:
                out.append(f"{name} ends in a line cut mid-write (being written, or a crash cut it): it is left out")
        if m.sampled:
            out.append(f"metrics.jsonl is being read whole for the first time (~{m.rows_estimate} rows; "
                       "then kept in metrics.view.npz): the trend shows an even sample of its rows until then")
        if m.bad:
            out.append(f"metrics.jsonl: {m.bad} line(s) that are not JSON were skipped")
        if not s.writable:
            out.append(f"{s.index_file} cannot be written: the index is kept in memory, built again at each open")
        return out

    def status(self) -> dict:
        with self.lock:
            m, s = self.metrics, self.samples
            steps = s.steps
            n = len(m.steps)
            return {"name": self.name, "log_dir": self.files.log_dir, "generation": self.generation,
                    "n_steps": m.rows_estimate if m.sampled else n, "first_step": int(m.steps.min()) if n else None,
                    "last_step": int(m.steps.max()) if n else None, "last_time": _num(float(m.times[-1])) if n else None,
                    "sample_steps": len(steps), "last_sample_step": steps[-1] if steps else None,
                    "keys": sorted(m.cols), "notes": self.notes()}

    def trend(self, keys: list[str] | None, points: int) -> str:
        """The trend's JSON text: {"steps": [...], "every": n, "series": {key: [...]}} (null where a
        step lacks the key); written by hand, as numpy formats numbers far faster than json does."""
        with self.lock:
            m = self.metrics
            keys = [k for k in (keys or sorted(m.cols)) if k in m.cols]
            steps, cols = m.steps, {k: m.cols[k] for k in keys}  # arrays the reader replaces, never changes
        order = np.argsort(steps, kind="stable")
        steps = steps[order]
        cols = {k: v[order] for k, v in cols.items()}
        n, every = len(steps), 1
        if n > points > 0:  # bucket means: a curve of `points` points over the whole run
            every = math.ceil(n / points)
            pad = (-n) % every
            steps = steps[::every]
            for k, v in cols.items():
                b = np.concatenate((v, np.full(pad, np.nan))).reshape(-1, every)
                with np.errstate(all="ignore"):
                    cnt = np.sum(~np.isnan(b), axis=1)
                    cols[k] = np.where(cnt > 0, np.nansum(b, axis=1) / np.maximum(cnt, 1), np.nan)
        series = ", ".join(f"{json.dumps(k)}: [{_numbers(v)}]" for k, v in cols.items())
        return f'{{"steps": [{", ".join(map(str, steps.tolist()))}], "every": {every}, "series": {{{series}}}}}'

    def step(self, g: int) -> dict:
        with self.lock:
            rows, bad = self.samples.rows(g)
            metrics = {k: _num(v) for k, v in self.metrics.row(g).items()}
        groups: dict[tuple, list[dict]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((r.get("id"), r.get("group")), []).append(_summary(i, r))
        out = []
        for (pid, grp), samples in groups.items():
            rewards = [s["task_reward"] for s in samples]
            samples.sort(key=lambda s: -(s["task_reward"] if isinstance(s["task_reward"], (int, float)) else 0))
            out.append({"id": pid, "group": grp, "prompt": rows[samples[0]["i"]].get("prompt", ""),
                        "samples": samples, "all_equal": len(set(rewards)) <= 1,
                        "mean_reward": _num(sum(r for r in rewards if isinstance(r, (int, float))) / len(rewards)),
                        "truncated": any(s["no_eos"] for s in samples),
                        "tool_calls": any(s["tool_calls"] for s in samples)})
        return {"step": g, "metrics": metrics, "groups": out, "bad_lines": bad,
                "has_tokens": any("tokens" in r for r in rows)}

    def sample(self, g: int, i: int) -> dict | None:
        with self.lock:
            rows, _ = self.samples.rows(g)
        return rows[i] if 0 <= i < len(rows) else None

    def spans(self, g: int) -> dict:
        """Step g's timeline: its spans [lane, what, start, end] (wall-clock seconds), lanes in order
        of their first span; none where the run records no timeline (areal-kit before the view)."""
        with self.lock:
            rows, _ = self.timeline.rows(g)
            recorded = bool(len(self.timeline))
        spans = [s for r in rows[-1:] for s in r.get("spans") or [] if isinstance(s, list) and len(s) == 4]
        lanes: list[str] = []
        for lane, _, _, _ in sorted(spans, key=lambda s: (not str(s[0]).startswith(("driver", "trainer")), s[2])):
            if lane not in lanes:
                lanes.append(lane)
        return {"step": g, "spans": spans, "lanes": lanes, "recorded": recorded}

    def run_info(self) -> dict:
        log_dir = self.files.log_dir
        config = read_json(os.path.join(log_dir, "config.json"))
        with self.lock:
            self.events.update()
            events = list(self.events.events)
        origin = (config or {}).get("origin") or {}
        try:
            summary = self._summary() if self._summary else [f"run        {self.name}  ({log_dir})"]
        except Exception as e:  # noqa: BLE001  (the page shows the rest; the cause is its line)
            summary = [f"where the run stands could not be read: {type(e).__name__}: {e}"]
        try:
            ckpts = checkpoints(self.files)
        except OSError as e:
            ckpts = {"error": f"the checkpoint folders could not be read: {e}"}
        return {"config": config, "options": config_rows(config), "preset": origin.get("preset"),
                "overrides": origin.get("overrides"), "events": events, "checkpoints": ckpts,
                "driver": read_json(os.path.join(log_dir, "driver.json")), "summary": summary,
                "config_note": "" if config else "no config.json in the log folder: the run predates it "
                "(runs write every option's value there when they start)"}


def _numbers(v: np.ndarray) -> str:
    """Numbers as JSON, 6 significant digits, null where not finite."""
    text = ", ".join(map("{:.6g}".format, v.tolist()))
    return text.replace("-inf", "null").replace("inf", "null").replace("nan", "null")


def _summary(i: int, r: dict) -> dict:
    versions = r.get("versions") or []
    answer = str(r.get("answer", ""))
    return {"i": i, "task_reward": r.get("task_reward"), "seq_reward": r.get("seq_reward"),
            "final_reward": r.get("final_reward"), "n_tokens": r.get("n_tokens"), "version": r.get("version"),
            "versions": [min(versions), max(versions)] if versions else None, "no_eos": bool(r.get("no_eos")),
            "tool_calls": r.get("tool_calls", 0) or 0, "turns": r.get("turns", 1),
            "answer": answer if len(answer) <= _ANSWER_CHARS else answer[:_ANSWER_CHARS] + " ...",
            "has_tokens": "tokens" in r,
            "masked": sum(1 for x in r.get("loss_mask") or [] if not x)}


def make_app(data: RunData) -> Starlette:
    def page(request: Request) -> Response:
        return FileResponse(os.path.join(STATIC, "index.html"))

    def status(request: Request) -> Response:
        data.refresh()
        return JSONResponse(data.status())

    def trend(request: Request) -> Response:
        data.refresh()
        keys = [k for k in request.query_params.get("keys", "").split(",") if k] or None
        points = _int(request.query_params.get("points", "4000"), 4000)
        return Response(data.trend(keys, points), media_type="application/json")

    def steps(request: Request) -> Response:
        data.refresh()
        with data.lock:
            return JSONResponse({"steps": data.samples.steps})

    def step(request: Request) -> Response:
        data.refresh()
        return JSONResponse(data.step(_int(request.path_params["g"], -1)))

    def sample(request: Request) -> Response:
        got = data.sample(_int(request.path_params["g"], -1), _int(request.path_params["i"], -1))
        return JSONResponse(got) if got is not None else JSONResponse({"error": "no such sample"}, status_code=404)

    def timeline(request: Request) -> Response:
        data.refresh()
        return JSONResponse(data.spans(_int(request.path_params["g"], -1)))

    def run(request: Request) -> Response:
        return Response(json.dumps(data.run_info(), default=str), media_type="application/json")

    return Starlette(routes=[
        Route("/", page), Route("/api/status", status), Route("/api/trend", trend), Route("/api/steps", steps),
        Route("/api/step/{g}", step), Route("/api/sample/{g}/{i}", sample), Route("/api/run", run),
        Route("/api/timeline/{g}", timeline),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])


def _int(text: Any, default: int) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return default

"""The run page's facts beyond the config's values: where each value came from (config.json's
origin, which config/loader.py records), the run's launches, relaunches and their causes and how
it ended (train.log's lines, as logs.py writes and parses them), and its checkpoints (the recover
folder's complete ones, the model saves under ckpt_dir/actor).

    events = LogEvents(paths.log_file); events.update(); events.events   # [{"time", "kind", "text"}]
    config_rows(read_json(".../config.json"))                           # options with "source", "preset"
    checkpoints(paths)                                                  # {"recover": [...], "saves": [...]}
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from areal_kit import logs
from areal_kit.checkpoints import step_of
from areal_kit.rl.checkpoint import store
from areal_kit.runlog import RunPaths

# The lines of a launch's story (not the two a step writes): one regex over the bytes finds them.
_HEADS = (logs.RUN_HEAD, logs.READY_HEAD, logs.RESUME_HEAD, logs.RELAUNCH_HEAD, logs.FINISHED_HEAD,
          logs.AFTER_SIGTERM_HEAD, "Run failed: ", "Run interrupted (")
_STORY = re.compile(b"|".join(re.escape(h.encode()) for h in _HEADS))


def _event(line: str) -> dict | None:
    """The launch event a train.log line tells, or None."""
    when = logs.line_time(line)
    out: dict[str, Any] = {"time": when}
    if (run := logs.parse_run(line)) is not None:
        out.update(kind="launch", text=f"{run.total_steps} steps, {run.n_prompts} prompts")
    elif (ready := logs.parse_ready(line)) is not None:
        out.update(kind="workers ready", text=f"in {ready.seconds:.1f} s: {ready.detail}")
    elif (res := logs.parse_resume(line)) is not None:
        out.update(kind="resume", step=res.global_step,
                   text=f"from the recover checkpoint of global step {res.global_step} ({res.path}, written {res.written})")
    elif (rel := logs.parse_relaunch(line)) is not None:
        out.update(kind="relaunch", text=f"retry {rel.attempt}/{rel.retries}: {rel.cause}")
    elif (fin := logs.parse_finished(line)) is not None:
        out.update(kind="finished", text=f"{fin.steps} steps, final task_reward {fin.task_reward}")
    elif (failed := logs.parse_failed(line)) is not None:
        out.update(kind="failed", text=failed)
    elif (stop := logs.parse_stopped(line)) is not None:
        out.update(kind="interrupted", text=f"{stop.signame}" + (f" after global step {stop.global_step}, recover "
                                                                  f"checkpoint {stop.checkpoint}" if stop.global_step else ""))
    elif (why := logs.parse_after_sigterm(line)) is not None:
        out.update(kind="stopped after SIGTERM", text=why)
    else:
        return None
    return out


class LogEvents:
    """train.log's launch events, read on from where the last read stopped (a long run's log is
    mostly step lines: those are passed over by one regex over the bytes)."""

    def __init__(self, log_file: str):
        self.path = log_file
        self.events: list[dict] = []
        self.end = 0
        self._ino: int | None = None

    def update(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            self.events, self.end, self._ino = [], 0, None
            return
        if st.st_ino != self._ino or st.st_size < self.end:
            self.events, self.end, self._ino = [], 0, st.st_ino
        if st.st_size <= self.end:
            return
        with open(self.path, "rb") as f:
            f.seek(self.end)
            data = f.read(st.st_size - self.end)
        cut = data.rfind(b"\n") + 1
        self.end += cut
        line_end = -1
        for m in _STORY.finditer(data, 0, cut):
            if m.start() < line_end:  # a second head on a line already read
                continue
            start, line_end = data.rfind(b"\n", 0, m.start()) + 1, data.find(b"\n", m.start())
            ev = _event(data[start:line_end].decode("utf-8", "replace"))
            if ev is not None:
                self.events.append(ev)


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


def config_rows(config: dict | None) -> list[dict]:
    """config.json's options, each with "source": override (a key=value the command gave), preset
    (the preset set it: "preset" holds what it said, an interpolation as written), environment
    (RUN_ENV, a cluster spec, the loader filled it in) or default; and "changed": the value is not the default."""
    if not config:
        return []
    origin = config.get("origin") or {}
    said = origin.get("preset_values") or {}
    given = {o.partition("=")[0].strip().lstrip("+") for o in origin.get("overrides") or []}
    rows = []
    for o in config.get("options") or []:
        key = o.get("key", "")
        row = dict(o)
        row["changed"] = not _same(o.get("value"), o.get("default"))
        if any(key == g or g.startswith(key + ".") or key.startswith(g + ".") for g in given):
            row["source"] = "override"
        elif key in said:
            row["source"] = "preset"
        elif origin and row["changed"]:
            row["source"] = "derived"  # RUN_ENV, a cluster spec's fileroot, or what the loader filled in
        else:
            row["source"] = "default"
        if key in said:
            row["preset"] = said[key]
        rows.append(row)
    return rows


def checkpoints(paths: RunPaths) -> dict:
    """The recover checkpoints on disk (the complete ones, as a resume tells them: global step,
    when written, bytes), the set-aside folders of fresh starts, and the model saves (global step,
    folder)."""
    recover: list[dict[str, Any]] = []
    for ck in store.list_checkpoints(paths.recover_dir) if paths.recover_dir else []:
        when = ck.state.get("time")
        recover.append({"global_step": ck.global_step, "path": ck.path, "bytes": store.tree_bytes(ck.path),
                        "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if when else ""})
    aside = store.set_asides(paths.recover_dir) if paths.recover_dir else []
    saves = []
    actor = os.path.join(paths.ckpt_dir, "actor") if paths.ckpt_dir else ""
    if actor and os.path.isdir(actor):
        for name in sorted(os.listdir(actor), key=step_of):
            if step_of(name) >= 0:
                saves.append({"global_step": step_of(name), "path": os.path.join(actor, name)})
    return {"recover_dir": paths.recover_dir, "ckpt_dir": paths.ckpt_dir, "recover": recover, "saves": saves,
            "set_aside": aside}

"""`areal-kit logs` and `areal-kit plot`: where a run stands and how it learns, from its files alone.

Works for a running, finished or dead run, on any machine that sees the run's folders: it reads
train.log, metrics.jsonl and driver.json (log folder), the recover checkpoints' state.json and
the persistent saves; it never talks to Ray.

    areal-kit logs tiny/run0                      # EXP/TRIAL under ./areal_runs (or --fileroot)
    areal-kit logs areal_runs/logs/root/tiny/run0 --follow
    areal-kit logs tiny/run0 --plot               # task_reward curve in the terminal (plotext)
    areal-kit plot tiny/run0 -o curves.png        # task_reward, response length, KL, entropy (+ eval, sources, tool calls)
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from areal_kit import curves
from areal_kit.checkpoints import step_of
from areal_kit.console import make_console
from areal_kit.durable import read_json
from areal_kit.errors import UserError
from areal_kit.flags import build, command, flag, params
from areal_kit.logs import (
    line_time,
    parse_epoch,
    parse_failed,
    parse_finished,
    parse_relaunch,
    parse_resume,
    parse_run,
    parse_stopped,
)
from areal_kit.runlog import RunPaths, read_metrics, run_paths

if TYPE_CHECKING:  # the checkpoint store imports torch; the monitor loads it only when it reads one
    from areal_kit.rl.checkpoint.store import Checkpoint

STOPPED = ("failed", "interrupted", "dead", "probably dead")  # states a re-run resumes from


@dataclass(frozen=True)
class RunFiles(RunPaths):
    """A run's folders plus the name it is shown under (EXP/TRIAL)."""

    name: str = ""


def resolve_run(target: str, fileroot: str = "", user: str = "") -> RunFiles:
    """A run's log folder (the one with train.log), or EXP/TRIAL under fileroot."""
    path = os.path.abspath(os.path.expanduser(target))
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in ("train.log", "metrics.jsonl")):
        info = read_json(os.path.join(path, "driver.json")) or {}
        parts = path.rstrip("/").split(os.sep)
        if len(parts) >= 5 and parts[-4] == "logs":  # {fileroot}/logs/{user}/{exp}/{trial}
            root, tail = os.sep.join(parts[:-4]) or os.sep, parts[-3:]
            guess = (os.path.join(root, "recover", *tail), os.path.join(root, "checkpoints", *tail))
        else:
            guess = ("", "")
        return RunFiles(path, info.get("recover_dir", guess[0]), info.get("ckpt_dir", guess[1]),
                        name="/".join(parts[-2:]))
    bits = target.strip("/").split("/")
    root = os.path.abspath(os.path.expanduser(fileroot or os.path.join(os.getcwd(), "areal_runs")))
    if len(bits) == 2 and all(bits):
        p = run_paths(root, bits[0], bits[1], user or None)
        if os.path.isdir(p.log_dir):
            return RunFiles(p.log_dir, p.recover_dir, p.ckpt_dir, name=target.strip("/"))
        raise UserError(f"no run {target} under {root} (looked for {p.log_dir}); expected EXP/TRIAL of a run "
                        "started there, or --fileroot/--user of the run, or the run's log folder")
    raise UserError(f"{target} is not a run: expected a run's log folder (with train.log) or EXP/TRIAL")


def latest_run(fileroot: str = "", user: str = "") -> RunFiles:
    """The run under fileroot (default ./areal_runs) whose train.log or metrics.jsonl was written last."""
    root = os.path.abspath(os.path.expanduser(fileroot or os.path.join(os.getcwd(), "areal_runs")))
    user_dir = os.path.dirname(os.path.dirname(run_paths(root, "_", "_", user or None).log_dir))  # {root}/logs/{user}
    best: tuple[float, str] | None = None
    for exp in sorted(os.listdir(user_dir)) if os.path.isdir(user_dir) else []:
        for trial in sorted(os.listdir(os.path.join(user_dir, exp))) if os.path.isdir(os.path.join(user_dir, exp)) else []:
            d = os.path.join(user_dir, exp, trial)
            times = [os.path.getmtime(f) for f in (os.path.join(d, "train.log"), os.path.join(d, "metrics.jsonl"))
                     if os.path.exists(f)]
            if times and (best is None or max(times) > best[0]):
                best = (max(times), f"{exp}/{trial}")
    if best is None:
        raise UserError(f"no run under {user_dir}; name one: a run's log folder or EXP/TRIAL (with --fileroot/--user "
                        "of the run)")
    return resolve_run(best[1], root, user)


# ------------------------------------------------------------------ reading
def step_rows(metrics_file: str) -> list[dict]:
    """metrics.jsonl rows, one per global step: a resumed run re-does the steps after its
    checkpoint, and the later row (the one the run continued from) wins."""
    by_step: dict[int, dict] = {}
    for row in read_metrics(metrics_file):
        if isinstance(row.get("global_step"), int):
            by_step[row["global_step"]] = row
    return [by_step[k] for k in sorted(by_step)]


@dataclass
class Status:
    files: RunFiles
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    rows: list = field(default_factory=list)
    recover: Checkpoint | None = None  # the newest complete recover checkpoint
    saves: list = field(default_factory=list)
    eta: float | None = None
    eta_time: float | None = None
    state: str = "unknown"  # running | finished | failed | interrupted | dead | probably running | probably dead | unknown
    why: str = ""
    relaunches: int = 0
    resumes: int = 0
    last_lines: list = field(default_factory=list)

    @property
    def last(self) -> dict | None:
        return self.rows[-1] if self.rows else None


def read_status(files: RunFiles, now: float | None = None, tail: int = 5) -> Status:
    from areal_kit.rl.checkpoint import store as recover

    now = now or time.time()
    st = Status(files)
    st.rows = step_rows(files.metrics_file)
    lines = _read_lines(files.log_file)
    started_at = 0
    for i, line in enumerate(lines):
        if run := parse_run(line):
            st.total_steps, st.steps_per_epoch, started_at = run.total_steps, run.steps_per_epoch, i
    finished, failed, interrupted = False, "", ""
    for line in lines[started_at:]:
        if (step := parse_epoch(line)) and step.eta is not None and (at := line_time(line)) is not None:
            st.eta, st.eta_time = step.eta, at
        finished = finished or parse_finished(line) is not None
        failed = parse_failed(line) or failed
        if stop := parse_stopped(line):
            interrupted = stop.signame
        st.relaunches += parse_relaunch(line) is not None
        st.resumes += parse_resume(line) is not None
    st.last_lines = lines[-tail:] if tail > 0 else []
    if files.recover_dir:
        st.recover = recover.latest(files.recover_dir)
    actor = os.path.join(files.ckpt_dir, "actor") if files.ckpt_dir else ""
    if actor and os.path.isdir(actor):
        st.saves = sorted((d for d in os.listdir(actor) if step_of(d) >= 0), key=step_of)
    if failed or interrupted:
        st.state, st.why = ("failed", failed) if failed else ("interrupted", interrupted)
    else:
        st.state, st.why = _liveness(files, st, finished, now)
    return st


def _liveness(files: RunFiles, st: Status, finished: bool, now: float) -> tuple[str, str]:
    if finished:
        return "finished", ""
    info = read_json(os.path.join(files.log_dir, "driver.json")) or {}
    pid, host = info.get("pid"), info.get("host")
    if pid and host == socket.gethostname():
        if _pid_alive(int(pid)):
            return "running", f"driver pid {pid} on {host}"
        return "dead", f"driver pid {pid} on {host} is gone"
    # Another machine: judge by the last write. A step can be long; allow 5 median steps.
    mtimes = [os.path.getmtime(f) for f in (files.log_file, files.metrics_file) if os.path.exists(f)]
    if not mtimes:
        return "unknown", "no log files"
    idle = now - max(mtimes)
    times = sorted(r.get("e2e_time", 0.0) for r in st.rows[-20:]) or [0.0]
    limit = max(600.0, 5 * times[len(times) // 2])
    where = f" on {host}" if host else ""
    if idle < limit:
        return "probably running", f"last write {_dur(idle)} ago{where}"
    return "probably dead", f"no write for {_dur(idle)}{where}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a recycled pid belongs to some other program
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        return b"areal" in cmd or b"python" in cmd
    except OSError:
        return True


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _dur(s: float) -> str:
    s = max(0, int(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


# ------------------------------------------------------------------ rendering
def summary_lines(st: Status, now: float | None = None) -> list[str]:
    now = now or time.time()
    f, last = st.files, st.last
    out = [f"run        {f.name}  ({f.log_dir})"]
    state = st.state + (f" ({st.why})" if st.why else "")
    if st.relaunches or st.resumes:
        state += f"; resumed {st.resumes}x, relaunched after failures {st.relaunches}x"
    out.append(f"state      {state}")
    total = f"/{st.total_steps}" if st.total_steps else ""
    if last:
        ep = f"epoch {last.get('epoch', '?')} step {last.get('epoch_step', '?')}"
        if st.steps_per_epoch:
            ep += f"/{st.steps_per_epoch}"
        reward = last.get("task_reward")
        reward_s = f", task_reward {reward:.4f}" if isinstance(reward, (int, float)) else ""
        out.append(f"last step  {last['global_step']}{total} ({ep}){reward_s}, "
                   f"{_dur(now - last.get('time', now))} ago")
    else:
        out.append(f"last step  none yet{' (of ' + str(st.total_steps) + ')' if st.total_steps else ''}")
    if st.recover is not None:
        t = st.recover.state.get("time")
        ago = f", {_dur(now - t)} ago" if t else ""
        out.append(f"recover    global step {st.recover.global_step}{ago}: {st.recover.path}")
    else:
        out.append("recover    no recover checkpoint yet (the first is written after global step 2)")
    if st.saves:
        more = f" (+{len(st.saves) - 1} earlier)" if len(st.saves) > 1 else ""
        out.append(f"saved      {os.path.join(f.ckpt_dir, 'actor', st.saves[-1])}{more}")
    if st.state == "finished":
        out.append("eta        done")
    elif st.eta is not None and st.eta_time is not None:
        left = st.eta - (now - st.eta_time) if "running" in st.state else st.eta
        note = "" if "running" in st.state else " when it was last running"
        out.append(f"eta        {_dur(max(left, 0))}{note}")
    else:
        out.append("eta        unknown (shown from global step 3 on)")
    if st.state in STOPPED and st.recover is not None:
        out.append(f"resume     re-run the same `areal-kit train` command: it resumes at global step "
                   f"{st.recover.global_step + 1}")
    return out


# ------------------------------------------------------------------ commands
@dataclass
class RunRoot:
    """Where a run given as EXP/TRIAL lives: logs' and plot's --fileroot and --user."""

    fileroot: str = flag("", "--fileroot", help="Root the run was started with (default ./areal_runs); used with "
                         "EXP/TRIAL.")
    user: str = flag("", "--user", help="User folder of the run (default $AREAL_USER or your login); used with "
                     "EXP/TRIAL.")


@command(params(RunRoot))
def logs(
    run: str = typer.Argument(..., help="The run: its log folder ({fileroot}/logs/{user}/{exp}/{trial}, with "
                                        "train.log) or EXP/TRIAL under --fileroot."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new log lines until the run "
                                                              "finishes or dies (Ctrl-C stops watching)."),
    plot_: bool = typer.Option(False, "--plot", help="Draw the task_reward curve in the terminal (plotext)."),
    tail: int = typer.Option(5, "--tail", "-n", help="Show this many last lines of train.log (0 = none)."),
    interval: float = typer.Option(2.0, "--interval", help="Seconds between checks with --follow."),
    samples: bool = typer.Option(False, "--samples", help="Show the latest dumped rollout samples (prompt, answer, "
                                                          "reward, advantage; exp_ctrl.dump_samples_every)."),
    **given: str,
) -> None:
    """Where a run stands, from its files alone: last step, last recover point, ETA, alive or dead."""
    root = build(RunRoot, given)
    files = resolve_run(run, root.fileroot, root.user)
    st = read_status(files, tail=tail)
    console = make_console(highlight=False)
    for line in summary_lines(st):
        console.out(line)
    from areal_kit.slurm.cmd import run_job_lines  # here: the Slurm side is not for `--help`

    for line in run_job_lines(files.log_dir):
        console.out(line)
    if plot_:
        # Colours only where the console writes them (a terminal without NO_COLOR).
        color = console.is_terminal and not console.no_color
        plot = curves.terminal_plot(st.rows, width=console.width if console.is_terminal else 80, color=color)
        console.print(Text.from_ansi(plot), soft_wrap=True)
    if samples:
        print_samples(files, console)
    if st.last_lines and not follow:
        console.out("--- last lines of train.log")
        console.out("\n".join(st.last_lines))
    if follow:
        _follow(files, st, interval, console)


def latest_samples(path: str) -> list[dict]:
    """The rows of the last step in samples.jsonl (a torn last line is skipped)."""
    rows = read_metrics(path)  # the same reader: one JSON row a line
    last = rows[-1]["global_step"] if rows else None
    return [r for r in rows if r["global_step"] == last]


def print_samples(files: RunFiles, console: Console) -> None:
    rows = latest_samples(files.samples_file)
    if not rows:
        console.out(f"--- no samples yet ({files.samples_file}; written every exp_ctrl.dump_samples_every steps)")
        return
    t = Table(title=f"samples of global step {rows[0]['global_step']}")
    for col in ("prompt", "answer", "task_reward", "seq_reward", "no_eos"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["prompt"], r["answer"], f"{r['task_reward']:g}", f"{r.get('seq_reward', r.get('advantage', 0.0)):+.3f}", str(r["no_eos"]).lower())
    console.print(t)


def _follow(files: RunFiles, st: Status, interval: float, console: Console) -> None:
    console.out("--- following train.log (Ctrl-C stops watching; the run is not affected)")
    console.out("\n".join(st.last_lines))
    pos = os.path.getsize(files.log_file) if os.path.exists(files.log_file) else 0
    try:
        while True:
            time.sleep(interval)
            if os.path.exists(files.log_file):
                with open(files.log_file, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                if chunk:
                    console.out(chunk, end="")
            st = read_status(files, tail=0)
            if st.state == "finished" or st.state in STOPPED:
                break
    except KeyboardInterrupt:
        pass
    console.out("---")
    for line in summary_lines(st):
        console.out(line)


@command(params(RunRoot))
def plot(
    run: str = typer.Argument(..., help="The run: its log folder (with metrics.jsonl) or EXP/TRIAL under "
                                        "--fileroot."),
    output: str = typer.Option("", "--output", "-o", help="PNG file to write (default: metrics.png in the "
                                                          "run's log folder)."),
    smooth: int = typer.Option(1, "--smooth", min=1, help="Also draw a moving average over this many steps "
                                                          "(1 = raw values only)."),
    **given: str,
) -> None:
    """Plot task_reward, response length, KL and entropy per step to a PNG (matplotlib).

    The in-training eval (pass@1, avg@k, pass@k), each dataset.mix source's task reward and the
    share of episodes that call a tool (episode/tool_call_share) get panels of their own when the
    run logged them."""
    root = build(RunRoot, given)
    files = resolve_run(run, root.fileroot, root.user)
    rows = step_rows(files.metrics_file)
    if not rows:
        raise UserError(f"no steps in {files.metrics_file} yet; expected a run that finished global step 1")
    out = os.path.abspath(output or os.path.join(files.log_dir, "metrics.png"))
    curves.write_png(rows, out, files.name, smooth)
    make_console(highlight=False).out(f"Wrote {out} ({len(rows)} steps, global step {rows[0]['global_step']}..{rows[-1]['global_step']})")

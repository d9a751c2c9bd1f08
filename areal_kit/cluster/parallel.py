"""Run provisioning steps on every host in parallel; show ok/changed/failed live, then a recap.

A step is a function ``fn(cluster, host) -> Outcome``. Steps run in order; within a step all
hosts run in parallel (``head_first`` steps run on the head first, then on the others, and
``head_only`` ones only on the head). A host that fails a step drops out of the later steps
(reported "skipped") while the other hosts go on, as Ansible does; a ``gate`` step that fails
on the head stops them all. A step that fails raises
StepFailed with the command result, so the recap can name host, step, command, exit code and
the last lines of output, plus the host's log file.

On a terminal the progress is a rich live table (hosts x steps); otherwise (CI, pipes) it is
one line per host and step: ``changed: [node1] ray: head started``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.remote import HostLog, Result
from areal_kit.console import make_console
from areal_kit.errors import ExitCode

STATUS_STYLE = {"ok": "green", "changed": "yellow", "failed": "bold red", "skipped": "dim",
                "running": "cyan", "pending": "dim"}


class StepFailed(Exception):
    """Raised by a step: the message says what failed and what to do; result is the command."""

    def __init__(self, message: str, result: Result | None = None):
        super().__init__(message)
        self.result = result


@dataclass
class Step:
    name: str
    fn: Callable  # fn(cluster, host) -> Outcome
    head_first: bool = False
    head_only: bool = False
    head_last: bool = False  # e.g. teardown: workers first, then the head
    gate: bool = False  # with head_only/head_first: failed on the head, it stops every host (a preset
    # that cannot run on these nodes makes installing them pointless)


def host_log(h: HostState) -> HostLog | None:
    """The host's log file, where its connection keeps one (a dry run's does not)."""
    log: HostLog | None = getattr(h.remote, "log", None)
    return log


class Display:
    """Live table on a terminal, one line per event elsewhere."""

    def __init__(self, hosts: list[HostState], steps: list[Step], console: Console):
        self.hosts, self.steps, self.console = hosts, steps, console
        self.lock = threading.Lock()
        self.running: dict[tuple[str, str], float] = {}
        self.live = Live(self._table(), console=console, refresh_per_second=4, transient=True) \
            if console.is_terminal else None

    def _table(self) -> Table:
        t = Table(title="areal-kit setup", show_lines=False)
        t.add_column("host")
        for s in self.steps:
            t.add_column(s.name)
        for h in self.hosts:
            cells = []
            for s in self.steps:
                o = h.outcomes.get(s.name)
                if o:
                    cells.append(f"[{STATUS_STYLE[o.status]}]{o.status}[/]")
                elif (h.name, s.name) in self.running:
                    cells.append(f"[cyan]running {time.monotonic() - self.running[(h.name, s.name)]:.0f}s[/]")
                else:
                    cells.append("[dim]-[/]")
            t.add_row(escape(h.name), *cells)
        return t

    def __enter__(self) -> Self:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.live:
            self.live.update(self._table())
            self.live.__exit__(exc_type, exc, tb)

    def started(self, host: HostState, step: Step) -> None:
        with self.lock:
            self.running[(host.name, step.name)] = time.monotonic()
            if self.live:
                self.live.update(self._table())

    def finished(self, host: HostState, step: Step, o: Outcome) -> None:
        with self.lock:
            self.running.pop((host.name, step.name), None)
            if self.live:
                self.live.update(self._table())
            else:
                style = STATUS_STYLE[o.status]
                msg = f": {escape(o.message)}" if o.message else ""
                self.console.print(f"[{style}]{o.status}[/]: {escape(f'[{host.name}]')} {step.name}{msg} "
                                   f"[dim]({o.seconds:.1f}s)[/]", highlight=False, soft_wrap=True)


def run_steps(cluster: Cluster, steps: list[Step], console: Console | None = None) -> bool:
    """Run all steps; return True when no host failed any step."""
    console = console or make_console(highlight=False)
    hosts = cluster.hosts

    def one(h: HostState, step: Step) -> None:
        display.started(h, step)
        t0 = time.monotonic()
        try:
            o = step.fn(cluster, h)
        except StepFailed as e:
            o = Outcome("failed", str(e), e.result)
        except Exception as e:  # noqa: BLE001 - a bug or an unexpected remote error must not kill the others
            o = Outcome("failed", f"{type(e).__name__}: {e}")
        o.seconds = time.monotonic() - t0
        h.outcomes[step.name] = o
        log = host_log(h)
        if o.status == "failed" and log:
            log.write(f"FAILED {step.name}: {o.message}")
        display.finished(h, step, o)

    def skip_all(hs: list[HostState], step: Step, why: str) -> None:
        for h in hs:
            h.outcomes[step.name] = Outcome("skipped", why)
            display.finished(h, step, h.outcomes[step.name])

    with Display(hosts, steps, console) as display, ThreadPoolExecutor(max(1, len(hosts))) as pool:
        stopped = ""  # why every host stops: a gate step failed on the head
        for step in steps:
            if stopped:
                skip_all([h for h in hosts if step.name not in h.outcomes], step, stopped)
                continue
            live = [h for h in hosts if not h.failed]
            skip_all([h for h in hosts if h.failed and step.name not in h.outcomes], step,
                     "host failed an earlier step")
            if not live:
                continue
            head = hosts[0]
            if step.head_only or step.head_first:
                if head.failed:
                    skip_all(live, step, f"head {head.name} failed an earlier step")
                    continue
                one(head, step)
                if step.gate and head.outcomes[step.name].status == "failed":
                    stopped = f"{step.name} failed on the head"
                if step.head_only:
                    skip_all([h for h in live if h is not head], step, "head only")
                    continue
                rest = [h for h in live if h is not head]
                if head.outcomes[step.name].status == "failed" and head.outcomes[step.name].blocking:
                    skip_all(rest, step, f"head {head.name} failed this step")
                    continue
                live = rest
            if step.head_last and hosts[0] in live:
                list(pool.map(one, [h for h in live if h is not hosts[0]], [step] * len(live)))
                live = [hosts[0]]
            list(pool.map(one, live, [step] * len(live)))
    recap(cluster, steps, console)
    return not any(h.any_failed for h in hosts)


def recap(cluster: Cluster, steps: list[Step], console: Console) -> None:
    """Closing table (per host counts and where it failed), then each failure in detail."""
    t = Table(title="recap")
    for col in ("host", "ok", "changed", "failed", "skipped", "result"):
        t.add_column(col)
    for h in cluster.hosts:
        counts = {k: sum(o.status == k for o in h.outcomes.values()) for k in STATUS_STYLE}
        bad = next(((s, o) for s, o in h.outcomes.items() if o.status == "failed"), None)
        result = f"[red]FAILED at {bad[0]}[/]" if bad else "[green]ok[/]"
        t.add_row(escape(h.name), str(counts["ok"]), str(counts["changed"]), str(counts["failed"]),
                  str(counts["skipped"]), result)
    console.print(t)
    for h in cluster.hosts:
        for s, o in h.outcomes.items():
            if o.status != "failed":
                continue
            log = host_log(h)
            redact = log.redact if log else (lambda x: x)
            console.print(f"[bold red]FAILED[/] {escape(f'[{h.name}] {s}: {redact(o.message)}')}", soft_wrap=True)
            if o.result is not None:
                console.print(f"  command: {redact(o.result.cmd)}", soft_wrap=True, markup=False)
                console.print(f"  exit code: {o.result.rc}")
                tail = redact(o.result.tail(8))
                if tail:
                    console.print("  last output:\n" + "\n".join("    " + ln for ln in tail.splitlines()),
                                  markup=False, soft_wrap=True)
            if h.log_path:
                console.print(f"  log: {h.log_path}", markup=False)


def dry_run(cluster: Cluster, steps: list[Step], console: Console) -> ExitCode:
    """Every command the steps would run, per host, without running one: the steps in order, each on
    the hosts it runs on, head first, as a real run issues them. A step that fails (setup's preset
    gate) ends the list with why the run would stop there."""
    try:
        for step in steps:
            for h in cluster.hosts:
                if h.is_head or not step.head_only:
                    step.fn(cluster, h)
    except StepFailed as e:
        print_dry_run(cluster, console)
        console.print(f"FAILED {e}", markup=False, soft_wrap=True)
        return ExitCode.FAILED
    print_dry_run(cluster, console)
    return ExitCode.OK


def print_dry_run(cluster: Cluster, console: Console | None = None) -> None:
    console = console or make_console(highlight=False)
    for h in cluster.hosts:
        console.print(f"[bold]# {escape(h.name)}[/] ({'head' if h.is_head else 'worker'})")
        for kind, cmd in h.dry.commands:
            console.print(f"  [{kind}] {cmd}", markup=False, soft_wrap=True)
    sys.stdout.flush()

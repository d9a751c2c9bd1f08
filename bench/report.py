"""Benchmark results: one JSON line and a rich table each, bench/results/latest.json, PERFORMANCE.md.

A benchmark is a function returning a `Result`; `run_all` runs the chosen ones in order and is
what `python bench/run.py` calls. latest.json keeps every benchmark's newest figures, so running
one benchmark updates its entry and leaves the others; PERFORMANCE.md (docs/performance.md's
"Performance" section) is regenerated from it after each benchmark. Every record carries the
machine it ran on (bench/machine.py) under "machine", and PERFORMANCE.md lists the runs of every
bench/results/*.json per machine.

    from bench.report import Result, run_all
    run_all({"demo": lambda: Result("demo", "Demo", {"a_s": 1.0}, ratio=2.0, target=1.5)},
            ["demo"], out_dir="bench/results")
"""

from __future__ import annotations

import datetime as _dt
import glob
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.machine import describe, kind, label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
PERFORMANCE_MD = os.path.join(ROOT, "bench", "PERFORMANCE.md")


@dataclass
class Result:
    name: str  # registry key: `python bench/run.py NAME`
    title: str  # one line: what is compared with what
    figures: dict  # flat numbers (and short strings) that go to latest.json
    ratio: float | None = None  # ours / baseline, higher is better
    target: float | None = None  # the ratio we aim for (None: reported, no target)
    columns: list[str] = field(default_factory=list)  # the table: header ...
    rows: list[list] = field(default_factory=list)  # ... and one list per row
    notes: list[str] = field(default_factory=list)  # caveats worth a reader's time
    # Secondary targets, by what they say ("broadcast within 2x of raw": True/False).
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None if not self.checks else all(self.checks.values())
        return self.ratio >= self.target and all(self.checks.values())

    def record(self, machine: dict | None = None) -> dict:
        """The latest.json entry: figures, ratio, target, whether met, and when and where (figures
        mean little without their machine; `machine` is describe() as taken before the run)."""
        return {**self.figures, "ratio": _round(self.ratio), "target": self.target, "met": self.met,
                "checks": self.checks, "title": self.title, "columns": self.columns, "rows": _round(self.rows),
                "notes": self.notes, "measured_at": _dt.datetime.now().isoformat(timespec="seconds"),
                "machine": machine or describe()}


def _round(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, list):
        return [_round(x) for x in v]
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return v


def table(res: Result) -> Table:
    t = Table(show_lines=False)
    for c in res.columns:
        t.add_column(str(c))
    for r in res.rows:
        t.add_row(*[escape(_fmt(x)) for x in r])  # a cell's [brackets] are text, not style
    return t


def verdict(res: Result) -> str:
    """One line: the ratio, the target, the secondary checks, met or missed."""
    if res.ratio is None:
        return "no ratio"
    line = f"ratio {res.ratio:.2f}x" + (f" (target >= {res.target}x)" if res.target is not None else " (no target)")
    line += "".join(f"; {k}: {'yes' if v else 'NO'}" for k, v in res.checks.items())
    if res.met is not None:
        line += "  [green]target met[/]" if res.met else "  [red]target missed[/]"
    return line


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:,.3f}" if abs(x) < 100 else f"{x:,.1f}"
    return str(x)


def load_latest(out_dir: str = RESULTS_DIR) -> dict:
    path = os.path.join(out_dir, "latest.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save_latest(latest: dict, out_dir: str = RESULTS_DIR) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "latest.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(latest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # a crash mid-write keeps the previous results
    return path


def run_all(registry: dict[str, Callable[[], Result]], names: list[str], out_dir: str = RESULTS_DIR,
            markdown_path: str | None = PERFORMANCE_MD, about: dict[str, str] | None = None,
            console: Console | None = None, intro: str = "") -> dict[str, dict]:
    """Run each named benchmark; print its JSON line and table; merge into latest.json.

    A benchmark that raises is reported (JSON line with "error") and the others still run; its
    previous entry in latest.json stays. Returns {name: record or {"error": ...}}.
    """
    # Logs and pipes get 80 columns by default, too narrow for a 10-column table.
    console = console or Console(width=None if sys.stdout.isatty() else 150)
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    done: dict[str, dict] = {}
    for name in names:
        # Described before the benchmark starts: its load average is the machine's, not the benchmark's own.
        where = describe()
        try:
            res = registry[name]()
        except Exception as e:  # noqa: BLE001 (report and go on: one broken benchmark must not hide the rest)
            err = f"{type(e).__name__}: {e}"
            print(json.dumps({"name": name, "error": err}), flush=True)
            console.print(f"[red]{name} failed[/]: {err}")
            console.print(traceback.format_exc(), markup=False, highlight=False)
            done[name] = {"error": err}
            continue
        rec = res.record(where)
        print(json.dumps({"name": name, **{k: v for k, v in rec.items() if k not in ("columns", "rows")}}),
              flush=True)
        console.print(f"[bold]{name}[/]: {res.title}", highlight=False)
        console.print(f"machine: {label(where)}", highlight=False, markup=False)
        console.print(table(res))
        console.print(verdict(res), highlight=False)
        for n in res.notes:
            console.print(f"  note: {n}", highlight=False)
        latest = load_latest(out_dir)
        latest[name] = rec
        save_latest(latest, out_dir)
        if markdown_path:
            write_markdown(latest, markdown_path, about or {}, intro, results_dir=out_dir)
        done[name] = rec
    return done


def write_markdown(latest: dict, path: str, about: dict[str, str], intro: str = "",
                   results_dir: str = RESULTS_DIR) -> str:
    """The "Performance" page (docs/performance.md) from latest.json: a summary, one part per benchmark, and the
    runs of every results_dir/*.json per machine."""
    lines = ["## Performance", ""] + ([intro.strip(), ""] if intro else [])
    lines += ["| benchmark | ours vs baseline | ratio | target | machine |", "|---|---|---|---|---|"]
    order = list(about) + [n for n in latest if n not in about]
    for name in order:
        rec = latest.get(name)
        if not rec:
            continue
        lines.append(f"| [{name}](#{name.replace('_', '-')}) | {rec.get('title', '')} | {_ratio(rec)} | "
                     f"{_target(rec)} | [{_machine_key(rec)}](#runs-per-machine) |")
    for name in order:
        rec = latest.get(name)
        if not rec:
            continue
        lines += ["", f"### {name.replace('_', '-')}", ""]
        if about.get(name):
            lines += [about[name].strip(), ""]
        lines += [f"Command: `python bench/run.py {name}` — measured {rec.get('measured_at', '?')}.", "",
                  f"machine: {label(rec.get('machine'))}", ""]
        if rec.get("columns"):
            lines += [*_md_table(rec["columns"], rec.get("rows") or []), ""]
        for n in rec.get("notes") or []:
            lines.append(f"- {n}")
    lines += ["", *_runs_per_machine(results_dir)]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return path


def _ratio(rec: dict) -> str:
    return "-" if rec.get("ratio") is None else f"{rec['ratio']:.2f}x"


def _target(rec: dict) -> str:
    tgt = "reported" if rec.get("target") is None else f">= {rec['target']}x"
    tgt += "".join(f", {k}" for k in rec.get("checks") or {})
    if rec.get("met") is not None:
        tgt += " (met)" if rec["met"] else " (**not met**)"
    return tgt


# Records from before the machine description kept a line ("x86_64 2 CPUs, load ..."), or nothing.
OLDER = "older record"


def _machine_key(rec: dict) -> str:
    m = rec.get("machine")
    return m.get("id", "?") if isinstance(m, dict) else OLDER


def recorded_runs(results_dir: str = RESULTS_DIR) -> list[tuple[str, str, dict]]:
    """(file, benchmark, record) for every record in results_dir/*.json ({name: record}, as latest.json),
    oldest first; a run found in two files (a copy kept aside) is listed once."""
    runs, seen = [], set()
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        for name, rec in data.items() if isinstance(data, dict) else ():
            if not isinstance(rec, dict) or "measured_at" not in rec:
                continue
            key = (name, rec["measured_at"], json.dumps(rec.get("machine"), sort_keys=True))
            if key not in seen:
                seen.add(key)
                runs.append((os.path.basename(path), name, rec))
    return sorted(runs, key=lambda r: r[2]["measured_at"])


def _runs_per_machine(results_dir: str) -> list[str]:
    runs = recorded_runs(results_dir)
    lines = ["### Runs per machine", "",
             ("Every result records the machine it ran on (bench/machine.py): CPU model, the CPU flags torch's "
              "kernels pick from, the cores the run could use, memory, kernel, Python and torch, and the load "
              "average when it started. Runs with the same CPU model, flags and cores share an id. Listed from "
              f"bench/results/*.json (latest.json keeps each benchmark's newest run). An \"{OLDER}\" predates "
              "the machine field: it kept only a line naming the architecture, CPU count, load and Python, so "
              "its CPU model and flags are unknown (and its \"load at start\" was read as the benchmark ended)."), ""]
    machines: dict[str, list] = {}
    for run in runs:
        machines.setdefault(_machine_key(run[2]), []).append(run)
    for key, group in sorted(machines.items(), key=lambda kv: kv[0] == OLDER):  # the described ones first
        if key == OLDER:
            lines += [f"**{OLDER}s**, before the machine field:", ""]
            lines += _md_table(["benchmark", "ratio", "target", "measured", "recorded as", "file"],
                               [[name, _ratio(rec), _target(rec), rec["measured_at"], rec.get("machine") or "?", file]
                                for file, name, rec in group])
        else:
            m = group[-1][2]["machine"]
            lines += [f"**{key}**: {kind(m)} ({m.get('arch', '?')})", ""]
            lines += _md_table(["benchmark", "ratio", "target", "measured", "load at start", "memory GB", "kernel",
                                "Python", "torch", "file"],
                               [[name, _ratio(rec), _target(rec), rec["measured_at"]]
                                + [_cell(rec["machine"].get(k)) for k in ("load", "memory_gb", "kernel", "python",
                                                                          "torch")]
                                + [file] for file, name, rec in group])
        lines.append("")
    return lines if runs else lines + ["No results recorded yet."]


def _cell(v) -> str:
    return "-" if v is None else str(v)  # as recorded: _fmt would print a load of 1.9 as 1.900


def _md_table(columns: list, rows: list[list]) -> list[str]:
    return (["| " + " | ".join(str(c) for c in columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(_fmt(x) for x in r) + " |" for r in rows])


def main_args(argv: list[str] | None, registry: dict) -> list[str]:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: python bench/run.py [NAME ...] | --list | --markdown   (NAME in: {' '.join(registry)})")
        raise SystemExit(0)
    if "--list" in args:
        print("\n".join(registry))
        raise SystemExit(0)
    return [a for a in args if not a.startswith("--")] or list(registry)

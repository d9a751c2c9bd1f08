"""The machine a benchmark ran on: bench/machine.py's description, and the shared result writer recording it.

No benchmark runs: the writer is driven with a plain function returning a Result.
"""

import importlib.metadata
import io
import json
import os
import platform
import re
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import machine
from bench.report import Result, load_latest, recorded_runs, run_all, save_latest

KEYS = {"id", "model", "arch", "flags", "cores", "memory_gb", "kernel", "python", "torch", "load"}


def test_describes_this_machine():
    m = machine.describe()
    assert set(m) == KEYS
    assert m["model"].strip()
    assert m["arch"] == platform.machine()
    assert set(m["flags"]) <= set(machine.KERNEL_FLAGS)
    assert m["flags"] == [f for f in machine.KERNEL_FLAGS if f in m["flags"]]  # listed in a fixed order
    assert 1 <= m["cores"] <= os.cpu_count()
    assert m["memory_gb"] > 0.1
    assert m["kernel"].startswith(platform.system())
    assert m["python"] == platform.python_version()
    assert m["torch"] == importlib.metadata.version("torch")
    assert re.fullmatch(r"[0-9a-f]{8}", m["id"])
    assert m["id"] == machine.machine_id(m["model"], m["flags"], m["cores"])
    assert machine.describe()["id"] == m["id"]  # stable: the load moves, the id does not
    assert json.loads(json.dumps(m)) == m  # goes into JSON as it is
    assert m["id"] in machine.label(m) and m["model"] in machine.label(m)


def test_cpuinfo_keeps_the_model_and_the_kernel_flags_only(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse2 amx_int8 avx2 avx512f amx_tile avx512_vnni\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    model, flags = machine._cpuinfo(str(info))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]
    assert machine._cpuinfo(str(tmp_path / "missing")) == ("", [])


def test_id_groups_one_kind_of_machine():
    same = machine.machine_id("AMD EPYC", ["avx2"], 2)
    assert same == machine.machine_id("AMD EPYC", ["avx2"], 2)
    assert same != machine.machine_id("AMD EPYC", ["avx2"], 4)
    assert same != machine.machine_id("AMD EPYC", ["avx2", "avx512f"], 2)
    assert same != machine.machine_id("Intel Xeon", ["avx2"], 2)


def test_the_shared_writer_records_the_machine(tmp_path, capsys):
    # A result from before the field, kept aside beside the new one: listed apart, not lost.
    save_latest({"old": {"ratio": 3.0, "target": 2.0, "met": True, "title": "t",
                         "measured_at": "2020-01-01T00:00:00", "machine": "x86_64 2 CPUs, Python 3.11.7"}},
                str(tmp_path / "aside"))
    os.replace(tmp_path / "aside" / "latest.json", tmp_path / "2020.json")
    out = io.StringIO()
    demo = Result("demo", "demo vs baseline", {"ours_s": 1.0}, ratio=2.0, target=1.5, columns=["side", "s"],
                  rows=[["ours", 1.0]])
    run_all({"demo": lambda: demo}, ["demo"], out_dir=str(tmp_path), markdown_path=str(tmp_path / "PERF.md"),
            console=Console(file=out, width=200, color_system=None))
    this = machine.describe()

    rec = load_latest(str(tmp_path))["demo"]
    assert set(rec["machine"]) == KEYS
    assert rec["machine"]["id"] == this["id"]
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["machine"]["id"] == this["id"] and line["ratio"] == 2.0
    assert f"machine: {this['model']}" in out.getvalue() and f"[{this['id']}]" in out.getvalue()

    md = (tmp_path / "PERF.md").read_text()
    runs = md[md.index("### Runs per machine"):]
    assert f"**{this['id']}**: {this['model']}" in runs
    assert re.search(r"\| demo \| 2\.00x \| >= 1\.5x \(met\) \| .* \| latest\.json \|", runs)
    assert "**older records**" in runs and "| old | 3.00x |" in runs and "2020.json" in runs
    assert runs.index(this["id"]) < runs.index("older records")
    assert f"machine: {this['model']}" in md  # the demo table's header line
    assert [(f, n) for f, n, _ in recorded_runs(str(tmp_path))] == [("2020.json", "old"), ("latest.json", "demo")]

    assert Result("x", "x", {}).record()["machine"]["id"] == this["id"]  # the record itself, outside run_all too


def test_steal_is_the_share_of_cpu_time_other_guests_took_between_two_readings(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 50 0 25 400 5 0 2 17 0 0\n")
    before = machine.cpu_ticks(str(stat))
    assert before == (35, 1000)
    stat.write_text("cpu  200 0 100 1500 10 0 5 185 0 0\n")
    after = machine.cpu_ticks(str(stat))
    assert machine.steal_share(before, after) == 0.15  # 150 of the 1000 ticks in between
    assert machine.steal_share(after, before) is None  # readings out of order: no figure
    assert machine.cpu_ticks(str(tmp_path / "absent")) is None
    assert machine.steal_share(None, after) is None
    assert machine.cpu_ticks("/proc/stat") is not None or not os.path.exists("/proc/stat")

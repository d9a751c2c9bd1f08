"""What machine a benchmark ran on: CPU model, the vector flags torch's CPU kernels use, cores, memory.

Every result in bench/results carries `describe()` under "machine" (bench/report.py records it), and
PERFORMANCE.md groups the runs by its "id": the same CPU model, flags and usable cores give the same
id, so runs on one kind of machine list together whichever host they ran on.

    python bench/machine.py        # this machine's description, as the results record it

Standard library only: torch's version is read from its installed metadata, not imported (an import
takes seconds, and the runner must not load torch before a benchmark sets up its threads).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform

# The x86 flags that pick torch's CPU kernels (ATen's AVX2/AVX512 builds, oneDNN's bf16/VNNI/AMX
# paths), in the order they are listed; /proc/cpuinfo has hundreds more that change nothing here.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """The first CPU's model name and which of KERNEL_FLAGS it has ("", [] where there is no cpuinfo)."""
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, [f for f in KERNEL_FLAGS if f in flags]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not what the host has
    except AttributeError:  # no affinity call (macOS)
        return os.cpu_count() or 1


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot; None where there is no /proc/stat."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is counted in user already)
    ticks = [int(v) for v in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the CPUs' time between two cpu_ticks() that the hypervisor gave to other guests:
    on a shared host the same work then takes longer, a side of a ratio more than the other."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 4)


def machine_id(model: str, flags: list[str], cores: int) -> str:
    """8 hex digits naming the kind of machine; the host's name, memory and versions stay out of it."""
    return hashlib.sha1(f"{model}|{' '.join(flags)}|{cores}".encode()).hexdigest()[:8]


def describe() -> dict:
    """This machine as a result records it; "load" is the 1-minute load average when it is called."""
    model, flags = _cpuinfo()
    model = model or platform.processor() or platform.machine()  # no "model name" line off x86
    cores = _cores()
    try:
        load = round(os.getloadavg()[0], 1)
    except OSError:
        load = None
    return {"id": machine_id(model, flags, cores), "model": model, "arch": platform.machine(), "flags": flags,
            "cores": cores, "memory_gb": _memory_gb(),
            "kernel": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": _version("torch"), "load": load}


def kind(m: dict) -> str:
    """What the id stands for: CPU model, usable cores and kernel flags."""
    return f"{m.get('model', '?')}, {m.get('cores', '?')} cores, {' '.join(m.get('flags') or []) or 'no AVX2'}"


def label(m: dict | str | None) -> str:
    """One line for a table's header. A string is a record older than the description: shown as it was."""
    if not isinstance(m, dict):
        return f"{m or '?'} (recorded before the machine description: no CPU model or flags)"
    line = kind(m)
    line += f", {m['memory_gb']:g} GB" if m.get("memory_gb") is not None else ""
    line += f", {m['kernel']}" if m.get("kernel") else ""
    line += f", Python {m.get('python', '?')}, torch {m.get('torch') or 'absent'}"
    line += f", load {m['load']:.1f} at start" if m.get("load") is not None else ""
    return line + f" [{m.get('id', '?')}]"


if __name__ == "__main__":
    print(json.dumps(describe(), indent=1))

"""Where the CPU goes in a tiny run, and the floor it sets on the step and on the time to learn.

`areal-kit train tiny` for 400 steps, as a user runs it, while every process's CPU time is read
from /proc five times a second; each process counts for its role: the driver (the command
itself), the rollout engine and the trainer (their Ray actors, from the moment the worker process
starts), and Ray's daemons with everything else the run starts. Two windows: the start-up (from
the command's start to its first step's start) and the steady steps (100-350). The floor: however
the work is placed, a step takes at least its CPU-seconds over the machine's cores, the start-up
likewise, and the run to the learning benchmark's target at least the start-up's floor plus the
step's floor times its steps to the target (read from that benchmark's latest run on this same
machine, where there is one).

    python bench/run.py cpu
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

from areal_kit.procs import stat_fields
from bench import engines, machine
from bench.report import Result, load_latest

ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
STEPS, STEADY = 400, (100, 350)
ROLES = ("driver", "rollout engine", "trainer", "Ray and the rest")
HZ = os.sysconf("SC_CLK_TCK")


def role(cmdline: str, pid: int, driver: int) -> str:
    """The role of a process of the run, by what Ray names its actors' processes."""
    if pid == driver:
        return "driver"
    if "ray::RolloutWorker" in cmdline:
        return "rollout engine"
    if "ray::TrainerWorker" in cmdline:
        return "trainer"
    return "Ray and the rest"


def _cmdline(pid: int) -> str:
    """A live process's command line ("" once it has ended)."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


class Sampler:
    """Every descendant of one process, sampled on a thread: for each pid its last command line
    (a Ray worker takes its actor's name once it runs one) and its CPU-seconds at each sample."""

    def __init__(self, root: int, every_s: float = 0.2):
        self.root, self.every_s = root, every_s
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.cmd: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        known = {self.root}
        while not self._stop.is_set():
            now, cpu = time.time(), {}
            procs = stat_fields()  # [state, ppid, ..., utime (11), stime (12), ...] of each pid
            grew = True
            while grew:  # descendants: a child is known once its parent is
                grew = False
                for pid, f in procs.items():
                    if pid not in known and int(f[1]) in known:
                        known.add(pid)
                        grew = True
            for pid in known & procs.keys():
                cpu[pid] = (int(procs[pid][11]) + int(procs[pid][12])) / HZ
                self.cmd[pid] = _cmdline(pid) or self.cmd.get(pid, "")
            self.samples.append((now, cpu))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def by_role(self, t0: float, t1: float) -> dict[str, float]:
        """CPU-seconds each role used between times t0 and t1, from each process's last sample
        before each: one that started after t0 counts from zero, one that ended before t1 keeps
        what it had used."""
        start: dict[int, float] = {}
        end: dict[int, float] = {}
        for t, cpu in self.samples:
            if t <= t0:
                start.update(cpu)
            if t <= t1:
                end.update(cpu)
        out = dict.fromkeys(ROLES, 0.0)
        for pid, c in end.items():
            out[role(self.cmd.get(pid, ""), pid, self.root)] += c - start.get(pid, 0.0)
        return out


def run() -> Result:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    workdir = tempfile.mkdtemp(prefix="bench-cpu-")
    cfg = load_config("tiny", [f"fileroot={workdir}"])
    path = resolve_model(cfg)  # built before the clock starts, as the learning benchmark's is
    done = engines.train_run(["tiny", f"actor.path={path}", f"exp_ctrl.total_train_steps={STEPS}"], workdir, "cpu",
                            timeout=1800, watch=Sampler)
    rows, t0, sampler = done["rows"], done["start"], done["watch"]
    here = machine.describe()
    cores = here["cores"]

    first = rows[0]["time"] - rows[0]["e2e_time"]
    a, b = rows[STEADY[0] - 1]["time"], rows[STEADY[1] - 1]["time"]
    n = STEADY[1] - STEADY[0]
    start_cpu, step_cpu = sampler.by_role(t0, first), sampler.by_role(a, b)
    start_up, step_s = first - t0, (b - a) / n
    cpu_step = sum(step_cpu.values()) / n
    floor = cpu_step / cores
    # The same work costs more or less CPU time as the host's other tenants come and go: the
    # spread over 50-step blocks says how far one run's floor holds for the next.
    blocks = [sum(sampler.by_role(rows[i - 1]["time"], rows[i + 49]["time"]).values()) / 50
              for i in range(STEADY[0], STEADY[1], 50)]
    figures = {"start_up_s": start_up, "start_up_cpu_s": sum(start_cpu.values()), "step_s": step_s,
               "step_cpu_s": cpu_step, "cores": cores, "step_floor_s": floor,
               "busy": cpu_step / (step_s * cores), "step_cpu_block_min_s": min(blocks),
               "step_cpu_block_max_s": max(blocks)}
    for r in ROLES:
        key = r.split()[-1] if r != "Ray and the rest" else "ray"
        figures[f"start_up_cpu_{key}"] = start_cpu[r]
        figures[f"step_cpu_{key}"] = step_cpu[r] / n
    rows_out = [[r, start_cpu[r], step_cpu[r] / n * 1000] for r in ROLES]
    rows_out.append(["all", sum(start_cpu.values()), cpu_step * 1000])
    notes = [(f"Start-up: {start_up:.1f} s from the command to its first step; steady steps {STEADY[0]}-{STEADY[1]}: "
              f"{step_s * 1000:.0f} ms each, the {cores} cores {figures['busy']:.0%} busy."),
             (f"The floor of a step on {cores} cores: {cpu_step * 1000:.0f} CPU-ms / {cores} = {floor * 1000:.0f} ms, "
              "whatever runs where; only less work lowers it."),
             (f"Over 50-step blocks the same step cost {min(blocks) * 1000:.0f}-{max(blocks) * 1000:.0f} CPU-ms: the "
              "machine's speed moves with the host's load, and the floor with it.")]
    learning = load_latest().get("learning", {})
    if learning.get("machine", {}).get("id") == here["id"] and learning.get("ours_steps_to_target"):
        steps, trl = learning["ours_steps_to_target"], learning["trl_wall_to_target"] or learning["trl_wall"]
        least = figures["start_up_cpu_s"] / cores + steps * floor
        figures.update(learning_steps=steps, learning_floor_s=least, learning_trl_s=trl, learning_best_ratio=trl / least)
        notes.append(f"The learning benchmark's latest run here took {steps} steps to its target and TRL {trl:.1f} s. "
                     f"At this run's cost, placed perfectly on {cores} cores, ours takes at least {least:.1f} s "
                     f"({figures['start_up_cpu_s']:.1f} CPU-s of start-up / {cores} + {steps} x {floor:.3f} s): "
                     f"a ratio of at most {trl / least:.2f}x.")
    return Result("cpu", "CPU-seconds of a tiny run by process role: start-up and steady step, and the floor they set",
                  figures, columns=["role", "start-up CPU s", "CPU ms per steady step"], rows=rows_out, notes=notes)

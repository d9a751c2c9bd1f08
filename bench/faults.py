"""Fault campaign: one tiny run, hit again and again at random moments, must finish with every step once.

Each fault lands at a random moment (seeded) a few steps after the run last resumed: the middle of
a generation, a train step, a weight sync or a recover checkpoint's write. The kinds:
  driver-sigkill   the driver is SIGKILLed (and its Ray processes with it); the same command is re-run
  driver-sigterm   the driver is SIGTERMed (a scheduler's stop); the same command is re-run
  trainer-sigkill  the trainer rank's process is SIGKILLed; the run relaunches itself
  engine-sigkill   the rollout engine's process is SIGKILLed; the run relaunches itself
  hang             the engine's process is SIGSTOPped (a call that never returns); the watchdog relaunches
Counted: faults tried, faults the run resumed from, steps lost (missing from metrics.jsonl), steps
redone (run again after a resume: the work since the last checkpoint), resumes that failed (a
corrupt or unreadable checkpoint). Synchronous (k=0) and a checkpoint every step.

    python bench/run.py faults           # 3 of each kind (~15 minutes)
    python -c "from bench.faults import KINDS, campaign; print(campaign(list(KINDS), preset='tiny_lora'))"
    tests/integration/test_fault_campaign.py runs one of each in CI
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_kit import runlog
from areal_kit.procs import stat_fields
from bench.report import Result

KINDS = ("driver-sigkill", "driver-sigterm", "trainer-sigkill", "engine-sigkill", "hang")
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
STEP_LINE = re.compile(r"\(global step (\d+)\) finishes")
STEP_TIME = re.compile(r"\(global step \d+\) finishes\..*?#End to end# execution time: \*([0-9.]+)\*s")
WORKER = {"trainer-sigkill": "ray::TrainerWorker", "engine-sigkill": "ray::RolloutWorker", "hang": "ray::RolloutWorker"}


def _exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "areal-kit")


def session_pids(sid: int) -> list[int]:
    """Every process of the session sid (a driver started in its own session, and what it started)."""
    return [pid for pid, f in stat_fields().items() if pid != sid and int(f[3]) == sid]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_session(sid: int) -> None:
    """Whatever a killed driver left behind (Ray's processes outlive a SIGKILLed driver)."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Run:
    """The tiny run under test: started, watched through its train.log, re-run when it stops."""

    def __init__(self, root: str, steps: int, extra: list[str], preset: str = "tiny"):
        self.root, self.steps = root, steps
        self.args = [_exe(), "train", preset, f"fileroot={root}", "trial_name=faults", "tensorboard=false",
                     f"exp_ctrl.total_train_steps={steps}", "exp_ctrl.ckpt_freq_steps=1", "exp_ctrl.ckpt_freq_secs=0",
                     "ppo.max_head_offpolicyness=0", "recover_retries=100", "exp_ctrl.hang_factor=5",
                     "exp_ctrl.hang_floor_s=15", "exp_ctrl.hang_warmup=2", *extra]
        self.paths = runlog.run_paths(root, preset, "faults", "faults")
        self.proc: subprocess.Popen | None = None
        self.launches = 0

    def start(self) -> None:
        env = {**os.environ, "AREAL_USER": "faults"}
        with open(os.path.join(self.root, "driver.out"), "ab") as out:
            self.proc = subprocess.Popen(self.args, cwd=self.root, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.launches += 1

    def steps_logged(self) -> list[int]:
        return [int(m) for m in STEP_LINE.findall(self._log_text())]

    def step_seconds(self) -> float:
        """How long the last step logged took, by its log line (0.6 s before any)."""
        times = [float(t) for t in STEP_TIME.findall(self._log_text())]
        return times[-1] if times else 0.6

    def _log_text(self) -> str:
        try:
            return Path(self.paths.log_file).read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_step(self, after: int, timeout: float = 600) -> int:
        """Block until a step line beyond the first `after` lines is logged; the step it names."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            done = self.steps_logged()
            if len(done) > after:
                return done[after]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run exited ({self.proc.returncode}) while waiting for a step; "
                                   f"see {self.paths.log_file}")
            time.sleep(0.02)  # a step of the tiny run takes ~0.1 s: a fault must not land steps late
        raise TimeoutError(f"no new step in {timeout:.0f}s; see {self.paths.log_file}")

    def worker_pid(self, prefix: str) -> int:
        for _ in range(100):
            pids = [p for p in session_pids(self.proc.pid) if cmdline(p).startswith(prefix)]
            if pids:
                return pids[0]
            time.sleep(0.1)
        raise RuntimeError(f"no {prefix} process in the run's session")

    def hit(self, kind: str) -> None:
        if kind == "driver-sigkill":
            self.proc.kill()
            self.proc.wait()
            kill_session(self.proc.pid)
            self.start()
        elif kind == "driver-sigterm":
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(timeout=600)
            if code != 143:
                raise RuntimeError(f"SIGTERM ended the driver with {code}, expected 143")
            kill_session(self.proc.pid)
            self.start()
        else:
            os.kill(self.worker_pid(WORKER[kind]), signal.SIGSTOP if kind == "hang" else signal.SIGKILL)

    def finish(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout=timeout)
        kill_session(self.proc.pid)
        return code


def campaign(kinds: list[str], seed: int = 0, root: str | None = None, preset: str = "tiny",
             extra: tuple[str, ...] = ()) -> dict:
    """Hit one run of `preset` with each fault of kinds, in order, at random moments; the tally."""
    rng = random.Random(seed)
    root = root or tempfile.mkdtemp(prefix="bench-faults-")
    steps = 4 + 6 * len(kinds)  # room for every fault, a few steps apart, and the steps each one redoes
    run = Run(root, steps, [f"seed={seed + 1}", *extra], preset)
    run.start()
    resumed, t0 = 0, time.time()
    try:
        for kind in kinds:
            run.wait_for_step(len(run.steps_logged()) + rng.randint(0, 1))  # past its resume, training
            time.sleep(rng.uniform(0.0, 1.0) * run.step_seconds())  # somewhere inside the next step or checkpoint
            run.hit(kind)
            run.wait_for_step(len(run.steps_logged()))  # it goes on: a new step after the fault
            resumed += 1
        code = run.finish()
    except BaseException:
        run.proc.kill()
        kill_session(run.proc.pid)
        raise
    executed = run.steps_logged()
    metrics = [r["global_step"] for r in runlog.read_metrics(run.paths.metrics_file)]
    text = Path(run.paths.log_file).read_text(errors="replace")
    return {"faults": len(kinds), "kinds": list(kinds), "resumed": resumed, "exit_code": code, "steps": steps,
            "steps_lost": len(set(range(1, steps + 1)) - set(metrics)),
            "steps_twice_in_metrics": len(metrics) - len(set(metrics)),
            "steps_redone": len(executed) - len(set(executed)),
            "resumes_from_checkpoint": text.count("Will recover from: "),
            "failed_resumes": len(re.findall(r"does not match this run|loading the recover checkpoint .* failed", text)),
            "launches": run.launches, "wall_s": round(time.time() - t0, 1), "log": run.paths.log_file}


def run() -> Result:
    kinds = [k for k in KINDS for _ in range(3)]
    random.Random(7).shuffle(kinds)
    t = campaign(kinds, seed=7)
    per_kind = {k: kinds.count(k) for k in KINDS}
    checks = {"every fault resumed": t["resumed"] == t["faults"], "no step lost": t["steps_lost"] == 0,
              "each step once in metrics.jsonl": t["steps_twice_in_metrics"] == 0,
              "no resume failed": t["failed_resumes"] == 0, "the run finished": t["exit_code"] == 0}
    figures = {k: v for k, v in t.items() if k not in ("kinds", "log")}
    rows = [[k, per_kind[k]] for k in KINDS] + [["all", t["faults"]]]
    notes = [(f"One run of {t['steps']} steps hit {t['faults']} times: {t['resumed']} resumed, {t['steps_lost']} steps "
              f"lost, {t['steps_redone']} steps redone (the work since the last checkpoint), {t['failed_resumes']} "
              f"resumes that failed to load a checkpoint, {t['launches']} launches of the command, "
              f"{t['resumes_from_checkpoint']} resumes in all, {t['wall_s']:.0f} s."),
             "Order of the faults: " + ", ".join(kinds) + "."]
    return Result("faults", "fault campaign: one tiny run hit at random moments", figures, checks=checks,
                  columns=["fault", "times"], rows=rows, notes=notes)


if __name__ == "__main__":
    print(json.dumps(campaign(sys.argv[1:] or list(KINDS)), indent=1))

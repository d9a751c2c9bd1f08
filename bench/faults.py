"""Fault campaign: one tiny run, hit again and again at random moments, must finish with every step once.

Each fault lands at a random moment (seeded) a few steps after the run last resumed: the middle of
a generation, a train step, a weight sync or a recover checkpoint's write. The kinds:
  driver-sigkill     the driver is SIGKILLed (and its Ray processes with it); the same command is re-run
  driver-sigterm     the driver is SIGTERMed (a scheduler's stop); the same command is re-run
  trainer-sigkill    the trainer rank's process is SIGKILLed; the run relaunches itself
  engine-sigkill     the rollout engine's process is SIGKILLed; the run relaunches itself
  hang               the engine's process is SIGSTOPped (a call that never returns); the watchdog relaunches
  disk-full          the recover folder (a tmpfs of its own: root only) fills up; the next checkpoint's
                     write fails the run (exit code 1, "Run failed"); space is freed, the command re-run
  oom-at-load        the trainer rank's process is SIGKILLed and the relaunch's load of the recover
                     checkpoint raises torch's OutOfMemoryError once; the run relaunches again
  ray-start-timeout  the driver is SIGKILLed and the re-run's Ray start times out once (Ray's own
                     error); the run starts Ray again
  torn-checkpoint    the driver is SIGKILLed and a file of the newest recover checkpoint is cut to
                     half its size; the re-run resumes from the whole one before it
The injected errors are the AREAL_TEST_* hooks of rl/common/testhooks.py, armed by removing their
marker file. Counted: faults tried, faults the run resumed from, steps lost (missing from
metrics.jsonl), steps redone (run again after a resume: the work since the last checkpoint),
resumes that failed (a corrupt or unreadable checkpoint), and steps whose metrics differ from an
uninterrupted run of the same command. Synchronous (k=0) and a checkpoint every step.

    python bench/run.py faults           # 20 faults, each kind at least twice (~10 minutes, as root)
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

KINDS = ("driver-sigkill", "driver-sigterm", "trainer-sigkill", "engine-sigkill", "hang", "disk-full", "oom-at-load",
         "ray-start-timeout", "torn-checkpoint")
SIGNALS = KINDS[:5]  # the faults that are a signal alone (tests/integration/test_fault_campaign.py's)
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
STEP_LINE = re.compile(r"\(global step (\d+)\) finishes")
STEP_TIME = re.compile(r"\(global step \d+\) finishes\..*?#End to end# execution time: \*([0-9.]+)\*s")
WORKER = {"trainer-sigkill": "ray::TrainerWorker", "engine-sigkill": "ray::RolloutWorker", "hang": "ray::RolloutWorker",
          "oom-at-load": "ray::TrainerWorker"}
# The metrics a resumed step must repeat, and how closely (tests/integration/test_recover_tiny.py
# says why: the reward is a count, so equal; the loss bit-identical but for summation order).
SAME = {"task_reward": 0.0, "avg_seq_len": 0.0, "actor_loss": 1e-7}
TMPFS_BYTES = 64 << 20  # the recover folder's own filesystem (disk-full): a tiny checkpoint is ~2 MB


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

    def __init__(self, root: str, steps: int, extra: list[str], preset: str = "tiny", hooks: bool = True):
        self.root, self.steps = root, steps
        self.args = [_exe(), "train", preset, f"fileroot={root}", "trial_name=faults", "tensorboard=false",
                     f"exp_ctrl.total_train_steps={steps}", "exp_ctrl.ckpt_freq_steps=1", "exp_ctrl.ckpt_freq_secs=0",
                     "ppo.max_head_offpolicyness=0", "recover_retries=100", "exp_ctrl.hang_factor=5",
                     "exp_ctrl.hang_floor_s=15", "exp_ctrl.hang_warmup=2", *extra]
        self.paths = runlog.run_paths(root, preset, "faults", "faults")
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        # The injected errors' markers, there from the start (disarmed): a fault removes its own.
        self.markers = {k: os.path.join(root, f"{k}.fired") for k in ("oom-at-load", "ray-start-timeout")}
        self.hooks = {"AREAL_TEST_RAISE_LOAD": f"0:*:{self.markers['oom-at-load']}:OutOfMemoryError",
                      "AREAL_TEST_RAY_START_TIMEOUT": self.markers["ray-start-timeout"]} if hooks else {}
        for m in self.markers.values():
            Path(m).touch()
        self.filler = os.path.join(root, "recover", "filler")  # disk-full's: on the tmpfs mounted there
        self.mounted = False

    def mount_tmpfs(self) -> None:
        """The recover folder on a small filesystem of its own, which disk-full fills (root only)."""
        path = os.path.join(self.root, "recover")
        os.makedirs(path, exist_ok=True)
        if os.geteuid() != 0:
            raise RuntimeError("disk-full mounts a tmpfs for the recover folder: run the campaign as root")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", path], check=True)
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", os.path.join(self.root, "recover")], check=False)
            self.mounted = False

    def start(self) -> None:
        env = {**os.environ, "AREAL_USER": "faults", **self.hooks}
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
        if kind in ("driver-sigkill", "ray-start-timeout", "torn-checkpoint"):
            self.proc.kill()
            self.proc.wait()
            kill_session(self.proc.pid)
            if kind == "ray-start-timeout":
                os.remove(self.markers[kind])  # armed: the re-run's Ray start times out once
            elif kind == "torn-checkpoint":
                self.tear_newest()
            self.start()
        elif kind == "disk-full":
            self.fill_disk()
        elif kind == "driver-sigterm":
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(timeout=600)
            if code != 143:
                raise RuntimeError(f"SIGTERM ended the driver with {code}, expected 143")
            kill_session(self.proc.pid)
            self.start()
        else:
            if kind == "oom-at-load":
                os.remove(self.markers[kind])  # armed: the relaunch's load runs out of memory once
            os.kill(self.worker_pid(WORKER[kind]), signal.SIGSTOP if kind == "hang" else signal.SIGKILL)

    def tear_newest(self) -> None:
        """Cut the largest file of the newest recover checkpoint to half its size, as a lost write would."""
        from areal_kit.rl.checkpoint.store import latest

        ck = latest(self.paths.recover_dir)
        if ck is None:
            raise RuntimeError("no recover checkpoint to tear yet")
        files = [os.path.join(d, f) for d, _, fs in os.walk(ck.path) for f in fs]
        biggest = max(files, key=os.path.getsize)
        os.truncate(biggest, os.path.getsize(biggest) // 2)

    def fill_disk(self) -> None:
        """Fill the recover folder's filesystem: the next checkpoint's write fails, and so the run
        (exit code 1, its "Run failed" line); then free it and re-run the same command."""
        st = os.statvfs(os.path.dirname(self.filler))
        with open(self.filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(st.f_bavail - 1, 1) * st.f_frsize)  # all but a block
        code = self.proc.wait(timeout=600)
        kill_session(self.proc.pid)
        failed = [ln for ln in self._log_text().splitlines() if " ERROR Run failed: " in ln]
        if code != 1 or not failed or "writing the recover checkpoint" not in failed[-1]:
            raise RuntimeError(f"a full disk ended the driver with {code}, expected 1 and its Run failed line; "
                               f"see {self.paths.log_file}")
        os.remove(self.filler)
        self.start()

    def finish(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout=timeout)
        kill_session(self.proc.pid)
        return code


def campaign(kinds: list[str], seed: int = 0, root: str | None = None, preset: str = "tiny",
             extra: tuple[str, ...] = (), compare: bool = True) -> dict:
    """Hit one run of `preset` with each fault of kinds, in order, at random moments; the tally.
    compare: also run the same command uninterrupted and count the steps whose metrics differ."""
    rng = random.Random(seed)
    root = root or tempfile.mkdtemp(prefix="bench-faults-")
    steps = 4 + 6 * len(kinds)  # room for every fault, a few steps apart, and the steps each one redoes
    args = [f"seed={seed + 1}", *extra]
    run = Run(root, steps, args, preset)
    resumed, t0 = 0, time.time()
    try:
        if "disk-full" in kinds:
            run.mount_tmpfs()
        run.start()
        for kind in kinds:
            # Past its resume, training; and past global step 3, so a checkpoint precedes the newest.
            run.wait_for_step(max(len(run.steps_logged()) + rng.randint(0, 1), 3))
            time.sleep(rng.uniform(0.0, 1.0) * run.step_seconds())  # somewhere inside the next step or checkpoint
            run.hit(kind)
            run.wait_for_step(len(run.steps_logged()))  # it goes on: a new step after the fault
            resumed += 1
        code = run.finish()
    except BaseException:
        if run.proc is not None:
            run.proc.kill()
            kill_session(run.proc.pid)
        raise
    finally:
        run.unmount()
    wall = time.time() - t0
    executed = run.steps_logged()
    rows = runlog.read_metrics(run.paths.metrics_file)
    metrics = [r["global_step"] for r in rows]
    text = Path(run.paths.log_file).read_text(errors="replace")
    out = {"faults": len(kinds), "kinds": list(kinds), "resumed": resumed, "exit_code": code, "steps": steps,
           "steps_lost": len(set(range(1, steps + 1)) - set(metrics)),
           "steps_twice_in_metrics": len(metrics) - len(set(metrics)),
           "steps_redone": len(executed) - len(set(executed)),
           "resumes_from_checkpoint": text.count("Will recover from: "),
           # A resume that could not go on: a checkpoint refused, or one that failed to load for good.
           "failed_resumes": len(re.findall(r"does not match this run|Run failed: loading the recover checkpoint|"
                                            r"no earlier whole one is kept", text)),
           # What the injected faults did, by the run's own lines: each must have fired.
           "ooms_at_load": len(re.findall(r"Worker failure \(out of memory: loading the recover checkpoint", text)),
           "ray_start_timeouts": len(re.findall(r"Worker failure \(Ray's start timed out", text)),
           "torn_passed_over": len(re.findall(r"WARNING The recover checkpoint \S+ is torn", text)),
           "full_disk_failures": len(re.findall(r"Run failed: writing the recover checkpoint .* free on its filesystem", text)),
           "launches": run.launches, "wall_s": round(wall, 1), "log": run.paths.log_file}
    if compare:
        out.update(_compare(rows, steps, args, preset))
    return out


def _compare(rows: list[dict], steps: int, args: list[str], preset: str) -> dict:
    """The same command, uninterrupted: the steps whose metrics the hit run did not repeat (SAME)."""
    ref = Run(tempfile.mkdtemp(prefix="bench-faults-ref-"), steps, args, preset, hooks=False)
    ref.start()
    code = ref.finish()
    want = {r["global_step"]: r for r in runlog.read_metrics(ref.paths.metrics_file)}
    differ = [r["global_step"] for r in rows
              if r["global_step"] not in want
              or any(abs(r[k] - want[r["global_step"]][k]) > tol for k, tol in SAME.items())]
    return {"uninterrupted_exit_code": code, "steps_compared": len(want), "steps_unlike_uninterrupted": len(differ),
            "first_unlike": differ[:5]}


def draw(n: int, seed: int) -> list[str]:
    """n faults in a random order: each kind twice, the rest drawn at random."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS for _ in range(2)] + [rng.choice(KINDS) for _ in range(n - 2 * len(KINDS))]
    rng.shuffle(kinds)
    return kinds


# Each injected kind, and the campaign's count of the run's own lines that say it fired.
FIRED = {"disk-full": "full_disk_failures", "oom-at-load": "ooms_at_load", "ray-start-timeout": "ray_start_timeouts",
         "torn-checkpoint": "torn_passed_over"}


def campaign_checks(t: dict, kinds: list[str]) -> dict[str, bool]:
    """What a campaign's table `t` must show, drawn `kinds` injected: each check by what it says."""
    return {"every fault resumed": t["resumed"] == t["faults"], "no step lost": t["steps_lost"] == 0,
            "each step once in metrics.jsonl": t["steps_twice_in_metrics"] == 0,
            "no resume failed": t["failed_resumes"] == 0, "the run finished": t["exit_code"] == 0,
            "every injected fault fired": all(t[FIRED[k]] == kinds.count(k) for k in FIRED),
            "the metrics of an uninterrupted run": t["steps_unlike_uninterrupted"] == 0}


def run() -> Result:
    kinds = draw(20, seed=7)
    t = campaign(kinds, seed=7)
    per_kind = {k: kinds.count(k) for k in KINDS}
    checks = campaign_checks(t, kinds)
    figures = {k: v for k, v in t.items() if k not in ("kinds", "log")}
    rows = [[k, per_kind[k]] for k in KINDS] + [["all", t["faults"]]]
    notes = [(f"One run of {t['steps']} steps hit {t['faults']} times: {t['resumed']} resumed, {t['steps_lost']} steps "
              f"lost, {t['steps_redone']} steps redone (the work since the last checkpoint), {t['failed_resumes']} "
              f"resumes that failed to load a checkpoint, {t['launches']} launches of the command, "
              f"{t['resumes_from_checkpoint']} resumes in all, {t['wall_s']:.0f} s; "
              f"{t['steps_unlike_uninterrupted']} of {t['steps_compared']} steps unlike an uninterrupted run's."),
             "Order of the faults: " + ", ".join(kinds) + "."]
    return Result("faults", "fault campaign: one tiny run hit at random moments", figures, checks=checks,
                  columns=["fault", "times"], rows=rows, notes=notes)


if __name__ == "__main__":
    print(json.dumps(campaign(sys.argv[1:] or list(KINDS)), indent=1))

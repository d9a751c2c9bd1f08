"""Run a validated config to the end: logs, progress bar, recover and relaunch after failures.

A worker that dies (a killed rollout or trainer actor, a lost node) or hangs (a call past the
watchdog's bound, rl/driver/watchdog.py), an out-of-memory, a vLLM engine core that died or an
NCCL error ends the attempt; the run then relaunches from the last recover checkpoint, up to
recover_retries times, saying so in the log (rl/driver/retry.py says which failures count). Any other
error, including one our code raises inside a worker, ends the run at once: a relaunch would only
fail the same way. It reaches the terminal as one line naming the worker
call it came from (RunFailed, exit code 1), its full traceback in train.log; so does a recover
checkpoint that fails to load or to be written (the run had started), and any error once the
workers have run, a UserError included. Ray's start timing out on a loaded machine is relaunched
too, Ray started again. Bad input raises UserError before any actor starts.
Ctrl-C stops the run at once, cleanly (workers stopped, the
log says so); the same command then resumes it from the last recover checkpoint. SIGTERM during
training (a scheduler's stop) finishes the step and writes its recover checkpoint first (see
SigtermStop). One driver per run: a second launch of a running experiment/trial is refused before
it writes anything.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

from areal_kit import hardware, logs, runlog
from areal_kit.config.alloc import parse_allocation
from areal_kit.data.model_source import model_spec
from areal_kit.data.prompts import check_sources
from areal_kit.errors import ExitCode, RunFailed, UserError, describe
from areal_kit.interrupts import Handler, Interrupted, interruption, note_sigterm, raise_on_sigterm, sigterm_interrupts
from areal_kit.rl.driver import raystart
from areal_kit.rl.driver.retry import WorkerDied, relaunching, worker_died

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig
    from areal_kit.rl.driver.controller import Outcome
    from areal_kit.rl.driver.job import Job

# Ray starts first, on a thread (start_ray_early); torch, the controller and the workers' modules
# import meanwhile: this module's own imports stay light for that.


class _Progress:
    """A rich progress bar on a terminal; nothing otherwise (logs carry the same numbers)."""

    def __init__(self, total: int) -> None:
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, info="starting workers")
            self.bar.start()

    def __call__(self, step: int, total: int, row: dict) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step,
                            info=f"task_reward {row['task_reward']:.3f} | {row['e2e_time']:.2f}s/step")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def start_ray_early(cfg: TrainConfig) -> raystart.InBackground[bool]:
    """Ray's start (controller.start_ray's), begun on a thread: its processes come up while this
    one imports the rest and prepares the run; the first attempt waits for it."""
    return raystart.InBackground(raystart.start_ray, cfg)


def stop_ray_early(ray_up: raystart.InBackground[bool]) -> None:
    """A launch stopped before its first attempt (bad input, a running twin, Ctrl-C): the Ray it was
    starting is shut down once up, so a caller that goes on (a test, a notebook) has none left over."""
    try:
        started = ray_up.wait()
    except Exception:  # noqa: BLE001  (it never came up: nothing to stop, and the launch's own error is the one to report)
        return
    if started:
        import ray

        ray.shutdown()


def check_paths(cfg: TrainConfig) -> None:
    """actor.path and the dataset's files, told from the settings alone: a wrong one is a line at
    once, not after Ray, which launch starts next, has come up and gone down again (seconds)."""
    model_spec(cfg.actor.path, cfg.seed)
    check_sources(cfg.dataset)


def _prepare(cfg: TrainConfig, ray_up: raystart.InBackground[bool]) -> tuple[Job, int]:
    """The run's Job and its lock (see hold_run_lock), while Ray starts; Ray stopped if either fails."""
    try:
        import torch

        from areal_kit.rl.driver.job import prepare

        # The driver's tensors are a step's rewards, a few hundred numbers: an OpenMP pool would only
        # wake threads on the cores the workers train and generate on, and cost each reduction more.
        torch.set_num_threads(1)
        job = prepare(cfg)
        return job, hold_run_lock(job.paths.log_dir, f"{cfg.experiment_name}/{cfg.trial_name}")
    except BaseException:
        stop_ray_early(ray_up)
        raise


def launch(cfg: TrainConfig, fresh: bool = False, discard: bool = False) -> int:
    """Run cfg to its end (relaunching after transient failures); fresh: start over, setting the
    recover checkpoints aside (discard: deleting them). The exit code, or an exception: UserError
    (bad input, refused before any worker ran), RunFailed (the run failed), Interrupted (a signal's stop)."""
    check_paths(cfg)
    ray_up = start_ray_early(cfg)
    job, lock = _prepare(cfg, ray_up)
    log = runlog.RunLogger(job.paths, cfg.tensorboard, cfg.wandb_project, f"{cfg.experiment_name}/{cfg.trial_name}")
    log.info(logs.run_line(f"{cfg.experiment_name}/{cfg.trial_name}", job.total_steps, job.loader.steps_per_epoch,
                           len(job.loader.rows), job.n_dropped, job.paths.log_dir))
    actor = cfg.actor
    for note in parse_allocation(cfg.allocation_mode).training_notes(actor.zero_stage, actor.gradient_checkpointing):
        log.info(note)
    for note in hardware.vllm_notes(cfg.actor.vllm):
        log.warning(note)
    progress = _Progress(job.total_steps)
    retries = 0 if cfg.recover_mode == "disabled" else cfg.recover_retries
    sigterm = SigtermStop(log, graceful=cfg.exp_ctrl.on_sigterm == "checkpoint")
    previous = sigterm.install()
    failed = _FailedAt()

    def run_once(attempt: int) -> Outcome:
        nonlocal ray_up  # the Ray start the attempt waits for
        if attempt and ray_up.failed():  # its start failed (timed out: a retryable kind), so it is started again
            ray_up = start_ray_early(cfg)
        return _attempt(job, log, progress, sigterm, fresh and attempt == 0, ray_up, failed,
                        discard=discard and attempt == 0)

    try:
        end = relaunching(run_once, retries, log, where=lambda: failed.step, cfg=cfg)
        from areal_kit.rl.driver.controller import Ending

        if end.ending is Ending.STOPPED:  # as asked: it ends as any stop does, said below, exit code 143
            raise sigterm.interrupted(end.global_step, end.checkpoint)
        return ExitCode.OK
    except (KeyboardInterrupt, Interrupted) as e:
        stop = interruption(e)
        assert stop is not None  # e is a KeyboardInterrupt or an Interrupted: the chain's first link
        log.warning(logs.stopped_line(stop.signame, stop.global_step, stop.checkpoint))
        if stop is e:
            raise
        raise stop from None  # Ctrl-C, or SIGTERM as the KeyboardInterrupt it raises (interrupts.raise_on_sigterm)
    except UserError as e:
        if not failed.started:  # refused before any worker ran: bad input, exit code 2
            raise
        raise _run_failed(cfg, job, log, e) from e  # after the workers ran (a relaunch Ray cannot place): the run's
    except Exception as e:
        raise _run_failed(cfg, job, log, e) from e
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        progress.stop()
        log.close()
        os.close(lock)


def _run_failed(cfg: TrainConfig, job: Job, log: runlog.RunLogger, e: Exception) -> RunFailed:
    """The "Run failed" line, with e's traceback, into train.log (`areal-kit logs` reads it), and
    the one line the terminal gets."""
    log.failure(logs.failed_line(describe(e)), e)
    return RunFailed(f"run {cfg.experiment_name}/{cfg.trial_name} failed: {describe(e)} "
                     f"(traceback in {job.paths.log_file})")


def hold_run_lock(log_dir: str, name: str) -> int:
    """An exclusive lock on the run's log folder, held (by the returned descriptor) until it is
    closed or this process ends: the kernel drops it even after kill -9, so a crash never leaves a
    stale lock. A second driver of the same run gets a UserError naming the first."""
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, ".driver.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"run {name} is already running{_driver(log_dir)}; stop it first, or give this one "
                        "another trial_name=") from None
    except OSError:  # a filesystem without locks (an NFS mount with nolock): nothing to enforce with
        pass
    return fd


def _driver(log_dir: str) -> str:
    """' (driver pid N on HOST)' from driver.json, which the running driver wrote, if readable."""
    try:
        with open(os.path.join(log_dir, "driver.json")) as f:
            info = json.load(f)
        return f" (driver pid {info['pid']} on {info['host']})"
    except (OSError, ValueError, KeyError):
        return ""


class SigtermStop:
    """SIGTERM's handler for one run: a scheduler's stop, `kill`.

    With exp_ctrl.on_sigterm=checkpoint, the first SIGTERM while the loop trains only asks it to
    stop after the step it is on, with a recover checkpoint of that step, so a preempted run loses
    no steps: the grace period schedulers give (Slurm: --signal=B:TERM@SECONDS) is for that. A
    second SIGTERM, one before training runs, or on_sigterm=stop unwinds at once, as Ctrl-C does;
    a re-run then resumes from the last periodic checkpoint. Schedulers that signal every process
    kill the workers too: the step then fails, and the run stops without a relaunch.
    """

    def __init__(self, log: runlog.RunLogger, graceful: bool) -> None:
        self.log, self.graceful = log, graceful
        self.armed = False  # the loop runs and can stop between steps (set by _attempt)
        self.signum = 0  # the SIGTERM that asked the loop to stop after its step; 0: none

    def install(self) -> Handler:
        """Put the handler in place (again after ray.init); returns the one it replaced, or None."""
        return sigterm_interrupts(self._on_sigterm)

    def asked(self) -> bool:
        """Whether a SIGTERM asked the loop to stop after its step: the Controller's should_stop."""
        return bool(self.signum)

    def interrupted(self, global_step: int = 0, checkpoint: str = "") -> Interrupted:
        """The stop asked for, as the CLI reports it (ExitCode.TERMINATED)."""
        return Interrupted("SIGTERM", ExitCode.TERMINATED, global_step, checkpoint)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.graceful and self.armed and not self.signum:
            self.signum = signum
            note_sigterm()  # a SIGINT that follows (scancel's batch shell) stops the run as this SIGTERM
            self.log.warning("SIGTERM: the run stops after this step, with its recover checkpoint; a second "
                             "SIGTERM stops it at once.")
            return
        raise_on_sigterm(signum, frame)


class _FailedAt:
    """The global step the last attempt failed in (None before a failure, or before training ran),
    and whether the run has started: an attempt's workers ran (from then on every failure, a
    UserError included, is the run's: exit code 1)."""

    step: int | None = None
    started: bool = False


def _attempt(job: Job, log: runlog.RunLogger, progress: _Progress, sigterm: SigtermStop, fresh: bool,
             ray_up: raystart.InBackground[bool], failed: _FailedAt | None = None, discard: bool = False) -> Outcome:
    """One launch: the run state, Ray (up, or the error its start raised), the workers (given the
    recover checkpoint's trainer state when the run state came from one), then training to the end
    or to a stop asked for."""
    from areal_kit.rl.driver.checkpointer import Checkpointer
    from areal_kit.rl.driver.controller import Controller, Ending

    checkpoints = Checkpointer(job, log)
    state = checkpoints.load(fresh, discard)
    state.wandb_id = log.resume_at(state.global_step, state.wandb_id)
    ctrl = Controller(job, log, state, progress, should_stop=sigterm.asked, checkpoints=checkpoints)
    training = False  # set once the loop runs: a failure before it (a worker's setup) has no step
    try:
        ray_up.wait()
        sigterm.install()  # again: a ray.init on the main thread puts its own handler in place, one that aborts
        ctrl.start()
        if failed is not None:
            failed.started = True  # the workers run: what fails from here on is the run, not its input
        if state.resumed:
            ctrl.restore()
        sigterm.armed = training = True
        try:
            end = ctrl.run()
        finally:
            sigterm.armed = False
        if end.ending is Ending.FINISHED:
            log.info(logs.finished_line(end.global_step, end.last.get("task_reward", float("nan"))))
        return end
    except Exception as e:
        if (stop := interruption(e)) is not None:  # a signal that came back as another error
            raise stop from None
        if failed is not None:
            failed.step = ctrl.state.global_step + 1 if training else None
        if sigterm.asked():  # the stop was asked for: no relaunch, no failure report
            log.warning(logs.after_sigterm_line(describe(e)))
            raise sigterm.interrupted() from e
        # A peer's death often reaches us first as a live worker's error: the trainer's gloo
        # broadcast fails when the engine at the other end was killed. Name the death.
        dead = 0 if worker_died(e) else ctrl.dead_workers()
        if dead:
            raise WorkerDied(f"{dead} worker(s) died; first error seen: {describe(e)}") from e
        raise
    finally:
        ctrl.stop()

"""Which failures relaunch a run (rl/driver/launch.py): a dead worker does, a bug in our code does not.

The exceptions are real Ray exception objects, built the way Ray raises them from ray.get; the
relaunch loop and launch() are the real code, driven by stand-in attempts and controllers.
"""

from typing import ClassVar

import pytest
import ray.exceptions as rex

from areal_kit import runlog
from areal_kit.config.loader import load_config
from areal_kit.errors import RunFailed, UserError
from areal_kit.interrupts import Interrupted
from areal_kit.rl.driver import launch, retry
from areal_kit.rl.driver.controller import Ending, Outcome
from areal_kit.rl.driver.job import RunState


class Log:
    def __init__(self):
        self.warnings, self.infos, self.failures = [], [], []

    def failure(self, m, exc):
        self.failures.append((m, exc))

    def info(self, m):
        self.infos.append(m)

    def warning(self, m):
        self.warnings.append(m)

    def resume_at(self, global_step, wandb_id=""):
        self.resumed_at = global_step
        return wandb_id

    def close(self):
        pass


def remote(cause: BaseException, fn: str = "Trainer.train_step") -> rex.RayTaskError:
    """What ray.get raises when a remote call raised `cause`: RayTaskError(<cause type>)."""
    tb = f"ray::{fn}() (pid=1, ip=10.0.0.1)\n  File \"trainer.py\", line 1\n{type(cause).__name__}: {cause}"
    return rex.RayTaskError(fn, tb, cause).as_instanceof_cause()


def _bug():
    return remote(ValueError("packed batch has 3 rows, expected 4"))


def _chained_death():
    try:
        raise rex.ActorDiedError()
    except rex.ActorDiedError as d:
        try:
            raise RuntimeError("weight sync lost its peer") from d
        except RuntimeError as e:
            return e


DEATHS = {
    "actor died": rex.ActorDiedError,
    "actor error": lambda: rex.RayActorError(),
    "worker crashed": rex.WorkerCrashedError,
    "node died": lambda: rex.NodeDiedError("node 10.0.0.2 died"),
    "raylet died": lambda: rex.LocalRayletDiedError(),
    "object lost": lambda: rex.ObjectLostError("ab" * 14, None, ""),
    "owner died": lambda: rex.OwnerDiedError("ab" * 14, None, ""),
    # An actor method whose own ray.get met a dead actor: Ray wraps the death in a RayTaskError.
    "task error caused by actor death": lambda: remote(rex.ActorDiedError(), "Controller.step"),
    "plain task error caused by death": lambda: rex.RayTaskError("f", "tb", rex.WorkerCrashedError()),
    "nested task errors": lambda: remote(remote(rex.ActorDiedError()), "Outer.call"),
    "death re-raised with from": _chained_death,
}
BUGS = {
    "ValueError in a trainer method": _bug,
    "RuntimeError in a rollout method": lambda: remote(RuntimeError("engine returned no samples"), "Rollout.generate"),
    "task error without a cause": lambda: rex.RayTaskError("f", "tb", None),
    "KeyboardInterrupt inside a worker": lambda: remote(KeyboardInterrupt()),
    "driver-side error": lambda: RuntimeError("sample staleness 3 exceeds max_head_offpolicyness 2"),
    "other Ray error": lambda: rex.GetTimeoutError("timed out"),
    # The core raised an error of its own (a KV cache that cannot fit): the same on every relaunch.
    "engine core that exited with an error while it started": lambda: _core_start(1),
}


@pytest.mark.parametrize("make", DEATHS.values(), ids=DEATHS.keys())
def test_worker_deaths_count_as_worker_failures(make):
    assert launch.worker_died(make()) is True


@pytest.mark.parametrize("make", BUGS.values(), ids=BUGS.keys())
def test_errors_raised_by_code_do_not(make):
    assert launch.worker_died(make()) is False


def test_a_cause_cycle_ends():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert launch.worker_died(a) is False


def attempts_raising(*errors):
    """A run_once that raises the given errors on successive attempts, then returns 0."""
    calls = []

    def run_once(attempt):
        calls.append(attempt)
        if attempt < len(errors):
            raise errors[attempt]
        return 0

    return run_once, calls


@pytest.mark.parametrize("make", DEATHS.values(), ids=DEATHS.keys())
def test_a_worker_death_relaunches(make):
    run_once, calls = attempts_raising(make(), make())
    log = Log()
    assert launch.relaunching(run_once, retries=2, log=log, pause=0) == 0
    assert calls == [0, 1, 2]
    assert "(retry 2/2)" in log.warnings[-1]
    assert len(log.warnings) == 2


@pytest.mark.parametrize("make", BUGS.values(), ids=BUGS.keys())
def test_a_bug_surfaces_at_once_with_its_message(make):
    err = make()
    run_once, calls = attempts_raising(err)
    log = Log()
    with pytest.raises(BaseException) as got:
        launch.relaunching(run_once, retries=3, log=log, pause=0)
    assert got.value is err
    assert calls == [0]
    assert log.warnings == []


def test_the_bug_message_reaches_the_user():
    run_once, _ = attempts_raising(_bug())
    with pytest.raises(ValueError, match="packed batch has 3 rows, expected 4"):
        launch.relaunching(run_once, retries=3, log=Log(), pause=0)


def test_a_bug_after_a_relaunch_is_not_retried_either():
    run_once, calls = attempts_raising(rex.ActorDiedError(), _bug())
    with pytest.raises(rex.RayTaskError):
        launch.relaunching(run_once, retries=5, log=Log(), pause=0)
    assert calls == [0, 1]


def test_deaths_beyond_the_retries_raise_the_last_one():
    last = rex.ActorDiedError()
    run_once, calls = attempts_raising(rex.ActorDiedError(), last)
    with pytest.raises(rex.ActorDiedError) as got:
        launch.relaunching(run_once, retries=1, log=Log(), pause=0)
    assert got.value is last
    assert calls == [0, 1]


# -- launch() wiring: each attempt gets a fresh controller, stopped whatever happened -------------
class FakeController:
    failures: ClassVar[list] = []  # what run() raises, one per attempt
    restore_failures: ClassVar[list] = []  # what restore() raises, one per attempt that resumes
    start_failures: ClassVar[list] = []  # what start() raises (the workers' setup), one per attempt
    made: ClassVar[list] = []  # every controller launch() built

    dead: ClassVar[int] = 0  # what dead_workers() reports after a failure

    def __init__(self, job, log, state, progress, should_stop, checkpoints):
        self.state, self.stopped, self.should_stop = state, False, should_stop
        FakeController.made.append(self)

    def dead_workers(self):
        return FakeController.dead

    def start(self):
        if FakeController.start_failures:
            raise FakeController.start_failures.pop(0)

    def run(self):
        if FakeController.failures:
            raise FakeController.failures.pop(0)
        self.state.global_step = 4
        return Outcome(Ending.FINISHED, 4, last={"task_reward": 0.5})

    def restore(self):
        if FakeController.restore_failures:
            raise FakeController.restore_failures.pop(0)

    def stop(self):
        self.stopped = True


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    from types import SimpleNamespace


    job = SimpleNamespace(cfg=None, total_steps=4, n_dropped=0, rows=[],
                          paths=SimpleNamespace(log_dir=str(tmp_path), log_file=str(tmp_path / "train.log")),
                          loader=SimpleNamespace(steps_per_epoch=4, rows=[1]))
    fresh_flags, discard_flags = [], []
    resume_from = []  # a recover checkpoint's path: every attempt resumes from it (restore runs)
    load_errors = []  # what load() raises, one per attempt (a checkpoint refused, say)

    class FakeCheckpointer:
        def __init__(self, job, log):
            pass

        def load(self, fresh, discard=False):
            fresh_flags.append(fresh)
            discard_flags.append(discard)
            if load_errors:
                raise load_errors.pop(0)
            return RunState(global_step=2, recover_path=resume_from[0]) if resume_from else RunState()

    # launch imports these when it runs (its own imports stay light: Ray starts meanwhile).
    monkeypatch.setattr("areal_kit.rl.driver.job.prepare", lambda cfg: job)
    monkeypatch.setattr(launch, "check_paths", lambda cfg: None)  # the presets' paths are a cluster's
    monkeypatch.setattr("areal_kit.rl.driver.controller.Controller", FakeController)
    monkeypatch.setattr("areal_kit.rl.driver.checkpointer.Checkpointer", FakeCheckpointer)
    monkeypatch.setattr(launch, "start_ray_early", lambda cfg: launch.raystart.InBackground(lambda: None))
    log = Log()
    monkeypatch.setattr(runlog, "RunLogger", lambda *a: log)
    monkeypatch.setattr("areal_kit.rl.driver.retry.time.sleep", lambda s: None)
    FakeController.made = []
    FakeController.restore_failures = []
    FakeController.start_failures = []
    FakeController.dead = 0
    return SimpleNamespace(fresh=fresh_flags, discard=discard_flags, resume_from=resume_from, load_errors=load_errors,
                           log=log, dir=tmp_path)


def cfg(mode="auto", retries=1, on_sigterm="checkpoint", preset="tiny", more=()):
    return load_config(preset, [f"recover_mode={mode}", f"recover_retries={retries}", "tensorboard=false",
                                "experiment_name=e", "trial_name=t", f"exp_ctrl.on_sigterm={on_sigterm}", *more])


def test_the_run_log_says_once_what_replaces_the_guides_knobs(fake_run):
    """Training pipeline parallelism and actor.vllm.swap_space: one line each at the start, not one a relaunch."""
    c = cfg(preset="1.5B_n4", more=["actor.vllm.swap_space=64"])  # allocation_mode vllm.d16p1m1+d8p2m1
    FakeController.failures = [rex.ActorDiedError()]
    assert launch.launch(c) == 0
    assert len(FakeController.made) == 2
    line = ("training part d8m1p2: areal-kit trains with ZeRO data parallelism over its 16 GPUs; pipeline/tensor "
            "parallelism of training is not used; for memory: actor.zero_stage=3, a smaller "
            "actor_train.mb_spec.max_tokens_per_mb, more training GPUs")  # the preset trains under ZeRO-2
    assert [m for m in fake_run.log.infos if m.startswith("training part")] == [line]
    assert len([m for m in fake_run.log.warnings if m.startswith("actor.vllm.swap_space=64 has no effect")]) == 1


def test_launch_relaunches_after_a_death_and_fresh_applies_to_the_first_attempt_only(fake_run):
    FakeController.failures = [rex.ActorDiedError()]
    assert launch.launch(cfg(), fresh=True) == 0
    assert fake_run.fresh == [True, False]
    assert fake_run.discard == [False, False]
    assert [c.stopped for c in FakeController.made] == [True, True]


def test_fresh_discard_deletes_on_the_first_attempt_only(fake_run):
    """A relaunch resumes the run's own checkpoint: --discard, like --fresh, is the first attempt's."""
    FakeController.failures = [rex.ActorDiedError()]
    assert launch.launch(cfg(), fresh=True, discard=True) == 0
    assert (fake_run.fresh, fake_run.discard) == ([True, False], [True, False])


def _load_failed(cause: BaseException):
    """What recover.restore raises when a rank failed to load the checkpoint: RunFailed from Ray's error."""
    from areal_kit.rl.driver import recover

    class Trainers:
        def load_recover(self, path):
            raise remote(cause, "TrainerWorker.load_recover")

    try:
        recover.restore("/r/globalstep2", Trainers())
    except RunFailed as e:
        return e
    raise AssertionError("restore did not fail")


def test_a_checkpoint_that_fails_to_load_fails_the_run_with_exit_1_and_its_line_in_the_log(fake_run):
    """Loading runs once the workers do: the run has started, so its failure is RunFailed (exit
    code 1) with the "Run failed" line and traceback in train.log, which `areal-kit logs` reads."""
    fake_run.resume_from.append("/r/globalstep2")
    err = _load_failed(OSError(5, "Input/output error"))
    FakeController.restore_failures = [err]
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=3))
    assert got.value.exit_code == 1
    assert len(FakeController.made) == 1 and FakeController.made[0].stopped, "a torn file is no relaunch's to fix"
    why = ("loading the recover checkpoint /r/globalstep2 failed (TrainerWorker.load_recover: OSError: [Errno 5] "
           "Input/output error); the checkpoint is kept as it is: re-run the same command to try again, or with "
           "--fresh to start over (it sets this checkpoint aside in /r/set-aside-<time>/, deleting nothing)")
    assert str(got.value) == f"run e/t failed: {why} (traceback in {fake_run.dir}/train.log)"
    assert fake_run.log.failures == [(f"Run failed: {why}", err)]
    from areal_kit import logs

    assert logs.parse_failed(fake_run.log.failures[0][0]) == why  # what `areal-kit logs` shows as failed (...)


def test_an_out_of_memory_while_loading_is_relaunched(fake_run):
    """The load's RunFailed keeps its cause: an OOM while loading is retried as one in a step is."""
    import torch

    fake_run.resume_from.append("/r/globalstep2")
    FakeController.restore_failures = [_load_failed(torch.OutOfMemoryError("CUDA out of memory."))]
    assert launch.launch(cfg(retries=1)) == 0
    assert len(FakeController.made) == 2
    assert fake_run.log.warnings[0].startswith("Worker failure (out of memory: loading the recover checkpoint "
                                               "/r/globalstep2 failed (TrainerWorker.load_recover: OutOfMemoryError")
    assert fake_run.log.warnings[0].endswith("(retry 1/1).")


def test_a_user_error_once_the_run_has_started_is_the_runs_failure(fake_run):
    """Bad input is refused before anything runs (exit code 2). The same exception after a
    relaunch (say, Ray cannot place the workers once a node is gone) ends a run that trained:
    exit code 1 and the "Run failed" line, as any failure of a started run."""
    late = UserError("Ray did not place trainer group 0 in 600s")
    FakeController.failures = [rex.ActorDiedError(), late]
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=3))
    assert str(got.value) == (f"run e/t failed: Ray did not place trainer group 0 in 600s (traceback in "
                              f"{fake_run.dir}/train.log)")
    assert got.value.__cause__ is late
    assert fake_run.log.failures == [("Run failed: Ray did not place trainer group 0 in 600s", late)]


def test_launch_does_not_retry_a_bug_and_names_the_call_it_came_from(fake_run):
    """The user gets one line (RunFailed): which worker call failed, the error, and where the
    traceback is; the log gets the error itself, traceback and all."""
    bug = _bug()
    FakeController.failures = [bug]
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=3))
    assert len(FakeController.made) == 1
    assert FakeController.made[0].stopped
    msg = str(got.value)
    assert msg == ("run e/t failed: Trainer.train_step: ValueError: packed batch has 3 rows, expected 4 "
                   f"(traceback in {fake_run.dir}/train.log)")
    assert "\n" not in msg
    assert got.value.__cause__ is bug
    assert fake_run.log.failures == [("Run failed: Trainer.train_step: ValueError: packed batch has 3 rows, expected 4",
                                      bug)]


def test_launch_with_recover_disabled_does_not_retry_a_death(fake_run):
    FakeController.failures = [rex.ActorDiedError()]
    with pytest.raises(RunFailed, match="ActorDiedError") as got:
        launch.launch(cfg(mode="disabled", retries=3))
    assert isinstance(got.value.__cause__, rex.ActorDiedError)
    assert len(FakeController.made) == 1


def test_launch_passes_bad_input_through_as_it_is(fake_run):
    """A UserError (say, a recover checkpoint of another format) keeps its exit code 2 and text."""
    fake_run.load_errors.append(UserError("the recover checkpoint has format 9"))
    with pytest.raises(UserError, match="format 9"):
        launch.launch(cfg())
    assert fake_run.log.failures == []


def test_launch_relaunches_when_an_error_came_from_a_dead_peer(fake_run):
    """The trainer's broadcast fails with a plain RuntimeError because the engine at the other end
    was killed: the attempt finds the dead actor and relaunches instead of giving up."""
    FakeController.failures = [remote(RuntimeError("Connection closed by peer [10.0.0.2]:1234"),
                                      "TrainerWorker.send_weights")]
    FakeController.dead = 1
    assert launch.launch(cfg()) == 0
    assert len(FakeController.made) == 2
    warning = fake_run.log.warnings[0]
    assert "WorkerDied" in warning
    assert "TrainerWorker.send_weights: RuntimeError: Connection closed" in warning


def test_launch_does_not_retry_a_bug_when_every_worker_is_alive(fake_run):
    FakeController.failures = [remote(RuntimeError("Connection closed by peer"))]
    with pytest.raises(RunFailed, match="Trainer.train_step: RuntimeError: Connection closed"):
        launch.launch(cfg(retries=3))
    assert len(FakeController.made) == 1


def test_ctrl_c_stops_the_workers_and_the_log_says_so(fake_run):
    FakeController.failures = [KeyboardInterrupt()]
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg(retries=3))
    assert (got.value.signame, got.value.exit_code) == ("Ctrl-C", 130)
    assert len(FakeController.made) == 1
    assert FakeController.made[0].stopped  # no relaunch
    said = "Run interrupted (Ctrl-C); the same command resumes it from the last recover checkpoint."
    assert fake_run.log.warnings == [said]


def _sigterm(times: int = 1) -> None:
    """Real SIGTERMs to this process; Python runs the handler before the next line."""
    import os
    import signal
    import time

    for _ in range(times):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)


def test_sigterm_with_on_sigterm_stop_unwinds_at_once_and_the_handler_is_put_back(fake_run, monkeypatch):
    """exp_ctrl.on_sigterm=stop: a real SIGTERM while the run trains ends it as Interrupted (exit
    code 143) at once, the workers stopped, and afterwards SIGTERM does what it did before."""
    import signal
    import time

    def stop_here():
        _sigterm()
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt the run")

    FakeController.failures = []
    monkeypatch.setattr(FakeController, "run", lambda self: stop_here())
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg(on_sigterm="stop"))
    assert (got.value.signame, got.value.exit_code, got.value.checkpoint) == ("SIGTERM", 143, "")
    assert str(got.value) == "interrupted (SIGTERM)"
    assert FakeController.made[0].stopped
    assert len(FakeController.made) == 1
    assert fake_run.log.warnings == [("Run interrupted (SIGTERM); the same command resumes it from the last "
                                      "recover checkpoint.")]
    assert signal.getsignal(signal.SIGTERM) is before


def _train_until_asked(ctrl, checkpoint="/r/globalstep3"):
    """The loop's side (Controller.run): go on after the SIGTERM, then stop between steps as asked."""
    assert not ctrl.should_stop()
    _sigterm()
    assert ctrl.should_stop(), "SIGTERM did not ask the loop to stop"
    return Outcome(Ending.STOPPED, 3, checkpoint, {"task_reward": 0.5})


def test_sigterm_during_training_asks_the_loop_to_stop_after_the_step_with_its_checkpoint(fake_run, monkeypatch):
    """on_sigterm=checkpoint (the default): the first SIGTERM does not unwind the loop; it asks it to
    stop after the step, and the log and the CLI line name the step and its checkpoint."""
    monkeypatch.setattr(FakeController, "run", _train_until_asked)
    FakeController.failures = []
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg())
    assert got.value.exit_code == 143
    assert len(FakeController.made) == 1
    assert FakeController.made[0].stopped
    assert fake_run.log.warnings == [
        "SIGTERM: the run stops after this step, with its recover checkpoint; a second SIGTERM stops it at once.",
        ("Run interrupted (SIGTERM) after global step 3, with its recover checkpoint /r/globalstep3; the same "
         "command resumes it from there.")]
    assert str(got.value) == ("interrupted (SIGTERM) after global step 3; its recover checkpoint is written, the "
                              "same command resumes from it")


def test_a_stop_asked_for_without_recover_checkpoints_says_so(fake_run, monkeypatch):
    """recover_mode=disabled: the loop stops after the step without a checkpoint; the log and the
    CLI line say the run stopped, exit code 143, and no relaunch follows."""
    monkeypatch.setattr(FakeController, "run", lambda ctrl: _train_until_asked(ctrl, checkpoint=""))
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg(mode="disabled"))
    assert (got.value.exit_code, str(got.value)) == (143, "interrupted (SIGTERM)")
    assert len(FakeController.made) == 1
    assert fake_run.log.warnings[-1] == ("Run interrupted (SIGTERM); the same command resumes it from the last "
                                         "recover checkpoint.")
    assert not [m for m in fake_run.log.infos if m.startswith("Training finished")]


def test_a_second_sigterm_stops_at_once(fake_run, monkeypatch):
    def run(self):
        _sigterm(2)
        raise AssertionError("the second SIGTERM did not interrupt the run")

    monkeypatch.setattr(FakeController, "run", run)
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg())
    assert got.value.checkpoint == ""
    assert len(fake_run.log.warnings) == 2
    assert fake_run.log.warnings[-1].startswith("Run interrupted (SIGTERM); the same command resumes")


def test_sigterm_before_training_runs_stops_at_once(fake_run, monkeypatch):
    """While the workers start there is no step to finish: SIGTERM unwinds at once."""
    def start(self):
        _sigterm()
        raise AssertionError("SIGTERM did not interrupt the start")

    monkeypatch.setattr(FakeController, "start", start)
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg())
    assert got.value.checkpoint == ""
    assert fake_run.log.warnings[0].startswith("Run interrupted (SIGTERM);")


def test_a_worker_death_after_sigterm_stops_the_run_without_a_relaunch(fake_run, monkeypatch):
    """A scheduler that signals every process kills the workers too: the step fails, and the run
    stops as interrupted, neither relaunched nor reported as a failure."""
    def run(self):
        _sigterm()
        raise rex.ActorDiedError()

    monkeypatch.setattr(FakeController, "run", run)
    with pytest.raises(Interrupted) as got:
        launch.launch(cfg(retries=3))
    assert len(FakeController.made) == 1
    assert isinstance(got.value.__cause__, rex.ActorDiedError)
    assert fake_run.log.failures == []
    assert fake_run.log.warnings[1].startswith("After SIGTERM the step did not finish (ActorDiedError")
    assert fake_run.log.warnings[2].startswith("Run interrupted (SIGTERM); the same command resumes")


def test_scancels_sigint_after_its_sigterm_still_stops_as_sigterm(fake_run, monkeypatch):
    """scancel signals every process of the job: the driver gets its SIGTERM (the loop is asked to
    stop after the step), then the batch shell's trap sends SIGINT to stop at once. The run stops
    as the SIGTERM's, exit code 143, whichever reaches the loop first: not as a Ctrl-C."""
    import os
    import signal
    import time

    def run(self):
        _sigterm()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the SIGINT raises before this ends
        raise AssertionError("SIGINT did not interrupt the run")

    monkeypatch.setattr(FakeController, "run", run)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a driver has it, whatever the runner's
    try:
        with pytest.raises(Interrupted) as got:
            launch.launch(cfg(retries=3))
    finally:
        signal.signal(signal.SIGINT, before)
    assert (got.value.signame, got.value.exit_code) == ("SIGTERM", 143)
    assert len(FakeController.made) == 1 and FakeController.made[0].stopped
    assert fake_run.log.warnings[-1] == ("Run interrupted (SIGTERM); the same command resumes it from the last "
                                         "recover checkpoint.")


def test_a_second_driver_of_a_running_run_is_refused_before_it_writes(fake_run):
    """The lock is a real flock on the log folder: held by the first driver (here, a descriptor of
    this process), refused to the second with the first one's pid and host, free once released."""
    import json

    (fake_run.dir / "driver.json").write_text(json.dumps({"pid": 4242, "host": "node-a"}))
    first = launch.hold_run_lock(str(fake_run.dir), "e/t")
    try:
        with pytest.raises(UserError) as got:
            launch.launch(cfg())
        assert str(got.value) == ("run e/t is already running (driver pid 4242 on node-a); stop it first, or give "
                                  "this one another trial_name=")
        assert FakeController.made == []
        assert fake_run.log.infos == []  # nothing started, nothing logged
    finally:
        import os

        os.close(first)
    assert launch.launch(cfg()) == 0  # the lock died with its holder
    assert launch.launch(cfg()) == 0  # and each launch gives its own back


def test_a_filesystem_without_locks_does_not_stop_a_run(tmp_path, monkeypatch):
    """NFS mounted with nolock answers flock with ENOLCK (stand-in: no such mount here): the run
    goes on, unguarded, rather than failing."""
    import errno
    import os

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(launch.fcntl, "flock", no_locks)
    fd = launch.hold_run_lock(str(tmp_path), "e/t")
    os.close(fd)


def test_a_signal_that_comes_back_as_another_error_is_still_a_stop(monkeypatch):
    """Ray's ray.get turns what a signal handler raised into a fresh KeyboardInterrupt, and C code
    can wrap it in a SystemError: `interruption` still names the signal; other errors are no stop."""
    from areal_kit import interrupts

    monkeypatch.setattr(interrupts, "_signalled", [])
    assert interrupts.interruption(KeyboardInterrupt()).signame == "Ctrl-C"
    interrupts._signalled.append(Interrupted("SIGTERM", 143))
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as k:
            raise SystemError("<built-in method __new__> returned a result with an exception set") from k
    except SystemError as e:
        wrapped = e
    assert interrupts.interruption(wrapped) is interrupts._signalled[-1]
    assert interrupts.interruption(RuntimeError("engine died")) is None


def test_a_ray_start_that_failed_on_its_thread_ends_the_run_in_one_line_without_a_relaunch(fake_run, monkeypatch):
    """Ray starts on a thread while the driver prepares the run; its failure (other than a time-out,
    below) reaches the user as any start failure does: one RunFailed line naming the error, the
    attempt's workers stopped."""

    def no_raylet():
        raise RuntimeError("Failed to start the raylet: /tmp/ray is not writable")

    monkeypatch.setattr(launch, "start_ray_early", lambda cfg: launch.raystart.InBackground(no_raylet))
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=3))
    assert str(got.value) == ("run e/t failed: RuntimeError: Failed to start the raylet: /tmp/ray is not writable "
                              f"(traceback in {fake_run.dir}/train.log)")
    assert len(FakeController.made) == 1 and FakeController.made[0].stopped


# What Ray 2.60's ray/_private/node.py raises when its raylet has not registered in 30 s: a bare Exception.
RAY_START_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
                     "failed to startup or the GCS has become overloaded.")


@pytest.mark.parametrize("make", [lambda: Exception(RAY_START_TIMEOUT), lambda: RuntimeError(RAY_START_TIMEOUT)],
                         ids=["as Ray raises it", "re-raised as a RuntimeError"])
def test_rays_start_timing_out_is_of_a_retryable_kind(make):
    assert retry.failure_kind(make()) == retry.RAY_START
    assert retry.failure_kind(Exception("The current node has no GPU")) is None
    assert retry.failure_kind(Exception(f"while starting: {RAY_START_TIMEOUT}")) is None, "Ray's own line, not a quote"


def test_rays_start_timing_out_is_relaunched_with_ray_started_again(fake_run, monkeypatch):
    """On a loaded machine Ray's raylet may not register in its 30 s: the relaunch starts Ray again
    (a new start, not the failed one's error again), within recover_retries, and the log says so."""
    starts = []

    def start(cfg):
        starts.append(cfg)
        if len(starts) == 1:
            def timed_out():
                raise Exception(RAY_START_TIMEOUT)  # noqa: TRY002 (Ray's own bare Exception)
            return launch.raystart.InBackground(timed_out)
        return launch.raystart.InBackground(lambda: False)

    monkeypatch.setattr(launch, "start_ray_early", start)
    assert launch.launch(cfg(retries=2)) == 0
    assert len(starts) == 2
    assert len(FakeController.made) == 2
    said = (f"Worker failure (Ray's start timed out: Exception: {RAY_START_TIMEOUT}); relaunching from the last "
            "recover checkpoint (retry 1/2).")
    assert fake_run.log.warnings == [said]


def test_rays_start_timing_out_at_every_try_stops_at_the_bound_naming_the_lever(fake_run, monkeypatch):
    def timed_out():
        raise Exception(RAY_START_TIMEOUT)  # noqa: TRY002 (Ray's own bare Exception)

    starts = []
    monkeypatch.setattr(launch, "start_ray_early",
                        lambda cfg: starts.append(cfg) or launch.raystart.InBackground(timed_out))
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=1))
    assert len(starts) == 2
    msg = str(got.value)
    assert msg.startswith("run e/t failed: Ray's start timed out again after 1 relaunch(es), the bound "
                          "recover_retries=1; a relaunch does not fix it: Ray's processes did not register")
    assert "ray start --head" in msg and "ray_address=auto" in msg


def test_bad_input_found_while_ray_starts_stops_that_ray_and_is_reported(fake_run, monkeypatch):
    """A UserError from prepare ends the launch with that error; the Ray it was starting on its
    thread is shut down once up, so a caller that goes on (a test, a notebook) has none left over.
    A Ray that was up before the launch (start_ray returned False) is the caller's: left alone."""
    import ray

    shut = []
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))

    def bad(cfg):
        raise UserError("actor.path=/nowhere is not a model folder")

    monkeypatch.setattr("areal_kit.rl.driver.job.prepare", bad)
    for started, shutdowns in ((True, [True]), (False, [True])):
        monkeypatch.setattr(launch, "start_ray_early", lambda cfg, s=started: launch.raystart.InBackground(lambda: s))
        with pytest.raises(UserError, match="actor.path=/nowhere"):
            launch.launch(cfg())
        assert shut == shutdowns
    assert FakeController.made == []


# -- failures that are no death, yet a relaunch fixes: OOM, a dead engine core, NCCL -------------
def _oom(fn="TrainerWorker.train_step"):
    import torch

    return remote(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), fn)


def _dist(kind="DistBackendError", text="NCCL communicator was aborted on rank 0"):
    import torch.distributed as dist

    return remote(getattr(dist, kind)(text), "TrainerWorker.train_step")


TRANSIENT = {
    "torch OOM in a trainer method": (_oom, "out of memory"),
    "torch OOM in an engine method": (lambda: _oom("RolloutWorker.generate"), "out of memory"),
    "CUDA OOM re-raised as RuntimeError": (lambda: remote(RuntimeError("CUDA error: out of memory")), "out of memory"),
    "NCCL error": (_dist, "NCCL/collective error"),
    "NCCL watchdog timeout": (lambda: _dist(text="Watchdog caught collective operation timeout"), "NCCL/collective error"),
    "store timeout": (lambda: _dist("DistStoreError", "wait timeout after 1800000ms"), "NCCL/collective error"),
    "gloo timeout (plain RuntimeError)": (lambda: remote(RuntimeError(
        "[gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete")),
        "NCCL/collective error"),
    "OOM re-raised from": (lambda: _chained(_oom()), "out of memory"),
    "engine core killed while it started": (lambda: _core_start(-9), "dead vLLM engine core"),
}


def _core_start(code: int, fn="RolloutWorker.setup"):
    """What vLLM raises in the engine's setup when its engine core process ended while it started
    (vllm/v1/engine/utils.py): a plain RuntimeError naming each core and its exit code."""
    return remote(RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): "
                               f"{{'EngineCore_DP0': {code}}}"), fn)


def _chained(cause):
    try:
        raise RuntimeError("step 3 failed") from cause
    except RuntimeError as e:
        return e


@pytest.mark.parametrize(("make", "kind"), TRANSIENT.values(), ids=TRANSIENT.keys())
def test_transient_failures_are_relaunched_and_named(make, kind):
    assert retry.failure_kind(make()) == kind
    assert launch.worker_died(make()) is False  # not a death: dead_workers() is no reason to relaunch it
    run_once, calls = attempts_raising(make(), make())
    log = Log()
    assert launch.relaunching(run_once, retries=2, log=log, pause=0, where=lambda: 3) == 0
    assert calls == [0, 1, 2]
    assert log.warnings[0].startswith(f"Worker failure ({kind} in global step 3: ")
    assert log.warnings[1].endswith("relaunching from the last recover checkpoint (retry 2/2).")


@pytest.mark.parametrize("make", BUGS.values(), ids=BUGS.keys())
def test_bugs_are_of_no_retryable_kind(make):
    assert retry.failure_kind(make()) is None


@pytest.mark.slow  # imports vLLM (~7 s)
def test_vllms_dead_engine_error_from_a_rollout_call_is_a_dead_engine_core():
    from vllm.v1.engine.exceptions import EngineDeadError

    err = remote(EngineDeadError(), "RolloutWorker.generate")
    assert retry.failure_kind(err) == retry.ENGINE
    assert "actor.vllm.gpu_memory_utilization" in retry.advice(retry.ENGINE, err)


def test_the_same_oom_at_the_same_step_past_the_bound_stops_with_one_line_naming_the_levers():
    last = _oom()
    run_once, calls = attempts_raising(_oom(), last)
    log = Log()
    with pytest.raises(retry.StillFailing) as got:
        launch.relaunching(run_once, retries=1, log=log, pause=0, where=lambda: 3, cfg=load_config("tiny"))
    line = str(got.value)
    assert calls == [0, 1] and len(log.warnings) == 1
    assert got.value.__cause__ is last
    assert "\n" not in line
    assert line.startswith("out of memory at global step 3 again after 1 relaunch(es), the bound recover_retries=1")
    tokens = load_config("tiny").actor_train.mb_spec.max_tokens_per_mb
    assert f"a smaller actor_train.mb_spec.max_tokens_per_mb (now {tokens})" in line  # rl/memory.py's levers
    assert "actor.zero_stage=3" in line
    assert line.endswith("(TrainerWorker.train_step: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)")


def test_an_engine_oom_names_the_engines_levers_and_another_step_is_not_again():
    steps = iter([2, 5])
    run_once, _ = attempts_raising(_oom("RolloutWorker.generate"), _oom("RolloutWorker.generate"))
    with pytest.raises(retry.StillFailing) as got:
        launch.relaunching(run_once, retries=1, log=Log(), pause=0, where=lambda: next(steps))
    line = str(got.value)
    assert line.startswith("out of memory at global step 5 after 1 relaunch(es)")
    assert "actor.vllm.gpu_memory_utilization" in line
    assert "max_tokens_per_mb" not in line


def test_without_retries_a_transient_failure_surfaces_as_it_is():
    err = _oom()
    run_once, calls = attempts_raising(err)
    with pytest.raises(RuntimeError) as got:
        launch.relaunching(run_once, retries=0, log=Log(), pause=0)
    assert got.value is err and calls == [0]


def test_launch_relaunches_an_oom_and_ends_in_one_line_when_it_comes_back(fake_run):
    FakeController.failures = [_oom(), _oom()]
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=1))
    msg = str(got.value)
    assert "\n" not in msg
    assert msg.startswith("run e/t failed: out of memory at global step 1 again after 1 relaunch(es)")
    assert "actor_train.mb_spec.max_tokens_per_mb" in msg
    assert [c.stopped for c in FakeController.made] == [True, True]
    assert "Worker failure (out of memory in global step 1: " in fake_run.log.warnings[-1]


def test_an_engine_core_dead_at_start_is_relaunched_and_the_log_says_which_and_how_often(fake_run):
    """The engines' setup, before any step: a core killed while it started (the kernel's OOM killer)
    is retried within recover_retries as a step's dead core is; one that raised is not."""
    FakeController.start_failures = [_core_start(-9), _core_start(-11)]
    assert launch.launch(cfg(retries=2)) == 0
    assert len(FakeController.made) == 3
    assert [w.split("; relaunching")[0] for w in fake_run.log.warnings] == [
        "Worker failure (dead vLLM engine core: RolloutWorker.setup: RuntimeError: Engine core initialization "
        f"failed. See root cause above. Failed core proc(s): {{'EngineCore_DP0': {code}}})" for code in (-9, -11)]
    assert fake_run.log.warnings[0].endswith("relaunching from the last recover checkpoint (retry 1/2).")
    assert fake_run.log.warnings[1].endswith("(retry 2/2).")


def test_an_engine_core_that_raised_while_it_started_fails_the_run_at_once(fake_run):
    FakeController.start_failures = [_core_start(1)]
    with pytest.raises(RunFailed) as got:
        launch.launch(cfg(retries=2))
    assert len(FakeController.made) == 1 and fake_run.log.warnings == []
    assert str(got.value).startswith("run e/t failed: RolloutWorker.setup: RuntimeError: Engine core initialization")


def test_an_oom_while_loading_past_the_bound_names_the_memory_plans_figures(fake_run, monkeypatch):
    """The same OOM at every load: the last line names the levers and the memory plan of the GPU
    that ran out (what the settings put on a trainer GPU, against what it has), whole."""
    import torch

    monkeypatch.setenv("AREAL_DEVICE", "cuda")  # the memory plan is a GPU run's
    fake_run.resume_from.append("/r/globalstep2")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    FakeController.restore_failures = [_load_failed(oom), _load_failed(oom)]
    c = cfg(retries=1, preset="1.5B_1gpu", more=["gpu_memory_gb=80"])
    with pytest.raises(RunFailed) as got:
        launch.launch(c)
    msg = str(got.value)
    assert "\n" not in msg and len(FakeController.made) == 2
    assert msg.startswith("run e/t failed: out of memory again after 1 relaunch(es), the bound recover_retries=1; a "
                          "relaunch does not fix it: set ")
    from areal_kit.rl.plan import memory_plan

    plan = memory_plan(c)
    trainer = plan.trainer
    assert f"; the memory plan: {trainer.title}: " in msg
    assert all(f"{part.name} {part.nbytes / 1e9:.3g} GB" in msg for part in trainer.parts if part.nbytes)
    assert f"= {trainer.total / 1e9:.3g} GB of 80 GB (gpu_memory_gb)" in msg
    assert "TrainerWorker.load_recover: OutOfMemoryError: CUDA out of memory" in msg
    assert msg.endswith(f"(traceback in {fake_run.dir}/train.log)")  # whole: never cut as a long line was


def test_an_engine_oom_past_the_bound_names_vllms_share_of_the_gpu(monkeypatch):
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    run_once, _ = attempts_raising(_oom("RolloutWorker.generate"), _oom("RolloutWorker.generate"))
    c = load_config("1.5B_1gpu", ["gpu_memory_gb=80"])
    with pytest.raises(retry.StillFailing) as got:
        launch.relaunching(run_once, retries=1, log=Log(), pause=0, where=lambda: 5, cfg=c)
    util = c.actor.vllm.gpu_memory_utilization
    assert f"; the memory plan: generation GPU (vLLM, TP 1, gpu_memory_utilization {util:g}): weights " in str(got.value)
    assert "KV cache" in str(got.value) and f"= {util * 80:.3g} GB of 80 GB" in str(got.value)


def test_on_cpu_an_oom_names_no_memory_plan(monkeypatch):
    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    run_once, _ = attempts_raising(_oom(), _oom())
    with pytest.raises(retry.StillFailing) as got:
        launch.relaunching(run_once, retries=1, log=Log(), pause=0, where=lambda: 5, cfg=load_config("1.5B_1gpu"))
    assert "memory plan" not in str(got.value)

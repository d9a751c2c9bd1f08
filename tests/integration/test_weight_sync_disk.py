"""weight_sync=disk: the trainer saves a Hugging Face folder, the engine loads it in place, its path
and its load report crossing vLLM's engine-core client (actor.vllm.engine_core=process: the core
in a process of its own, as on GPUs).

    .venv/bin/python -m pytest tests/integration/test_weight_sync_disk.py
"""

import pytest
from rl_run import Run, _engine_vs_trainer


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("disk"), ["exp_ctrl.total_train_steps=2", "weight_sync=disk",
                                                "ppo.max_head_offpolicyness=0", "actor.vllm.engine_core=process"])
    yield run
    run.close()


def test_engine_serves_the_saved_weights(disk_run):
    # The engine re-packs its CPU kernels from the loaded weights: a stale kernel is ~0.08 off.
    assert _engine_vs_trainer(disk_run, disk_run.ctrl.workers.engines.actors[0]) < 1e-4


def test_every_step_records_the_engine_load(disk_run):
    # Step 1's batch was generated before any sync; every later batch waited for a load.
    loads = [r["load_time"] for r in disk_run.rows]
    assert loads[0] == 0.0
    assert all(t > 0 for t in loads[1:])


def test_disk_load_reports_its_parts_as_a_broadcast_does(disk_run):
    # The weight-sync benchmark sets the disk path's re-pack beside the in-memory path's: the
    # figures must come from the same loader, so both are split the same way.
    import ray

    from areal_kit.rl.weight_sync.mode import weight_sync_dir

    engine, cfg = disk_run.ctrl.workers.engines.actors[0], disk_run.job.cfg
    version = ray.get(engine.get_version.remote()) + 1
    got = ray.get(engine.load_from_disk.remote(weight_sync_dir(cfg), version))
    assert got["load_wait"] == 0.0  # nothing on the wire
    assert 0 < got["load_repack"]
    assert 0 < got["load_copy"]
    assert got["load_repack"] + got["load_copy"] <= got["load_time"]
    assert got["load_placed"] == 0  # a file's tensors are copied into place, never received there
    assert ray.get(engine.get_version.remote()) == version

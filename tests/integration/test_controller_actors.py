"""The controller's dealings with its actors, on real Ray actors standing in for the workers.

Workers.dead: a killed actor is dead, a busy one alive; it decides whether an error seen during a
step came from a dead peer, which relaunches the run, or from a bug, which must not (rl/driver/launch.py).
WeightSync.push: the trainer joins the weight broadcast only after the engine's running generation, so a
long generation never holds it inside the collective until the group's timeout, and it is free
to train meanwhile (the send waits on the trainer's second concurrency group).
BatchRollout: batches queued k + 1 ahead of training, never past the last step, each with its own
sample seeds, and a batch whose weights fell more than k versions behind is never trained.
"""

import time
from types import SimpleNamespace

import pytest
import ray

from areal_kit.config.loader import load_config
from areal_kit.config.schema import ExpCtrl
from areal_kit.data.prompts import PromptLoader
from areal_kit.rl.algo.batch import sample_seed
from areal_kit.rl.common.stacks import StackDumps
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup, Workers
from areal_kit.rl.driver.job import RunState
from areal_kit.rl.driver.rollout import BatchRollout, make_rollout
from areal_kit.rl.driver.watchdog import Watchdog, WorkerHang
from areal_kit.rl.driver.weight_sync import WeightSync
from areal_kit.rl.sample import Generated, Sample
from areal_kit.rl.weight_sync import mode


class Worker(StackDumps):
    def busy(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_dead_workers_counts_killed_actors_only(ray_local):
    W = ray.remote(num_cpus=0)(Worker)
    trainer, busy, killed = W.remote(), W.remote(), W.remote()
    ray.get([a.__ray_ready__.remote() for a in (trainer, busy, killed)])
    dog = Watchdog(ExpCtrl(), "/nonexistent")
    workers = Workers(TrainerGroup([trainer], dog), EngineGroup([busy, killed], dog), dog)
    assert workers.dead(timeout_s=2) == 0
    busy.busy.remote(30)  # still running when asked: alive
    ray.kill(killed)
    time.sleep(1)
    assert workers.dead(timeout_s=2) == 1


class Engine:
    """Stands in for a rollout engine's call order only (real Ray actor, ordered calls)."""

    def __init__(self):
        self.log = []

    def generate(self, seconds: float) -> None:
        time.sleep(seconds)
        self.log.append(("generated", time.time()))

    def ready_for_weights(self) -> int:
        return 0

    def receive_weights(self, version: int, *ready, shared: bool = False) -> dict:
        self.log.append(("received", time.time()))
        return {}

    def events(self) -> list:
        return self.log


class Trainer:
    """Stands in for TrainerWorker's sync calls (created with its "weights" concurrency group)."""

    def __init__(self):
        self.sent_at = []

    def stage_weights(self) -> dict:
        return {}

    def send_weights(self, *engines_free, shared: bool = False) -> dict:
        self.sent_at.append(time.time())
        return {}

    def sends(self) -> list:
        return self.sent_at


def test_trainer_joins_the_broadcast_only_after_the_running_generation(ray_local):
    """A long generation must not hold the trainer inside the collective (its timeout would fire)."""
    engine = ray.remote(num_cpus=0)(Engine).remote()
    trainer = ray.remote(num_cpus=0, concurrency_groups={"weights": 1})(Trainer).remote()
    dog = Watchdog(ExpCtrl(), "/nonexistent")
    sync = WeightSync(mode.choose(load_config("tiny", ["weight_sync=broadcast"])), TrainerGroup([trainer], dog),
                      EngineGroup([engine], dog))
    engine.generate.remote(2.0)
    time.sleep(0.2)  # the generation is running
    sync.push(1)
    free_at = time.time()  # the trainer's side is done: it may train on
    sync.wait()
    events = dict(ray.get(engine.events.remote()))
    [sent] = ray.get(trainer.sends.remote())
    assert free_at < events["generated"] <= sent
    assert events["generated"] <= events["received"]


def stuck_in_a_call(seconds: float) -> None:
    time.sleep(seconds)  # the name a stack dump must show


class Stuck(StackDumps):
    def step(self, seconds: float) -> float:
        stuck_in_a_call(seconds)
        return seconds


def test_a_call_past_its_bound_is_a_hang_with_every_workers_stacks(ray_local, tmp_path):
    """Real actors, real faulthandler dumps: calls of 0.2 s set the median; the next one, stuck
    for a minute, is a hang once it passes 10x that median (with a 3 s floor), long before it ends."""
    S = ray.remote(num_cpus=0)(Stuck)
    a, b = S.remote(), S.remote()
    dog = Watchdog(ExpCtrl(hang_factor=10, hang_floor_s=3, hang_first_s=30, hang_warmup=2), str(tmp_path / "stacks"))
    names = ["trainer rank 0", "rollout engine 0"]
    dog.arm(dict(zip(names, ray.get([h.arm_stacks.remote(dog.stacks_dir, n) for h, n in zip((a, b), names)]))))
    for _ in range(2):
        dog.wait("step", dog.label([a.step.remote(0.2), b.step.remote(0.2)], ["trainer rank 0", "rollout engine 0"]))
    assert dog.bound("step") == 3  # 10 x 0.2 s is below the floor
    t0 = time.monotonic()
    with pytest.raises(WorkerHang) as hang:
        dog.wait("step", dog.label([a.step.remote(0.2), b.step.remote(60)], ["trainer rank 0", "rollout engine 0"]))
    assert 3 <= time.monotonic() - t0 < 20
    assert str(hang.value).startswith("rollout engine 0 ran step for 3s, past its bound of 3s")
    stacks = {p.name: p.read_text() for p in (tmp_path / "stacks").iterdir()}
    assert set(stacks) == {"trainer_rank_0.txt", "rollout_engine_0.txt", "driver.txt"}
    assert "stuck_in_a_call" in stacks["rollout_engine_0.txt"]
    assert "stuck_in_a_call" not in stacks["trainer_rank_0.txt"]  # it had finished: idle


class StaleEngine:
    """Stands in for a batch engine that never gets new weights: every answer is from version 0."""

    def __init__(self):
        self.calls = 0

    def generate(self, rows: list[dict]) -> Generated:
        self.calls += 1
        samples = [Sample(id=r["id"], group=i, prompt_ids=[1], output_ids=[2], logprobs=[0.0], no_eos=False,
                          version=0, task_reward=float(r["seed"])) for i, r in enumerate(rows)]
        return Generated(samples, 0.0, 0.0, 0, 0)

    def generated(self) -> int:
        return self.calls


def test_batch_rollout_queues_k_ahead_and_never_trains_past_the_bound(ray_local, tmp_path):
    cfg = load_config("tiny", [f"fileroot={tmp_path}", "ppo.max_head_offpolicyness=1", "dataset.train_bs_n_seqs=4"])
    dog = Watchdog(cfg.exp_ctrl, str(tmp_path / "stacks"))
    engine = ray.remote(num_cpus=0)(StaleEngine).remote()
    workers = SimpleNamespace(engines=EngineGroup([engine], dog), watchdog=dog)
    # Nothing pushed: no load to wait for.
    weights = WeightSync(mode.choose(cfg), TrainerGroup([], dog), workers.engines)
    rows = [{"id": str(i), "prompt_ids": [1]} for i in range(12)]
    state = RunState()
    job = SimpleNamespace(loader=PromptLoader(rows, batch_size=4, seed=1), total_steps=3)
    rollout = make_rollout(cfg.ppo, cfg.rollout, cfg.dataset, cfg.seed, job, workers, weights, state, log=None)
    assert isinstance(rollout, BatchRollout)
    for step in range(2):
        got = rollout.gather()
        assert (got.epoch, got.epoch_step, got.stale) == (0, step, step)
        assert [s.task_reward for s in got.train] == [sample_seed(cfg.seed, step, i) for i in range(4)]
        assert state.batches == step + 1 and len(rollout.queue) == 1  # the next one already generating
        assert ray.get(engine.generated.remote()) == step + 2
        state.version, state.global_step = state.version + 1, state.global_step + 1
        rollout.after_push()
    # Two updates since the third batch was queued, k = 1: its answers can no longer be trained.
    with pytest.raises(RuntimeError, match="sample staleness 2 exceeds max_head_offpolicyness 1"):
        rollout.gather()
    assert ray.get(engine.generated.remote()) == 3  # one step left: nothing queued past it

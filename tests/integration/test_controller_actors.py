"""The controller's dealings with its actors, on real Ray actors standing in for the workers.

Workers.dead: a killed actor is dead, a busy one alive; it decides whether an error seen during a
step came from a dead peer, which relaunches the run, or from a bug, which must not (rl/launch.py).
WeightSync.push: the trainer joins the weight broadcast only after the engine's running generation, so a
long generation never holds it inside the collective until the group's timeout, and it is free
to train meanwhile (the send waits on the trainer's second concurrency group).
"""

import os
import time

import pytest
import ray

from areal_kit.rl.weight_sync.sync import WeightSync
from areal_kit.rl.workers.groups import EngineGroup, TrainerGroup, Workers


class Worker:
    def busy(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.fixture()
def ray_local():
    # Workers import this module by name: put its folder on their path.
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": here}})
    yield
    ray.shutdown()


def test_dead_workers_counts_killed_actors_only(ray_local):
    W = ray.remote(num_cpus=0)(Worker)
    trainer, busy, killed = W.remote(), W.remote(), W.remote()
    ray.get([a.__ray_ready__.remote() for a in (trainer, busy, killed)])
    workers = Workers(TrainerGroup([trainer]), EngineGroup([busy, killed]))
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

    def get_version(self) -> int:
        return 0

    def receive_weights(self, version: int, shared: bool = False) -> dict:
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
    from types import SimpleNamespace

    engine = ray.remote(num_cpus=0)(Engine).remote()
    trainer = ray.remote(num_cpus=0, concurrency_groups={"weights": 1})(Trainer).remote()
    sync = WeightSync(SimpleNamespace(weight_sync="broadcast"), TrainerGroup([trainer]), EngineGroup([engine]))
    engine.generate.remote(2.0)
    time.sleep(0.2)  # the generation is running
    sync.push(1)
    free_at = time.time()  # the trainer's side is done: it may train on
    sync.wait()
    events = dict(ray.get(engine.events.remote()))
    [sent] = ray.get(trainer.sends.remote())
    assert free_at < events["generated"] <= sent
    assert events["generated"] <= events["received"]

"""Controller.dead_workers on real Ray actors: a killed actor is dead, a busy one is alive.

It decides whether an error seen during a step (say, the trainer's broadcast failing) came from a
dead peer, which relaunches the run, or from a bug, which must not (rl/launch.py).
"""

import os
import time

import pytest
import ray

from areal_kit.rl.actors import Workers
from areal_kit.rl.controller import Controller


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
    ctrl = Controller.__new__(Controller)  # only the workers matter here
    ctrl.workers = Workers(trainers=[trainer], rollouts=[busy, killed], gen_tp=1)
    assert ctrl.dead_workers(timeout_s=2) == 0
    busy.busy.remote(30)  # still running when asked: alive
    ray.kill(killed)
    time.sleep(1)
    assert ctrl.dead_workers(timeout_s=2) == 1

"""weight_sync_timeout_s bounds the transfer, not the wait for the slowest engine's generation.

With ppo.max_head_offpolicyness > 0 each engine's receive is queued behind its own generation. An
engine that finished early used to enter the receive at once and wait inside the collective for
the others (the trainer sends once every engine is free), and that wait counted against the
group's timeout. Here: real Ray actors, the real WeightSync, WeightSender and WeightReceiver, a
real gloo sync group with a 3 s timeout; the vLLM worker is a stand-in that receives the
broadcast. One engine generates for 0.1 s, the other for 8 s: the sync must still complete, and
no engine may spend more than the transfer inside the collective.

    .venv/bin/python -m pytest tests/integration/test_weight_sync_wait.py
"""

import time
from types import SimpleNamespace

import ray
import torch

from areal_kit import hardware
from areal_kit.config.loader import load_config
from areal_kit.config.schema import ExpCtrl
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.driver.watchdog import Watchdog
from areal_kit.rl.driver.weight_sync import WeightSync
from areal_kit.rl.engine.weight_receive import WeightReceiver
from areal_kit.rl.trainer.weight_send import WeightSender
from areal_kit.rl.weight_sync import mode, transport

TIMEOUT_S = 3.0
SLOW_S = 8.0  # the slow engine's generation: well past the timeout


def run_cfg():
    """The run's config, as the driver, the trainer and the engines each hold it: a broadcast sync under ZeRO-2."""
    return load_config("tiny", ["weight_sync=broadcast", f"weight_sync_timeout_s={TIMEOUT_S}", "actor.zero_stage=2"])


class Trainer(WeightSender):
    """Trainer rank 0 of one rank: the real sender, with a state of two tensors for its weights."""

    def __init__(self):
        self.rank, self.version, self.device, self.outbox = 0, 0, torch.device("cpu"), transport.Outbox()
        self.cfg = run_cfg()
        self.engine = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace()))
        self.state = {"a": torch.zeros(1000), "b": torch.zeros(3, 4)}

    def full_state(self, adapter_only: bool = False, every_rank: bool = False) -> dict:
        return self.state

    def set_weights(self, value: float) -> None:
        self.state = {k: torch.full_like(v, value) for k, v in self.state.items()}

    def address(self):
        return "127.0.0.1", hardware.free_port()


class Worker:
    """Stands in for vLLM's worker with WeightSyncExtension: joins the group, receives into fresh
    tensors and times its wait on the wire."""

    def __init__(self):
        self.weights: dict = {}

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(self, method)(*args)]

    def init_weight_sync(self, host, port, rank_offset, world, backend, plan, local_ip, timeout_s) -> int:
        self.store, self.group = transport.init_group(host, port, rank_offset, world, backend, timeout_s=timeout_s,
                                                      local_ip="127.0.0.1")
        self.plan = plan
        return rank_offset

    def receive_weights(self, shared: bool = False) -> dict:
        stats = {"wait": 0.0}
        for bucket in transport.receive(self.group, self.plan, torch.device("cpu"), stats):
            self.weights.update({name: t.clone() for name, t in bucket})
        return stats

    def reset_prefix_cache(self) -> None:
        pass


class Engine(WeightReceiver):
    def __init__(self):
        self.llm = Worker()
        self.cfg = run_cfg()

    def generate(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def weights(self) -> dict:
        return {k: float(v.sum()) for k, v in self.llm.weights.items()}


def test_an_engine_that_finishes_early_does_not_wait_out_the_timeout_in_the_receive(ray_local):
    trainer = ray.remote(num_cpus=0, concurrency_groups={"weights": 1})(Trainer).remote()
    engines = [ray.remote(num_cpus=0)(Engine).remote() for _ in range(2)]
    dog = Watchdog(ExpCtrl(), "/nonexistent")
    sync = WeightSync(mode.choose(run_cfg()), TrainerGroup([trainer], dog), EngineGroup(engines, dog))
    assert sync.connect() == "broadcast over gloo"
    t0 = time.time()
    generating = [engines[0].generate.remote(0.1), engines[1].generate.remote(SLOW_S)]
    ray.get(trainer.set_weights.remote(1.0))  # the step's new weights
    sync.push(1)
    loads = sync.wait()  # engine 0 used to time out in the receive, 3 s after its generation
    assert time.time() - t0 >= SLOW_S  # the sync waited for the slow generation, outside the group
    assert ray.get(generating) == [0.1, SLOW_S]
    assert [ray.get(e.weights.remote()) for e in engines] == [{"a": 1000.0, "b": 12.0}] * 2
    assert [ray.get(e.get_version.remote()) for e in engines] == [1, 1]
    assert max(load["load_wait"] for load in loads[1:]) < TIMEOUT_S / 2, loads  # the transfer alone

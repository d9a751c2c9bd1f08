"""Generation and training taking turns on shared GPUs (a colocated or per-role allocation_mode on
GPU nodes, and one GPU): the order of the switch, and the checks a run must pass to use it.

On such a layout every GPU holds a trainer rank and (a share of) a vLLM engine. The engines are
created with vLLM's sleep mode (`enable_sleep_mode`, hardware.vllm_kwargs) and, each step:

    turns = Turns(workers.engines, sharing.shares_gpus(cfg), cfg.actor.lora, workers.trainers)
    turns.before_train()                 # engines sleep: their weights and KV cache leave the GPU
    reply = trainers.train_step(rows)    # the trainer has the GPU (its states stay resident: rl/memory.py)
    sync_time = turns.after_train(lambda: weights.push(version, wait_engines=turns.active))
        # the trainer ranks return their cached memory, engines wake_up(tags=["weights"]), the
        # weight sync fills those weights, the ranks return what it cached, wake_up(tags=["kv_cache"])

torch's caching allocator keeps what a rank freed reserved for its next allocation: without the
release the training peak (activations, logits) would stay on the GPU through generation, beside
the engine's share. The memory plan (rl/memory.py) counts the peak in the training turn and the
rank's live tensors in the generation turn.

Sleep mode is CUDA-only: on CPU (where shared allocations run as worker slots that share cores,
not memory) every call here is a no-op, unless a test forces it (`active=True`). The engine's end
of the calls is rl/engine/sleeper.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.engine.worker import RolloutWorker
from areal_kit.rl.sharing import sleep_level
from areal_kit.rl.trainer.worker import TrainerWorker

if TYPE_CHECKING:
    from areal_kit.config.lora import LoRAConfig


class Turns:
    """The switch between the engines and the trainer on shared GPUs. engines: the EngineGroup
    (actors with RolloutWorker's sleep / wake_up, see sleeper.py, and its watchdog); active: whether
    the run's generation and training share GPUs (sharing.shares_gpus, a whole-run fact the loop
    decides); lora: the actor.lora section (an adapter-only sync keeps the base weights asleep)."""

    def __init__(self, engines: EngineGroup, active: bool, lora: LoRAConfig,
                 trainers: TrainerGroup | None = None) -> None:
        self.engines = engines
        self.trainers = trainers  # the TrainerGroup (actors with release.TrainerTurn's release_memory)
        self.active = active
        self.level = sleep_level(lora)
        self.asleep = False
        self.seconds: dict[str, float] = {}  # the last switch's parts, for the step's metrics

    def before_train(self) -> None:
        """Every engine sleeps (its generations are done: the step gathered them)."""
        if not self.active or self.asleep:
            return
        t0 = time.time()
        self.engines.all(RolloutWorker.sleep, self.level)
        self.asleep = True
        self.seconds = {"sleep_time": time.time() - t0}

    def after_train(self, push: Callable[[], float]) -> float:
        """Weights back on the GPU, push() fills them, then the KV cache; push's return value (the
        sync's seconds). push must return once every engine holds the new weights."""
        if not self.active or not self.asleep:
            return push()
        t0 = time.time()
        self._release()
        self.engines.all(RolloutWorker.wake_up, ["weights"])
        t1 = time.time()
        sync_time = push()
        t2 = time.time()
        self._release()  # what the sync's save cached (ZeRO-3 gathers the whole model)
        self.engines.all(RolloutWorker.wake_up, ["kv_cache"])
        self.asleep = False
        self.seconds.update(wake_weights_time=t1 - t0, wake_kv_time=time.time() - t2)
        return sync_time

    def _release(self) -> None:
        """Every trainer rank returns the memory its allocator holds free, before an engine wakes."""
        if self.trainers is not None:
            self.trainers.all(TrainerWorker.release_memory)

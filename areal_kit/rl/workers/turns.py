"""Generation and training taking turns on shared GPUs (a colocated or per-role allocation_mode on
GPU nodes, and one GPU): the order of the switch, and the checks a run must pass to use it.

On such a layout every GPU holds a trainer rank and (a share of) a vLLM engine. The engines are
created with vLLM's sleep mode (`enable_sleep_mode`, hardware.vllm_kwargs) and, each step:

    turns = Turns(cfg, workers.engines)
    turns.before_train()                 # engines sleep: their weights and KV cache leave the GPU
    stats = trainers.train_step(rows)    # the trainer has the GPU (its states stay resident: rl/memory.py)
    sync_time = turns.after_train(lambda: weights.push(version, wait_engines=turns.active))
        # the trainer ranks return their cached memory, engines wake_up(tags=["weights"]), the
        # weight sync fills those weights, the ranks return what it cached, wake_up(tags=["kv_cache"])

torch's caching allocator keeps what a rank freed reserved for its next allocation: without the
release the training peak (activations, logits) would stay on the GPU through generation, beside
the engine's share. The memory plan (rl/memory.py) counts the peak in the training turn and the
rank's live tensors in the generation turn.

Sleep mode is CUDA-only: on CPU (where shared allocations run as worker slots that share cores,
not memory) every call here is a no-op, unless a test forces it (`active=True`). The engine's end
of the calls is rl/workers/sleeper.py.
"""

from __future__ import annotations

import time

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.rollout import streaming
from areal_kit.errors import UserError
from areal_kit.rl import lora

# Level 2 discards the weights as well as the KV cache instead of copying them to host memory
# (level 1): the weight sync re-sends every weight after each step anyway, so a copy would cost a
# device-to-host and a host-to-device transfer of the model a step, and pinned host memory per
# engine, for bytes that are overwritten at once. vLLM keeps the model's buffers (rotary caches)
# across level 2 itself. A LoRA run whose sync sends the adapter alone never re-sends the base
# weights: it sleeps at level 1, which keeps them.
SLEEP_LEVEL = 2
ADAPTER_SLEEP_LEVEL = 1


def shares_gpus(cfg, plat: hardware.Platform | None = None) -> bool:
    """Whether generation and training take turns on the same GPUs (never on CPU)."""
    plat = plat or hardware.detect()
    return not plat.is_cpu and parse_allocation(cfg.allocation_mode).kind != "decoupled"


def sleep_mode(cfg, plat: hardware.Platform | None = None) -> bool:
    """Whether the run's engines start with vLLM's sleep mode (enable_sleep_mode)."""
    return shares_gpus(cfg, plat)


def sleep_level(cfg) -> int:
    return ADAPTER_SLEEP_LEVEL if lora.sends_adapter(cfg) else SLEEP_LEVEL


def check(cfg, plat: hardware.Platform | None = None) -> None:
    """Refuse, in one line each, the settings a run on shared GPUs cannot take."""
    if not shares_gpus(cfg, plat):
        return
    a = parse_allocation(cfg.allocation_mode)
    where = f"allocation_mode={a.text} shares GPUs between generation and training (they take turns)"
    split = a.split()
    apart = f", or split the GPUs: allocation_mode={split}" if split else ""
    if cfg.ppo.max_head_offpolicyness > 0:
        raise UserError(f"{where}, so generation cannot overlap training: ppo.max_head_offpolicyness="
                        f"{cfg.ppo.max_head_offpolicyness}; use ppo.max_head_offpolicyness=0{apart}")
    if streaming(cfg):
        raise UserError(f"{where}: rollout.mode={cfg.rollout.mode} streams during training; use rollout.mode=batch"
                        f"{apart}")
    if cfg.weight_sync == "broadcast":
        raise UserError(f"{where}: weight_sync=broadcast would put two NCCL ranks on one GPU, which NCCL refuses; "
                        f"use weight_sync=auto or weight_sync=disk{apart}")
    if cfg.spread_roles:
        raise UserError(f"{where}: spread_roles=true asks for generation and training on different nodes; "
                        f"use spread_roles=false{apart}")


class Turns:
    """The switch between the engines and the trainer on shared GPUs. engines: the EngineGroup
    (actors with RolloutWorker's sleep / wake_up, see sleeper.py, and its watchdog)."""

    def __init__(self, cfg, engines, plat: hardware.Platform | None = None, active: bool | None = None,
                 trainers=None):
        self.engines = engines
        self.trainers = trainers  # the TrainerGroup (actors with release.TrainerTurn's release_memory)
        self.active = shares_gpus(cfg, plat) if active is None else active
        self.level = sleep_level(cfg)
        self.asleep = False
        self.seconds: dict[str, float] = {}  # the last switch's parts, for the step's metrics

    def before_train(self) -> None:
        """Every engine sleeps (its generations are done: the step gathered them)."""
        if not self.active or self.asleep:
            return
        t0 = time.time()
        self._all(self.engines, "sleep", self.level)
        self.asleep = True
        self.seconds = {"sleep_time": time.time() - t0}

    def after_train(self, push) -> float:
        """Weights back on the GPU, push() fills them, then the KV cache; push's return value (the
        sync's seconds). push must return once every engine holds the new weights."""
        if not self.active or not self.asleep:
            return push()
        t0 = time.time()
        self._release()
        self._all(self.engines, "wake_up", ["weights"])
        t1 = time.time()
        sync_time = push()
        t2 = time.time()
        self._release()  # what the sync's save cached (ZeRO-3 gathers the whole model)
        self._all(self.engines, "wake_up", ["kv_cache"])
        self.asleep = False
        self.seconds.update(wake_weights_time=t1 - t0, wake_kv_time=time.time() - t2)
        return sync_time

    def _release(self) -> None:
        """Every trainer rank returns the memory its allocator holds free, before an engine wakes."""
        if self.trainers is not None:
            self._all(self.trainers, "release_memory")

    @staticmethod
    def _all(group, method: str, *args) -> list:
        """Call method on every actor of group and wait, under the watchdog's bound for that call."""
        refs = [getattr(a, method).remote(*args) for a in group.actors]
        dog = group.watchdog
        return dog.wait(method, dog.label(refs, group.names))


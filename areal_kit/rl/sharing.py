"""Which runs share GPUs between generation and training, and what such a run may not ask for.

A config-level fact both sides read: the driver's placement and turns (rl/driver/), the engines'
sleep mode (rl/engine/worker.py) and the weight sync's choice of CUDA IPC
(rl/weight_sync/mode.py). The switch itself is rl/driver/turns.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.rollout import streaming
from areal_kit.errors import UserError
from areal_kit.rl import lora

if TYPE_CHECKING:
    from areal_kit.config.lora import LoRAConfig
    from areal_kit.config.schema import TrainConfig

# Level 2 discards the weights as well as the KV cache instead of copying them to host memory
# (level 1): the weight sync re-sends every weight after each step anyway, so a copy would cost a
# device-to-host and a host-to-device transfer of the model a step, and pinned host memory per
# engine, for bytes that are overwritten at once. vLLM keeps the model's buffers (rotary caches)
# across level 2 itself. A LoRA run whose sync sends the adapter alone never re-sends the base
# weights: it sleeps at level 1, which keeps them.
SLEEP_LEVEL = 2
ADAPTER_SLEEP_LEVEL = 1


def shares_gpus(cfg: TrainConfig, plat: hardware.Platform | None = None) -> bool:
    """Whether generation and training take turns on the same GPUs (never on CPU)."""
    plat = plat or hardware.detect()
    return not plat.is_cpu and parse_allocation(cfg.allocation_mode).kind != "decoupled"


def sleep_mode(cfg: TrainConfig, plat: hardware.Platform | None = None) -> bool:
    """Whether the run's engines start with vLLM's sleep mode (enable_sleep_mode)."""
    return shares_gpus(cfg, plat)


def sleep_level(lcfg: LoRAConfig) -> int:
    """The level the engines sleep at, from the actor.lora section."""
    return ADAPTER_SLEEP_LEVEL if lora.sends_adapter(lcfg) else SLEEP_LEVEL


def check(cfg: TrainConfig, plat: hardware.Platform | None = None) -> None:
    """Refuse, in one line each, the settings a run on shared GPUs cannot take, and weight_sync=ipc
    where no engine worker has a trainer rank beside it, or generations stream through a sync."""
    a = parse_allocation(cfg.allocation_mode)
    if cfg.weight_sync == "ipc" and a.kind == "decoupled":
        raise UserError(f"weight_sync=ipc hands each engine worker the buffer of the trainer rank on its device, but "
                        f"allocation_mode={a.text} keeps them apart; use weight_sync=auto, or a shared allocation_mode "
                        "such as d2p1m1")
    if cfg.weight_sync == "ipc" and streaming(cfg):
        raise UserError(f"weight_sync=ipc loads a chunk at a time, which generations must not see: rollout.mode="
                        f"{cfg.rollout.mode} streams through it; use rollout.mode=batch or weight_sync=auto")
    if not shares_gpus(cfg, plat):
        return
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

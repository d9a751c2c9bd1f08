"""How a run's weights travel from the trainer to the engines: the one place that chooses
(`sync_mode`), read by the plan and by both sides of the sync, what the driver's weight sync reads
of the run (`choose`), and the size of the IPC buffer shared layouts use.

    mode = sync_mode(cfg)   # ipc | disk | auto | broadcast
    sync = WeightSync(choose(cfg), trainers, engines)   # rl/driver/weight_sync.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_kit import hardware
from areal_kit.config.rollout import streaming
from areal_kit.rl import lora, sharing
from areal_kit.rl.weight_sync import ipc

if TYPE_CHECKING:
    from areal_kit.config.lora import LoRAConfig
    from areal_kit.config.schema import TrainConfig

# The buffer's size, unless one tensor is larger (the 1.5B model's embedding is 0.47 GB): vLLM's
# own packed IPC default. Fewer chunks mean fewer round trips; the buffer is freed after the sync.
IPC_BUFFER_BYTES = 1 << 30


def sync_mode(cfg: TrainConfig, plat: hardware.Platform | None = None) -> str:
    """How the run's weights travel: ipc, disk, auto (broadcast, or shared memory on one CPU
    node) or broadcast. weight_sync=auto on shared GPUs is ipc: the broadcast's NCCL group
    would need two ranks on one GPU, which NCCL refuses. A LoRA run that sends its adapter alone
    (megabytes, loaded through vLLM's LoRA manager) goes through disk there."""
    if cfg.weight_sync == "ipc" or (cfg.weight_sync == "auto" and sharing.shares_gpus(cfg, plat)):
        return "disk" if lora.sends_adapter(cfg.actor.lora) else "ipc"
    return cfg.weight_sync


def capacity(largest: int) -> int:
    """The IPC buffer's bytes for a model whose largest tensor has `largest` bytes."""
    return max(IPC_BUFFER_BYTES, ipc.aligned(largest))


def weight_sync_dir(cfg: TrainConfig) -> str:
    """Where weight_sync=disk saves the weights each step (the engines reload them from there)."""
    return os.path.join(cfg.fileroot, "cache", "weight_sync", cfg.experiment_name, cfg.trial_name)


@dataclass(frozen=True)
class SyncChoice:
    """The few values of a run the driver's weight sync reads (`choose` makes it from the config)."""

    mode: str  # sync_mode's: ipc | disk | auto | broadcast
    lora: LoRAConfig  # the actor.lora section: an adapter-only sync sends the adapter, else the (merged) model
    streaming: bool  # rollout.mode=stream: the engines pause before each broadcast
    folder: str  # weight_sync_dir's: where weight_sync=disk saves


def choose(cfg: TrainConfig, plat: hardware.Platform | None = None) -> SyncChoice:
    """How cfg's weights travel, and what else the driver's sync reads of it."""
    return SyncChoice(sync_mode(cfg, plat), cfg.actor.lora, streaming(cfg), weight_sync_dir(cfg))

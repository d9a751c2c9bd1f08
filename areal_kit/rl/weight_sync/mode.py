"""How a run's weights travel from the trainer to the engines: the one place that chooses
(`sync_mode`), read by the plan and by both sides of the sync, and the size of the IPC buffer
shared layouts use.

    mode = sync_mode(cfg)   # ipc | disk | auto | broadcast
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from areal_kit import hardware
from areal_kit.rl import lora, sharing
from areal_kit.rl.weight_sync import ipc

if TYPE_CHECKING:
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

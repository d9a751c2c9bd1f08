"""Model saves as Hugging Face folders, loadable by transformers and vLLM.

Saves go to {fileroot}/checkpoints/{user}/{exp}/{trial}/actor/epoch{e}epochstep{s}globalstep{g}/;
keep_last_n prunes older ones. A failed save (disk full, permission denied) stops the run with
one line (RunFailed, exit code 1: the run had trained) and leaves earlier saves intact: the trainer writes to a temporary folder and renames
it only when complete. When a save is due is the Checkpointer's call (checkpointer.py).
"""

from __future__ import annotations

import os
import shutil
from typing import Protocol

from ray.exceptions import RayTaskError

from areal_kit.checkpoints import step_of
from areal_kit.errors import RunFailed, describe


class Saver(Protocol):
    """The trainer ranks, as a save uses them (the driver's Trainers group)."""

    def save_hf(self, path: str) -> None: ...


def save(trainers: Saver, path: str, keep_last_n: int) -> str:
    """Every trainer rank joins (ZeRO-3 gathers); rank 0 writes `path`. Older saves beyond
    keep_last_n are removed after it is complete."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        trainers.save_hf(path)
    except (OSError, RayTaskError) as e:  # here, or the trainer's, wrapped by Ray
        raise RunFailed(f"saving the model to {path} failed ({describe(e)}); earlier saves are intact. "
                        "Free space or fix permissions on fileroot, then re-run to resume") from e
    prune(os.path.dirname(path), keep_last_n)
    return path


def prune(actor_dir: str, keep_last_n: int) -> None:
    if keep_last_n <= 0:
        return
    saves = sorted((d for d in os.listdir(actor_dir) if step_of(d) >= 0), key=step_of)
    for d in saves[:-keep_last_n]:
        shutil.rmtree(os.path.join(actor_dir, d), ignore_errors=True)

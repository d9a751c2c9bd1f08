"""Persistent model saves (Hugging Face folders) and the hook for recover checkpoints.

Saves go to {fileroot}/checkpoints/{user}/{exp}/{trial}/actor/epoch{e}epochstep{s}globalstep{g}/,
loadable by transformers and vLLM; keep_last_n prunes older ones. A failed save (disk full,
permission denied) stops the run with one line and leaves earlier saves intact: the trainer
writes to a temporary folder and renames it only when complete.
"""

from __future__ import annotations

import os
import re
import shutil

from areal_kit.errors import UserError


def save_dir(ctrl, epoch: int, epoch_step: int) -> str:
    g = ctrl.state.global_step
    return os.path.join(ctrl.job.paths.ckpt_dir, "actor", f"epoch{epoch + 1}epochstep{epoch_step + 1}globalstep{g}")


def save_model(ctrl, epoch: int, epoch_step: int) -> str:
    import ray

    path = save_dir(ctrl, epoch, epoch_step)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ray.get([t.save_hf.remote(path) for t in ctrl.workers.trainers])
    except (OSError, ray.exceptions.RayTaskError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"saving the model to {path} failed ({reason}); earlier saves are intact. "
                        "Free space or fix permissions on fileroot, then re-run to resume") from None
    ctrl.log.info(f"Saved model to {path}")
    prune(os.path.dirname(path), ctrl.cfg.exp_ctrl.keep_last_n)
    return path


def step_of(name: str) -> int:
    """The global step of a save's folder name; -1 for any other name (a save under way ends .tmp)."""
    m = re.search(r"globalstep(\d+)$", name)
    return int(m.group(1)) if m else -1


def prune(actor_dir: str, keep_last_n: int) -> None:
    if keep_last_n <= 0:
        return
    saves = sorted((d for d in os.listdir(actor_dir) if step_of(d) >= 0), key=step_of)
    for d in saves[:-keep_last_n]:
        shutil.rmtree(os.path.join(actor_dir, d), ignore_errors=True)


def maybe_dump_recover(ctrl, epoch: int, epoch_step: int, end_of_epoch: bool) -> None:
    """Recover checkpoints: see areal_kit/rl/checkpoint/recover.py (no-op until it exists)."""
    try:
        from areal_kit.rl.checkpoint import recover
    except ImportError:
        return
    recover.maybe_dump(ctrl, epoch, epoch_step, end_of_epoch)

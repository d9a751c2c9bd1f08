"""How a run's model saves are named on disk, for the trainer that writes them and the tools that
read them (`areal-kit eval` over a folder of saves, `areal-kit logs`).

A save is the Hugging Face folder {ckpt_dir}/actor/epoch{e}epochstep{s}globalstep{g}/ (epoch and
epoch step count from 1); while it is written it carries .tmp at the end, so a name that does not
end in its global step is no save.

    from areal_kit.checkpoints import save_dir, step_of
    step_of("epoch1epochstep6globalstep6")   # 6; -1 for epoch1epochstep6globalstep6.tmp
"""

from __future__ import annotations

import os
import re


def save_dir(ckpt_dir: str, epoch: int, epoch_step: int, global_step: int) -> str:
    """The folder of the save after `global_step` (epoch and epoch_step from 0, as the loader counts)."""
    return os.path.join(ckpt_dir, "actor", f"epoch{epoch + 1}epochstep{epoch_step + 1}globalstep{global_step}")


def step_of(name: str) -> int:
    """The global step of a save's folder name; -1 for any other name (a save under way ends .tmp)."""
    m = re.search(r"globalstep(\d+)$", name)
    return int(m.group(1)) if m else -1

"""The command-line options several commands take, each declared once (areal_kit/flags.py).

    areal-kit setup --hostnames h1 h2 --storage /mnt/nas --mirror http://mirror:8000
    areal-kit eval --model_path CKPT --storage /mnt/nas        # its sets under STORAGE/datasets/eval
    areal-kit doctor --slurm --partition gpu --storage /storage

The shared storage was spelled --storage_root in eval: that spelling still works, with a note of
the new one on stderr.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_kit.flags import flag


@dataclass
class Storage:
    """The shared storage: setup mounts and fills it, eval reads its sets there, doctor --slurm checks it."""

    storage: str | None = flag(None, "--storage", old=("--storage_root", "--storage-root"),
                               help="Shared storage path, the same on every host (default /storage; doctor "
                                    "--slurm: this folder). Setup fetches models and data onto it, eval reads "
                                    "its sets from STORAGE/datasets/eval, doctor --slurm checks every node shares it.")


@dataclass
class Mirror:
    """Where fetches come from on clusters that reach no hub (setup's sources, eval's missing sets)."""

    mirror: str | None = flag(None, "--mirror", envvar="AREAL_KIT_MIRROR", show_envvar=True,
                              help="Fetch from this mirror, laid out as the origins: MIRROR/HOST/PATH for "
                                   "https://HOST/PATH, MIRROR/huggingface.co/ORG/NAME/ for hf://ORG/NAME (air-gapped "
                                   "clusters). Setup fetches every source there, eval a missing eval set.")

"""The command-line options commands of several packages take, each declared once (areal_kit/flags.py).

    areal-kit setup --hostnames h1 h2 --storage /mnt/nas --mirror http://mirror:8000
    areal-kit eval --model_path CKPT --storage /mnt/nas        # its sets under STORAGE/datasets/eval
    areal-kit doctor --slurm --partition gpu --storage /storage

An option the commands of one package share is that package's: cluster/target.py's Hosts and Route
(setup, status, down, doctor), eval/options.py's Generation and Engines (eval, filter). Where the
commands' defaults differ, the option is declared without one (None: not given) and each command's
own dataclass holds its default, which build() gives it. The shared storage was spelled
--storage_root in eval: that spelling still works, with a note of the new one on stderr.
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


@dataclass
class Python:
    """The Python with areal-kit on the hosts: a cluster's (setup, status, down, doctor) or Slurm's nodes'
    (train --slurm, whose SlurmOptions extend this, and doctor --slurm)."""

    python: str | None = flag(None, "--python",
                              help="Python with areal-kit and Ray on the hosts: setup's, inside the image (docker) "
                                   "or on the hosts (host), default python3; status, down, doctor: as at setup. "
                                   "With --slurm: the one on the nodes, default this one (which must be on storage "
                                   "every node mounts); in a --container: python3.")


@dataclass
class Output:
    """What a command prints: its plan instead of running (setup, down, train), JSON for programs (doctor, train)."""

    dry_run: bool = flag(False, "--dry-run",
                         help="Run nothing: setup and down print every command per host; train validates "
                              "everything checkable without GPUs and prints the plan.")
    as_json: bool = flag(False, "--json",
                         help="Print JSON: doctor's results as one object (the live view goes to stderr); train "
                              "--show-args' options as an array of {key, value, type, default, help[, choices]}.")

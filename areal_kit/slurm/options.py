"""The Slurm options of `areal-kit train --slurm`, `status --slurm` and `doctor --slurm`, declared once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal_kit.errors import UserError
from areal_kit.flags import flag, many
from areal_kit.options import Python

# many() returns dataclasses.field(...); ruff's RUF009 knows only field() by name.
# ruff: noqa: RUF009

CONTAINER_RUNTIMES = ("apptainer", "pyxis")
# Slurm's --time forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or "UNLIMITED".
_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^UNLIMITED$|^INFINITE$", re.IGNORECASE)


@dataclass
class SlurmOptions(Python):
    """Where and how a run is submitted to Slurm; its --python (Python's) is the one doctor --slurm and
    the cluster commands take."""

    slurm: bool = flag(False, "--slurm", help="Work through Slurm. train: submit the run with "
                       "sbatch instead of running it here: Ray's head and the driver on the job's first node, the "
                       "others join through srun; prints the job id and its log (with --dry-run: the sbatch script, "
                       "nothing submitted). status: this user's areal-kit jobs in Slurm's queue: state, nodes, each "
                       "run's last step and ETA. doctor: check a Slurm partition (--partition): its nodes' state, "
                       "their GPUs against --preset, and through srun on each node the shared storage (--storage) "
                       "and areal-kit's Python (--python; default: this one).")
    partition: str | None = flag(None, "--partition", help="With --slurm: the partition (default: Slurm's default "
                                 "partition).")
    account: str | None = flag(None, "--account", help="With --slurm: the account to charge.")
    time: str | None = flag(None, "--time", help="With --slurm: the job's time limit, in sbatch's form (e.g. 4:00:00, "
                            "2-00:00:00). The run checkpoints --signal-grace seconds before it and the job requeues.")
    signal_grace: int = flag(300, "--signal-grace", min=60, help="With --slurm: seconds before the time limit at which "
                             "the job is signalled to finish its step, write its recover checkpoint and requeue (at "
                             "least a step plus a checkpoint; Slurm may signal up to 60 s early).")
    container: str | None = flag(None, "--container", help="With --slurm: run Ray and the driver in this image "
                                 "(an Apptainer .sif path, or an image pyxis/enroot can pull) instead of the Python "
                                 "environment of --python.")
    container_runtime: str = flag("apptainer", "--container-runtime", help="With --container: apptainer (apptainer "
                                  "exec --nv; also Singularity's) or pyxis (srun --container-image).")
    sbatch_args: list[str] = many("--sbatch-arg", help="With --slurm: one more sbatch option, as written on an "
                                  "#SBATCH line (e.g. --qos=high, --constraint=a100); repeatable.")

    def check(self) -> None:
        if not self.slurm:
            given = [n for n, v in (("--partition", self.partition), ("--account", self.account), ("--time", self.time),
                                    ("--container", self.container), ("--python", self.python)) if v]
            if given or self.sbatch_args:
                raise UserError(f"{(given or ['--sbatch-arg'])[0]} goes with --slurm (areal-kit train PRESET --slurm "
                                f"{(given or ['--sbatch-arg'])[0]} ...)")
            return
        if self.time is not None and not _TIME.match(self.time):
            raise UserError(f"--time {self.time!r}: expected sbatch's form, e.g. 30, 4:00:00 or 2-00:00:00")
        if self.container_runtime not in CONTAINER_RUNTIMES:
            raise UserError(f"--container-runtime {self.container_runtime!r}: expected one of "
                            f"{', '.join(CONTAINER_RUNTIMES)}")
        for a in self.sbatch_args:
            if not a.startswith("-") or "\n" in a:
                raise UserError(f"--sbatch-arg {a!r}: expected one sbatch option, e.g. --qos=high")

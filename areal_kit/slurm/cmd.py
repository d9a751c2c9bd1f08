"""`areal-kit train PRESET --slurm`, `areal-kit status --slurm` and `areal-kit doctor --slurm`.

    areal-kit train tiny --slurm --partition cpu --dry-run     # the script, checked against the partition
    areal-kit train 1.5B_n4 --slurm --partition gpu --time 12:00:00
    areal-kit status --slurm

The script and the job's record (slurm.sbatch, slurm.json) and the job's output (slurm.log) go in
the run's log folder, beside train.log: `areal-kit logs RUN` finds the job there.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from areal_kit import durable, hardware, logs
from areal_kit.config.loader import load_config
from areal_kit.console import make_console
from areal_kit.errors import ExitCode, RunFailed, UserError
from areal_kit.runlog import run_paths, tail_lines
from areal_kit.slurm import cluster
from areal_kit.slurm import doctor as doc
from areal_kit.slurm.options import SlurmOptions
from areal_kit.slurm.script import Job, sbatch_script

RECORD, SCRIPT, LOG = "slurm.json", "slurm.sbatch", "slurm.log"


def submit(preset: str, overrides: list[str], o: SlurmOptions, *, dry_run: bool, fresh: bool,
           discard: bool = False) -> int:
    """Check the preset against the partition, write the sbatch script, submit it; print the job id and log."""
    o.check()
    if Path(preset).suffix in (".yaml", ".yml"):
        preset = os.path.abspath(preset)  # the job reads it from the node: shared storage, by its full path
    cfg = load_config(preset, overrides)  # bad input here, before Slurm is asked
    fileroot = os.path.abspath(cfg.fileroot)  # the job's nodes are given it whole (the cwd differs there)
    paths = run_paths(fileroot, cfg.experiment_name, cfg.trial_name)
    console = make_console(highlight=False)
    what = f"{Path(preset).stem} ({cfg.n_nodes} node(s))"
    try:
        part = cluster.partition(o.partition)
    except (UserError, RunFailed) as e:
        # Slurm absent (UserError: not found), or there but not answering (RunFailed: a client
        # without a configuration, a controller down or silent): a dry run shows the script as the
        # preset sizes it, unchecked, with the reason; a partition Slurm named as missing stays an error.
        if not (dry_run and (isinstance(e, RunFailed) or "not found" in str(e))):
            raise
        part = None
        unchecked = str(e) if isinstance(e, UserError) else f"Slurm cannot be asked here ({e})"
        console.print(f"note: {unchecked}; the script below is not checked against a partition", markup=False,
                      soft_wrap=True)
    cpu = hardware.detect().is_cpu if part is None else not any(n.gpus for n in part.nodes)
    gpus = 0 if cpu else cfg.n_gpus_per_node
    if part is not None:
        why = cluster.refusal(part, what, cfg.n_nodes, gpus)
        if why:
            raise UserError(why)
    record = os.path.join(paths.log_dir, RECORD)
    earlier = durable.read_json(record)
    if earlier and part is not None:
        st = cluster.job_state(earlier["job_id"])
        if st.active:
            raise UserError(f"run {cfg.experiment_name}/{cfg.trial_name} is Slurm job {st.job_id} already ({st.state}): "
                            f"scancel {st.job_id} first, or another trial_name=")
    binds = sorted({fileroot, *([cfg.storage_root] if os.path.isabs(cfg.storage_root) and
                                os.path.isdir(cfg.storage_root) else [])})
    job = Job(preset=preset, overrides=[*overrides, f"fileroot={fileroot}"],
              name=f"areal-{cfg.experiment_name}-{cfg.trial_name}", n_nodes=cfg.n_nodes, gpus_per_node=gpus,
              log=os.path.join(paths.log_dir, LOG), log_dir=paths.log_dir,
              script=os.path.join(paths.log_dir, SCRIPT), binds=binds, fresh=fresh,
              discard=discard)
    text = sbatch_script(job, o)
    if dry_run:
        console.out(text, highlight=False)
        where = f"partition {part.name}, {len(part.usable)} node(s) up" if part else "no partition checked"
        console.print(f"dry run: {what} fits ({where}); nothing written or submitted", markup=False, soft_wrap=True)
        return ExitCode.OK
    os.makedirs(paths.log_dir, exist_ok=True)
    durable.replace_lines(job.script, [text])
    job_id = cluster.sbatch(job.script)
    durable.write_json(record, {"job_id": job_id, "partition": part.name if part else "", "script": job.script,
                                "log": job.log, "submitted": time.time(), "preset": preset})
    console.print(f"submitted Slurm job {job_id} ({job.name}) to partition {part.name if part else '?'}; "
                  f"log: {job.log}", markup=False, soft_wrap=True)
    console.print(f"  grep Epoch {job.log}   # areal-kit logs {paths.log_dir}   # scancel {job_id}",
                  markup=False, soft_wrap=True)
    return ExitCode.OK


def last_epoch(log: str) -> logs.Epoch | None:
    """The last Epoch line of a log (its last 256 KB are read)."""
    tail = tail_lines(log, 256 << 10) or []
    return next((e for ln in reversed(tail) if (e := logs.parse_epoch(ln)) is not None), None)


def job_lines(st: cluster.JobState, log_dir: str) -> list[str]:
    """A job's state, and where its run stands by its log: `status --slurm` and `logs` print them."""
    out = [st.line()]
    e = last_epoch(os.path.join(log_dir, LOG)) or last_epoch(os.path.join(log_dir, "train.log"))
    if e is not None:
        eta = f", about {e.eta / 60:.0f} min to go" if e.eta is not None else ""
        out.append(f"  global step {e.global_step} (epoch {e.epoch}/{e.n_epochs}){eta}; log {log_dir}/{LOG}")
    else:
        out.append(f"  no step yet; log {log_dir}/{LOG}")
    return out


def run_job_lines(log_dir: str) -> list[str]:
    """`areal-kit logs`'s lines for a run submitted to Slurm (its record in the log folder): none otherwise."""
    rec = durable.read_json(os.path.join(log_dir, RECORD))
    if not rec:
        return []
    try:
        return [cluster.job_state(str(rec["job_id"])).line()]
    except (UserError, RunFailed) as e:
        return [f"slurm job {rec['job_id']}: state unknown here ({e})"]


def status() -> int:
    """`areal-kit status --slurm`: this user's areal-kit jobs, each with its state and its run's last step."""
    console = make_console(highlight=False)
    jobs = cluster.jobs()
    for j in jobs:
        for line in job_lines(j, j.comment[len(cluster.COMMENT):]):
            console.out(line)
    if not jobs:
        console.out("no areal-kit job in Slurm's queue (squeue --me)")
    return ExitCode.OK


def doctor(partition: str | None, storage: str, python: str | None, preset: str | None, as_json: bool) -> int:
    """`areal-kit doctor --slurm`: the partition's nodes, GPUs against the preset, storage and Python on each."""
    fit = None
    if preset:
        cfg = load_config(preset, [])
        fit = (Path(preset).stem, cfg.n_nodes, cfg.n_gpus_per_node)
    rep = doc.check(partition, os.path.abspath(storage), python or sys.executable, fit)
    if as_json:
        print(rep.as_json())
    else:
        doc.print_report(rep, make_console(highlight=False))
    return ExitCode.OK if rep.ok else ExitCode.FAILED

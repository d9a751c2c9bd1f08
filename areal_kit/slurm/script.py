"""The sbatch script of a run: Ray's head and the driver on the job's first node, Ray workers on the
others through srun, the time limit's signal turned into a checkpoint and a requeue.

    from areal_kit.slurm.script import Job, sbatch_script
    print(sbatch_script(Job(...)))         # what `areal-kit train PRESET --slurm --dry-run` shows

Why it is written so:
- whole nodes (--exclusive, one task a node): Ray takes a node's CPUs and GPUs as it finds them
  (Slurm sets CUDA_VISIBLE_DEVICES), and Ray's ports and /tmp/ray are one cluster's per node;
- `srun --overlap`: the Ray steps run for the whole job beside the driver and the waiter, which
  would otherwise queue behind them for the same CPUs;
- the head's address is the NodeAddr Slurm itself reaches the node by; the other nodes find
  their own address by their route to it (Ray's own choice, given the head's address);
- `--signal=B:USR1@S` goes to this shell alone: it asks the driver (SIGTERM) to finish its step
  and write its recover checkpoint, then requeues the job, whose next start resumes there
  (the same command does). scancel and preemption send SIGTERM to every process of the job:
  the driver is then stopped at once (SIGINT, as Ctrl-C stops it), its last checkpoint kept;
- `--open-mode=append`: every start of a requeued job writes to the same log, where
  `grep Epoch` and `grep task_reward` read the whole run.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from areal_kit import logs
from areal_kit.errors import ExitCode
from areal_kit.slurm.options import SlurmOptions

RAY = "-m ray.scripts.scripts"  # Ray's CLI, through the Python that has it (no `ray` on PATH needed)
RAY_WAIT_S = 300  # how long the workers may take to join before the driver gives up


@dataclass
class Job:
    """What the script needs to know about the run."""

    preset: str  # a preset name, or an absolute path to a YAML file every node sees
    overrides: list[str]  # the user's key=value, then fileroot= (absolute): the driver adds ray_address
    name: str  # the job's name: areal-{experiment}-{trial}
    n_nodes: int
    gpus_per_node: int  # 0: no GPU request (a CPU partition, or one without GPU gres)
    log: str  # the job's output: the run's log folder/slurm.log
    log_dir: str  # the run's log folder (train.log, metrics.jsonl): squeue's comment points at it
    script: str  # where the script itself is written
    binds: list[str] = field(default_factory=list)  # storage paths a container must see
    fresh: bool = False  # --fresh on the first start only: a requeued start resumes
    discard: bool = False  # with fresh: --fresh --discard (deletes the checkpoints instead of setting them aside)


def _container(o: SlurmOptions, binds: list[str]) -> tuple[list[str], list[str]]:
    """(srun options, command prefix) that run a step in o.container."""
    if not o.container:
        return [], []
    if o.container_runtime == "pyxis":
        mounts = ",".join(f"{p}:{p}" for p in binds)
        return [f"--container-image={o.container}", *([f"--container-mounts={mounts}"] if binds else [])], []
    return [], ["apptainer", "exec", "--nv", *(["--bind", ",".join(binds)] if binds else []), o.container]


# The script after its #SBATCH lines; {step} runs a command on the head as a step of its own,
# {pre} puts it in the container, {workers} starts one task on each other node.
BODY = r"""# Written by `areal-kit train {preset} --slurm`; submit it again with: sbatch {script}
set -uo pipefail
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
driver=""; requeue=0; stopped=0
trap 'requeue=1; [ -n "$driver" ] && kill -TERM $driver' USR1  # the time limit is near: checkpoint, requeue
trap 'stopped=1; [ -n "$driver" ] && kill -INT $driver' TERM  # scancel, preemption: stop now, the last checkpoint kept
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${{nodes[0]}}
head_ip=$(getent ahostsv4 "$(scontrol show node "$head" | grep -oP 'NodeAddr=\K\S+')" | awk 'NR==1{{print $1}}')
port=$((20000 + SLURM_JOB_ID % 10000))
{fresh}
echo "areal-kit: job $SLURM_JOB_ID start $((${{SLURM_RESTART_COUNT:-0}} + 1)) on ${{nodes[*]}}, Ray head $head_ip:$port"
{step}{pre}{py} {ray} start --head --block --node-ip-address="$head_ip" --port=$port --include-dashboard=false &
{step}{pre}{py} -m areal_kit.slurm.node wait "$head_ip:$port" 1 {wait_s} || exit 1
{workers}
if [ $requeue = 0 ]; then  # (a USR1 while Ray started: requeue before the driver)
  # (trap - INT): a command a script puts in the background ignores SIGINT, which the TERM trap sends it
  (trap - INT; exec {driver_step}{train} ray_address="$head_ip:$port" "${{fresh[@]}}") &
  driver=$!; wait $driver; rc=$?
  while kill -0 $driver 2>/dev/null; do wait $driver; rc=$?; done  # a trap ran: the driver is ending
  # once more, now it has ended: a wait a trap cut short says 128+signal (143 for TERM), which is
  # not the driver's code; bash keeps an ended child's status for this.
  wait $driver; rc=$?
fi
kill $(jobs -p) 2>/dev/null; wait
# scancel signals Ray's processes too, and a driver whose Ray went first can end without a word:
# the stop is said here then ({terminated}: the driver said it).
if [ $stopped = 1 ] && [ "${{rc:-0}}" != {terminated} ]; then echo {stopped_line}; fi
if [ $requeue = 1 ] && [ "${{rc:-{terminated}}}" = {terminated} ]; then
  echo "areal-kit: requeued job $SLURM_JOB_ID"; scontrol requeue $SLURM_JOB_ID
fi
exit ${{rc:-0}}
"""


def sbatch_script(job: Job, o: SlurmOptions) -> str:
    py = "python3" if o.container else shlex.quote(o.python or sys.executable)
    srun_opts, prefix = _container(o, job.binds)
    pre = shlex.join(prefix) + " " if prefix else ""
    extra = shlex.join(srun_opts) + " " if srun_opts else ""
    step = f'srun --overlap --nodes=1 --ntasks=1 -w "$head" {extra}'
    sb = [f"--job-name={job.name}", f"--nodes={job.n_nodes}", "--ntasks-per-node=1", "--exclusive",
          *([f"--gres=gpu:{job.gpus_per_node}"] if job.gpus_per_node else []),
          *([f"--partition={o.partition}"] if o.partition else []), *([f"--account={o.account}"] if o.account else []),
          *([f"--time={o.time}"] if o.time else []), f"--output={job.log}", "--open-mode=append", "--requeue",
          f"--signal=B:USR1@{o.signal_grace}", f"--comment=areal-kit:{job.log_dir}", *o.sbatch_args]
    workers = ""
    if job.n_nodes > 1:
        # --ntasks as well: the job's own task count (SLURM_NTASKS) would otherwise be inherited.
        n = "$((${#nodes[@]} - 1))"
        workers = (f'srun --overlap --nodes={n} --ntasks={n} --ntasks-per-node=1 --exclude="$head" {extra}{pre}{py} '
                   f'-m areal_kit.slurm.node worker "$head_ip:$port" &\n'
                   f'{step}{pre}{py} -m areal_kit.slurm.node wait "$head_ip:$port" ${{#nodes[@]}} {RAY_WAIT_S} || exit 1')
    start_over = "--fresh --discard" if job.discard else "--fresh"
    fresh = (f'fresh=(); [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] && fresh=({start_over})  # a requeued start resumes'
             if job.fresh else "fresh=()")
    body = BODY.format(preset=shlex.quote(job.preset), script=job.script, fresh=fresh, step=step, pre=pre, py=py,
                       ray=RAY, wait_s=RAY_WAIT_S, workers=workers,
                       terminated=int(ExitCode.TERMINATED), stopped_line=shlex.quote(f"areal-kit: {logs.stopped_line('SIGTERM')}"),
                       # the driver: in this shell, or through srun where pyxis runs the container
                       driver_step=step if srun_opts else pre,
                       train=shlex.join([*shlex.split(f"{py} -m areal_kit.cli train"), job.preset, *job.overrides]))
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {a}" for a in sb), body])

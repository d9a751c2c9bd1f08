"""setup's `--train_param PRESET`: can it run on these nodes, its start on the head, and did it start.

    areal-kit setup --hostnames h1 h2 --train_param 1.5B_n4                      # waits up to 900 s
    areal-kit setup --hostnames h1 h2 --train_param 1.5B_n4 --train-wait 0       # starts, does not wait
    areal-kit train 1.5B_n4 --cluster areal         # later, again: the train and train_wait steps alone

Before connecting, `load_preset` loads the preset with the run's overrides (bad input: exit 2).
Right after preflight, the `preset` step (a gate: its failure stops every host before anything
is installed) checks that the nodes hold the GPUs the allocation needs, then runs
`areal-kit train PRESET --dry-run` here with AREAL_DEVICE set to the nodes' device, so the run's
own checks judge it (a subprocess: cluster/ does not import rl/). The `train` step starts the
run's driver on the head (in its container, or on the host with its pid recorded); then the
`train_wait` step reads its log on the head until the log shows the workers ready
or a step finished, or an error, or the driver is gone, or --train-wait seconds have passed.
`areal-kit train PRESET --cluster NAME` (cluster/cmd.py train_on) runs those two steps on a cluster
set up before, after `running` found no driver of the run on the head (exit 2 when one runs).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_kit import logs
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import SetupOptions, q
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.ray_cluster import container_name, host_env, in_head
from areal_kit.cluster.steps import must
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.errors import UserError

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig

POLL_S = 5.0  # seconds between two reads of the training log
DRY_RUN_TIMEOUT_S = 300


# -- before: the preset against the nodes ------------------------------------------------------
def load_preset(o: SetupOptions) -> TrainConfig:
    """The preset's config as the run will load it (SetupOptions o); UserError (exit 2) when the
    preset does not exist or an override does not parse."""
    try:
        return load_config(_preset(o), train_overrides(o))
    except UserError as e:
        given = " ".join(f"--train-arg {a}" for a in o.train_args)
        raise UserError(f"--train_param {o.train_param}{' ' + given if given else ''}: {e}") from None


def _preset(o: SetupOptions) -> str:
    """The preset setup starts: these steps run only when it was given one (--train_param)."""
    assert o.train_param, "a training step runs with --train_param"
    return o.train_param


def gpu_shortfall(allocation_mode: str, gpus: list[int]) -> str:
    """Why nodes with these GPU counts cannot hold the allocation ("" when they can). The run lays
    its workers out on whatever Ray cluster it joins, so a bigger cluster is fine: the dry run's
    n_nodes x n_gpus_per_node, which must equal the allocation, is not the test here."""
    a = parse_allocation(allocation_mode)
    have = sum(gpus)
    has = f"{len(gpus)}x{gpus[0]}={have}" if len(set(gpus)) == 1 else f"{'+'.join(map(str, gpus))}={have}"
    need = f"{a.gen_gpus}+{a.train_gpus}={a.total_gpus}" if a.kind == "decoupled" else str(a.total_gpus)
    if a.total_gpus > have:
        return f"{a.text} needs {need} GPUs, the nodes have {has}"
    if a.gen.tp > max(gpus):
        return f"{a.text} needs {a.gen.tp} GPUs on one node for each generation engine (m{a.gen.tp}), " \
               f"the nodes have {has}"
    return ""


def dry_run_args(o: SetupOptions) -> list[str]:
    return [sys.executable, "-m", "areal_kit.cli", "train", _preset(o), *train_overrides(o), "--dry-run"]


def preset(c: Cluster, h: HostState, cfg: TrainConfig) -> Outcome:
    """The head's step after preflight: can the preset (cfg, loaded by load_preset) run on these nodes?"""
    o = c.opts
    gpus = [int(x.facts.get("gpus") or 0) for x in c.hosts if not x.failed]
    device = "cuda" if h.facts.get("gpus") else "cpu"
    refuse = f"preset {o.train_param} cannot run on these {'GPU' if device == 'cuda' else 'CPU'} nodes"
    short = gpu_shortfall(cfg.allocation_mode, gpus) if device == "cuda" else ""
    if short:
        raise StepFailed(f"{refuse}: {short}; pick a preset for {sum(gpus)} GPUs, or --train-arg allocation_mode=...")
    args = dry_run_args(o)
    if o.dry_run:
        h.dry.commands.append(("local", f"AREAL_DEVICE={device} {shlex.join(args)}"))
        return Outcome("ok", "dry run")
    try:
        res = subprocess.run(args, env={**os.environ, "AREAL_DEVICE": device}, capture_output=True, text=True,
                             timeout=DRY_RUN_TIMEOUT_S, check=False)
        errors = [e for ln in res.stderr.splitlines() if (e := logs.parse_error(ln)) is not None]
        rc, tail = res.returncode, (res.stderr.strip().splitlines() or [""])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        errors, rc, tail = [], -1, str(e)
    if errors:
        raise StepFailed(f"{refuse}: {errors[-1]}")
    uses = f"cuda, {parse_allocation(cfg.allocation_mode).total_gpus} of {sum(gpus)} GPUs" if device == "cuda" \
        else "cpu"
    if rc:  # no one-line refusal: the dry run itself could not run here (a controller without torch)
        return Outcome("ok", f"{o.train_param} fits ({uses}); its dry run could not run here ({tail[:200]}): "
                             "the run checks the rest when it starts")
    return Outcome("ok", f"{o.train_param} can run here ({uses}; train --dry-run)")


# -- start: the driver on the head -------------------------------------------------------------
def train_log_path(c: Cluster) -> str:
    o = c.opts
    return f"{o.spec.fileroot.rstrip('/')}/logs/{o.spec.cluster_name}-{o.train_param}.log"


def placement(o: SetupOptions) -> list[str]:
    """Where setup's cluster (SetupOptions o) runs a driver: its Ray, its fileroot, its storage (where the
    data step put the preset's assets)."""
    return ["ray_address=auto", f"fileroot={o.spec.fileroot}", f"storage_root={o.storage}"]


def train_overrides(o: SetupOptions) -> list[str]:
    """What the run gets after its preset (SetupOptions o): placement, then --train-arg (later wins)."""
    return [*placement(o), *o.train_args]


def driver_pattern(o: SetupOptions) -> str:
    """`pgrep -f` pattern of the driver setup starts for o.train_param ("[.]": the shell running it
    does not match; the space after the preset: 1.5B_n1 does not match 1.5B_n16)."""
    return f"areal_kit[.]cli train {_preset(o).replace('.', '[.]')} "


def train(c: Cluster, h: HostState, fresh: bool = False, discard: bool = False) -> Outcome:
    """The head's step after ray_ready (and doctor's checks): start the preset's driver where Ray's
    head runs, its output appended to train_log_path, unless one runs already (fresh: with --fresh;
    discard: and --discard)."""
    o = c.opts
    if not o.train_param:
        return Outcome("skipped", "no --train_param")
    checked = [x.name for x in c.hosts if any(x.outcomes.get(s, Outcome("ok")).status == "failed"
                                              for s in ("host", "agree", "in-ray", "network"))]
    if checked:
        raise StepFailed(f"doctor's checks failed on {', '.join(checked)} (see FAIL lines): training not started; "
                         "fix them, or setup --skip-doctor")
    log = train_log_path(c)
    cmd = [o.python, "-m", "areal_kit.cli", "train", o.train_param, *train_overrides(o), *(["--fresh"] * fresh), *(["--discard"] * (fresh and discard))]
    logdir = log.rsplit("/", 1)[0]
    sudo = o.runtime == "docker"
    if h.remote.run(in_head(c, h, q("pgrep", "-f", driver_pattern(o))), sudo=sudo, check=True).ok:
        h.facts["train_log_from"] = 0  # the run going on is read from its log's start (its last launch)
        return Outcome("ok", f"training {o.train_param} already running; log {log}")
    # What the new run writes comes after the log's bytes of now.
    size = h.remote.run(in_head(c, h, f"if [ -f {q(log)} ]; then wc -c < {q(log)}; else echo 0; fi"), sudo=sudo,
                        check=True, timeout=60).stdout.strip()
    h.facts["train_log_from"] = int(size) if size.isdigit() else 0
    if o.runtime == "docker":
        inner = f"mkdir -p {shlex.quote(logdir)} && cd {shlex.quote(o.storage)} && exec {shlex.join(cmd)} " \
                f">> {shlex.quote(log)} 2>&1"
        must(c, h, q("docker", "exec", "-d", container_name(c, h), "sh", "-c", inner), "starting training", sudo=True)
    else:
        pidfile = f"{o.storage.rstrip('/')}/.areal-kit/train-{o.spec.cluster_name}.pid"
        must(c, h, f"mkdir -p {shlex.quote(logdir)} && cd {shlex.quote(o.storage)} && "
                   f"{{ {host_env(c, h, saved=True)} setsid {shlex.join(cmd)} >> {shlex.quote(log)} 2>&1 < /dev/null & "
                   f"echo $! > {shlex.quote(pidfile)}; }}", "starting training")
    wait = f"; waiting up to {o.train_wait:g}s for a sign of life (--train-wait)" if o.train_wait else ""
    return Outcome("changed", f"training {o.train_param} started; log {log}{wait}")


# -- again: `areal-kit train PRESET --cluster NAME` ------------------------------------------------
# Run on the head, in the runtime, with the run's fileroot, experiment and trial: "HELD [whose]" when a
# driver holds the run's lock (rl/driver/launch.py hold_run_lock: it outlives no driver, even after kill -9).
HELD_SNIPPET = """
import fcntl, json, os, sys
from areal_kit.runlog import run_paths
d = run_paths(*sys.argv[1:4]).log_dir
try:
    fcntl.flock(os.open(os.path.join(d, ".driver.lock"), os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    try:
        with open(os.path.join(d, "driver.json")) as f:
            info = json.load(f)
        print("HELD driver pid %s on %s" % (info["pid"], info["host"]))
    except (OSError, ValueError, KeyError):
        print("HELD")
except OSError:  # no lock file: no driver has run; a filesystem without locks: nothing to enforce with
    pass
"""


def running_cmd(c: Cluster, h: HostState, cfg: TrainConfig) -> str:
    """Prints "DRIVER PID" when setup's driver of this preset runs (its log is the one a new start
    would write to), else "HELD ..." when another driver holds the run's lock, else nothing."""
    o = c.opts
    return in_head(c, h, f"p=$(pgrep -o -f {q(driver_pattern(o))}) && {{ echo DRIVER $p; exit 0; }}; "
                         f"exec {q(o.python, '-c', HELD_SNIPPET, cfg.fileroot, cfg.experiment_name, cfg.trial_name)}")


def running(c: Cluster, h: HostState, cfg: TrainConfig) -> str:
    """Why a start of the run (cfg, as the driver will load it) is refused: its driver runs on the
    head; "" when none does. StepFailed when the head cannot be asked."""
    o = c.opts
    res = h.remote.run(running_cmd(c, h, cfg), sudo=o.runtime == "docker", check=True, timeout=60)
    if o.dry_run:
        return ""
    if not res.ok:
        if "No such container" in res.stderr or "is not running" in res.stderr:
            raise StepFailed(f"the head's container {container_name(c, h)} is not running: start the cluster with "
                             f"`areal-kit setup` (given --train_param {o.train_param}, it starts this training too)",
                             res)
        raise StepFailed(f"could not look for a running driver on {h.name} (exit {res.rc}: {res.tail(1)})", res)
    said = res.stdout.strip().splitlines()[-1:] or [""]
    then = (f"let it finish (`areal-kit status --name {o.spec.cluster_name}` shows where it stands) or stop it "
            f"first (`areal-kit down --name {o.spec.cluster_name}`)")
    if said[0].startswith("DRIVER "):
        return (f"training {o.train_param} is already running on {h.name} (driver pid {said[0].split()[1]}, log "
                f"{train_log_path(c)}); {then}")
    if said[0].startswith("HELD"):
        who = said[0][len("HELD"):].strip()
        return (f"run {cfg.experiment_name}/{cfg.trial_name} is already running on {h.name}"
                f"{f' ({who})' if who else ''}; {then}, or give this one another trial_name=")
    return ""


def not_running(c: Cluster, h: HostState, cfg: TrainConfig) -> Outcome:
    """`running` as a step (the dry run's listing)."""
    why = running(c, h, cfg)
    if why:
        raise StepFailed(why)
    return Outcome("ok", "no driver of this run on the head")


# -- after: the run's log ----------------------------------------------------------------------
# The lines the poll picks out on the head (grep -E) and classify reads: each launch's first line, its
# workers ready, a finished step, the end of training, and the failures: the CLI's error line, the run's
# own "Run failed" and "Run interrupted" (their messages start as the first line's does).
MARKERS = logs.grep_pattern(logs.RUN_HEAD, logs.READY_HEAD, logs.EPOCH_HEAD, logs.FINISHED_HEAD, logs.ERROR_HEAD)


@dataclass(frozen=True)
class Start:
    """Where a run stands in its log."""

    state: str  # starting | started | failed
    detail: str = ""  # started: how far ("engines generating", "at global step 3"); failed: the error


def classify(lines: list[str], driver_running: bool = True, last_line: str = "") -> Start:
    """The state the log's lines end in (each launch starts over); a driver gone without an error
    line or the end of training has failed, with its log's last line as the error."""
    now, done = Start("starting"), False
    for line in lines:
        if logs.parse_run(line):
            now, done = Start("starting"), False
        elif failure := _failure(line):
            now = Start("failed", failure)
        elif end := logs.parse_finished(line):
            now, done = Start("started", f"finished, {end.steps} steps"), True
        elif step := logs.parse_epoch(line):
            now = Start("started", f"at global step {step.global_step}")
        elif logs.parse_ready(line):
            now = Start("started", "workers ready, engines generating")
    if driver_running or now.state == "failed" or done:
        return now
    last = f"its log's last line: {last_line[:300]}" if last_line else "its log is empty"
    if now.state == "started":
        return Start("failed", f"the driver exited without finishing (its last sign: {now.detail}); {last}")
    return Start("failed", f"the driver exited before its workers were ready; {last}")


def _failure(line: str) -> str:
    """The error a failure line gives (the CLI's error, the run's own line as it reads), else ""."""
    if (error := logs.parse_error(line)) is not None:
        return error.strip()
    if (error := logs.parse_failed(line)) is not None:
        return logs.failed_line(error)
    stop = logs.parse_stopped(line)
    return logs.stopped_line(stop.signame, stop.global_step, stop.checkpoint) if stop else ""


def poll_cmd(c: Cluster, h: HostState, start: int) -> str:
    """Prints "DRIVER running|gone" (asked first, so a gone driver's log is whole), the marker lines
    written after byte `start`, and "LAST " with the last non-empty one."""
    log, new = q(train_log_path(c)), f"tail -c +{start + 1} {q(train_log_path(c))}"
    return in_head(c, h, f"if pgrep -f {q(driver_pattern(c.opts))} >/dev/null; then echo DRIVER running; "
                         f"else echo DRIVER gone; fi; [ -f {log} ] || exit 0; "
                         f"{new} | grep -aE {q(MARKERS)} | tail -n 50; "
                         f"printf 'LAST %s\\n' \"$({new} | grep -av '^[[:space:]]*$' | tail -n 1)\"")


def read_poll(stdout: str) -> tuple[bool | None, list[str], str]:
    """(driver running, or None when the poll said nothing; marker lines; the log's last line)."""
    lines = stdout.splitlines()
    if not lines or not lines[0].startswith("DRIVER "):
        return None, [], ""
    last = next((ln[len("LAST "):] for ln in reversed(lines) if ln.startswith("LAST ")), "")
    return lines[0] == "DRIVER running", [ln for ln in lines[1:] if not ln.startswith("LAST ")], last


def wait(c: Cluster, h: HostState) -> Outcome:
    """The head's step after train: the run's first sign of life or its error, within --train-wait."""
    o = c.opts
    if o.train_wait <= 0:
        return Outcome("skipped", "--train-wait 0")
    log, what = train_log_path(c), f"training {o.train_param}"
    cmd, sudo = poll_cmd(c, h, h.facts.get("train_log_from", 0)), o.runtime == "docker"
    if o.dry_run:
        h.dry.commands.append((f"every {POLL_S:g}s, up to {o.train_wait:g}s", h.dry.wrap(cmd, sudo)))
        return Outcome("ok", "dry run")
    end, polls, misses, last = time.monotonic() + o.train_wait, 0, 0, ""
    while True:
        # The host's log gets the first poll, not one every few seconds.
        res = h.remote.run(cmd, sudo=sudo, check=True, quiet=polls > 0, timeout=60)
        polls += 1
        running, lines, last = read_poll(res.stdout) if res.ok else (None, [], last)
        misses = misses + 1 if running is None else 0
        if misses >= 3:
            raise StepFailed(f"could not read {what}'s log {log} on {h.name}", res)
        if running is not None:
            now = classify(lines, running, last)
            if now.state == "started":
                return Outcome("ok", f"{what}: {now.detail}; log {log}")
            if now.state == "failed":
                raise StepFailed(f"{what} failed: {now.detail}; log {log}")
        if time.monotonic() >= end:
            raise StepFailed(f"{what}: no sign of life within {o.train_wait:g}s (--train-wait): waited for "
                             f"'Workers ready' or a finished step in {log}, and the run may still be starting: "
                             "follow it with `areal-kit status` or `areal-kit logs`"
                             + (f"; its log's last line: {last[:300]}" if last else ""))
        time.sleep(POLL_S)

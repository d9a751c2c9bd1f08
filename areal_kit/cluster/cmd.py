"""`areal-kit setup | status | down | doctor`: bare SSH hosts to a Ray cluster, report on it, check it, tear it down.

    areal-kit setup --hostnames h1 h2 h3 h4 --private_key_file ~/.ssh/id_ed25519 \\
        --username root --ssh_port 22 --train_param 1.5B_n4
    areal-kit setup --inventory cluster_specs/hosts_4node.yaml --dry-run   # print every command
    areal-kit status            # the cluster set up last from this machine (--name to choose)
    areal-kit doctor            # check it: limits, versions, storage, GPU stack, Ray, network (cluster/doctor.py)
    areal-kit down
    areal-kit train 1.5B_n4 --cluster areal   # training again, later: setup's train steps alone (train_on)

Steps (cluster/steps.py, cluster/ray_cluster.py, cluster/data.py, cluster/train_start.py) run on
all hosts in parallel via cluster/parallel.py; the exit code is an ExitCode (areal_kit/errors.py):
OK when every host succeeded, FAILED when any failed, BAD_INPUT for bad input. Per-host logs go
to --log-dir.
Each option is declared once, on the field of the dataclass it fills (cluster/options.py, areal_kit/options.py,
cluster/target.py), and the signatures below are made of those fields (areal_kit/flags.py); status,
down and doctor find their cluster through one Target, filled from what setup saved.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import secrets as secrets_mod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from areal_kit.cluster.options import STOP_GRACE, TRAIN_WAIT, ConnectOptions, Limits, SetupOptions, save_state
from areal_kit.cluster.target import Hosts, Route, Target
from areal_kit.errors import ExitCode, RunFailed, UserError
from areal_kit.flags import build, command, flag, params
from areal_kit.home import state_dir
from areal_kit.options import Mirror, Output, Python, Storage

if TYPE_CHECKING:  # the run's context brings the SSH connections (fabric), which --help does not need
    from rich.console import Console
    from rich.table import Table

    from areal_kit.cluster.context import Cluster
    from areal_kit.cluster.parallel import Step
    from areal_kit.config.schema import TrainConfig
    from areal_kit.data.assets import Asset

# status, down and doctor: which cluster, and how this machine reaches it.
_TARGET = (params(Hosts, "name hosts hostnames inventory username ssh_port private_key_file"), params(Route, "runtime"),
           params(Python), params(Route, "ssh_wait ssh_config gateway"),
           params(ConnectOptions, "known_hosts host_key_policy"))


def _ray_token(cluster_name: str) -> str:
    """One Ray auth token per cluster, kept (0600) next to the saved state so re-runs and
    `down` reuse it; it reaches the hosts only through the secrets file."""
    p = state_dir() / "clusters" / f"{cluster_name}.ray_token"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secrets_mod.token_hex(32).encode())
        os.close(fd)
    return p.read_text().strip()


def _build(opts: SetupOptions, copts: ConnectOptions, secrets: dict[str, str]) -> Cluster:
    from areal_kit.cluster.context import Cluster, HostState
    from areal_kit.cluster.remote import DryRemote, HostLog, Remote, check_key_file

    for k in {h.key_file for h in opts.spec.hosts}:
        check_key_file(k)
    hosts = []
    for i, spec in enumerate(opts.spec.hosts):
        h = HostState(spec=spec, index=i)
        if opts.dry_run:
            h.remote = DryRemote(spec, copts.gateway)
        else:
            assert opts.log_dir, "SetupOptions names a log folder when not told one"
            h.log_path = Path(opts.log_dir) / (re.sub(r"[^A-Za-z0-9_.-]", "_", spec.label) + ".log")
            h.remote = Remote(spec, copts, HostLog(h.log_path, list(secrets.values())))
        hosts.append(h)
    return Cluster(opts=opts, hosts=hosts, secrets=secrets)


def _reach(target: Target, given: dict[str, Any], dry_run: bool = False) -> Cluster:
    """The cluster status, down and doctor act on, its hosts ready to connect to."""
    opts = target.options(dry_run)
    copts = build(ConnectOptions, given, ssh_wait=target.ssh_wait, ssh_config=opts.ssh_config, gateway=opts.gateway)
    secrets = {"RAY_AUTH_TOKEN": _ray_token(opts.spec.cluster_name)} if opts.ray_auth_mode == "token" else {}
    return _build(opts, copts, secrets)


def _close(cluster: Cluster) -> None:
    for h in cluster.hosts:
        h.remote.close()


@dataclass
class OnCluster:
    """`areal-kit train`'s options for a run on a cluster's head (cli.py adds them to rl/cmd.py's); setup
    takes its --train-wait too, `areal-kit view` its --cluster."""

    cluster: str | None = flag(None, "--cluster", help="On the head of the cluster setup saved under this --name "
                               "(setup's default: areal), in its runtime, with its fileroot and storage. train: runs "
                               "it there as setup's own start does: resumes a matching recover checkpoint; refused "
                               "while the run's driver runs there. Give the overrides again: setup's --train-arg are "
                               "not kept. With --dry-run: the commands it would run there. view: serves the run's "
                               "page there (RUN as the head sees it), reached here through a local port forwarded "
                               "over setup's SSH route (jump host, users, keys).")
    # None: not given (train refuses it without --cluster); SetupOptions.train_wait is setup's default.
    train_wait: float | None = flag(None, "--train-wait", min=0, help=f"Seconds to wait, once training is started "
                                    f"(setup --train_param; train: with --cluster), for a sign of life in its log "
                                    f"(workers ready, a step finished); its error or no sign in time fails the "
                                    f"command. Default {TRAIN_WAIT:g}; 0: start it and do not wait.")


# setup's options: its own (SetupOptions) among those it shares with status, down, doctor and train,
# in the order --help lists them.
_SETUP = (params(Hosts), params(Storage), params(Route, "ssh_config gateway"), params(SetupOptions, "nas_url"),
          params(Route, "runtime"), params(SetupOptions, "image image_tar build_args"), params(Python),
          params(SetupOptions, "mounts env ray_port dashboard num_cpus object_store_memory shm_size ray_auth_mode "
                               "data train_param train_args"),
          params(OnCluster, "train_wait"), params(SetupOptions, "ray_wait min_disk_gb log_dir"),
          params(Output, "dry_run"), params(SetupOptions, "fetch_only"), params(Mirror),
          params(ConnectOptions, "known_hosts host_key_policy connect_timeout"), params(Route, "ssh_wait"),
          params(Limits, "min_shm_gb min_nofile"))


@command(*_SETUP)
def setup(
    hf_token: str = typer.Option(None, "--hf-token", envvar="HF_TOKEN", show_default=False, show_envvar=True,
                                 help="Hugging Face token for hf:// data and training; never printed or logged."),
    wandb_key: str = typer.Option(None, "--wandb-key", envvar="WANDB_API_KEY", show_default=False, show_envvar=True,
                                  help="Weights & Biases API key for training; never printed or logged."),
    skip_doctor: bool = typer.Option(False, "--skip-doctor", help="Skip doctor's fast checks at the end (host "
                                     "limits, shared storage, the GPU stack, versions, Ray, the weight sync's "
                                     "all-reduce across nodes), which otherwise keep a failed cluster from training."),
    **given: Any,
) -> int:
    """Provision bare hosts over SSH into a Ray cluster (containers or host), optionally start training."""
    from areal_kit.cluster import data as data_step
    from areal_kit.cluster import train_start
    from areal_kit.cluster.parallel import dry_run, run_steps
    from areal_kit.console import make_console

    opts = build(SetupOptions, given, spec=build(Hosts, given).spec())
    copts = build(ConnectOptions, given)
    mirror = build(Mirror, given).mirror
    train_cfg = train_start.load_preset(opts) if opts.train_param else None  # bad input before any host is contacted
    assets = data_step.plan(opts, mirror or "", train_cfg)
    secrets = {k: v for k, v in (("HF_TOKEN", hf_token), ("WANDB_API_KEY", wandb_key)) if v}
    if opts.ray_auth_mode == "token":
        secrets["RAY_AUTH_TOKEN"] = _ray_token(opts.spec.cluster_name)
    cluster = _build(opts, copts, secrets)
    checks = None if skip_doctor or opts.dry_run else build(Limits, given)
    plan = _setup_plan(opts, assets, mirror or "", train_cfg, checks)
    console = make_console(highlight=False)
    try:
        if opts.dry_run:
            return dry_run(cluster, plan, console)
        console.print(f"setup {opts.spec.cluster_name}: {len(opts.spec.hosts)} hosts, runtime {opts.runtime}, "
                      f"logs in {opts.log_dir}")
        ok = run_steps(cluster, plan, console)
        _print_findings(cluster, console)
        if not opts.fetch_only:  # the hosts' cluster is the one a full setup saved
            save_state(opts)
    finally:
        _close(cluster)
    if not ok:
        return ExitCode.FAILED
    if opts.fetch_only:
        console.print(f"fetched onto {opts.storage}; Ray and training not started (--fetch-only)")
        return ExitCode.OK
    head = cluster.head
    console.print(f"cluster {opts.spec.cluster_name} is up: Ray at {head.ip}:{opts.ray_port}"
                  + (f", dashboard http://{head.ip}:8265" if opts.dashboard else ""))
    started = head.outcomes.get("train_wait")
    if started and started.status == "ok":
        console.print(started.message, markup=False, soft_wrap=True)
    return ExitCode.OK


def _setup_plan(opts: SetupOptions, assets: list[Asset], mirror: str, train_cfg: TrainConfig | None,
                checks: Limits | None) -> list[Step]:
    """setup's steps in order; with checks, doctor's fast ones before training starts."""
    from areal_kit.cluster import data as data_step
    from areal_kit.cluster import ray_cluster, steps, train_start
    from areal_kit.cluster.parallel import Step

    plan = [Step("connect", steps.connect), Step("preflight", steps.preflight),
            Step("storage", steps.storage, head_first=True), Step("install", steps.install),
            Step("image", steps.image, head_first=opts.image is None),  # the head builds areal-kit's own
            Step("data", functools.partial(data_step.data, assets=assets, mirror=mirror), head_only=True),
            Step("ray", ray_cluster.ray, head_first=True), Step("ray_ready", ray_cluster.ray_ready, head_only=True)]
    if checks is not None:  # the fast ones: the network step's all-reduce over the weight sync's group only
        plan += doctor_steps(dataclasses.replace(checks, quick_network=True), network=True)
    plan.append(Step("train", train_start.train, head_only=True))
    if opts.train_param:  # the preset against the nodes as soon as preflight knows them; its start, watched
        assert train_cfg is not None, "setup loads the preset it starts"
        plan.insert(2, Step("preset", functools.partial(train_start.preset, cfg=train_cfg), head_only=True, gate=True))
        plan.append(Step("train_wait", train_start.wait, head_only=True))
    if opts.fetch_only:  # what the data step needs (hosts, storage, the image it fetches in), then it
        return plan[:[s.name for s in plan].index("data") + 1]
    return plan


# train's options beyond rl/cmd.py's: the cluster, and how this machine reaches it.
TRAIN_ON = (params(OnCluster), params(ConnectOptions, "known_hosts host_key_policy"))


def train_on(preset: str, overrides: list[str], *, fresh: bool, dry_run: bool, given: dict[str, Any],
             discard: bool = False) -> int:
    """`areal-kit train PRESET --cluster NAME`: setup's train and train_wait steps alone, on the cluster
    saved under NAME, for this preset and these overrides (setup's --train-arg are not carried over):
    the driver starts on the head, in the runtime, with the fileroot and storage setup used, and
    resumes from a matching recover checkpoint. Refused (exit 2) while the run's driver runs there."""
    from areal_kit.cluster import steps, train_start
    from areal_kit.cluster.options import saved_cluster
    from areal_kit.cluster.parallel import Step, StepFailed, run_steps
    from areal_kit.cluster.parallel import dry_run as print_plan
    from areal_kit.config.loader import load_config
    from areal_kit.console import make_console

    where = build(OnCluster, given)
    name, wait = where.cluster, where.train_wait
    assert name is not None, "train_on runs a train given --cluster"
    opts = saved_cluster(name)
    cfg = load_config(preset, [*train_start.placement(opts), *overrides])  # bad input before any host
    if Path(preset).suffix in (".yaml", ".yml"):
        raise UserError(f"--cluster: the head reads presets by name from its own package, not {preset} of this "
                        "machine; expected a preset name like 1.5B_n4")
    opts = dataclasses.replace(opts, train_param=preset, train_args=list(overrides), dry_run=dry_run, log_dir=None,
                               train_wait=TRAIN_WAIT if wait is None else wait)
    copts = build(ConnectOptions, given, ssh_config=opts.ssh_config, gateway=opts.gateway)
    # No secrets of its own: the runtime has setup's (the containers' env, the host runtime's file).
    cluster = _build(opts, copts, {})
    check = Step("running", functools.partial(train_start.not_running, cfg=cfg), head_only=True)
    start = [Step("train", functools.partial(train_start.train, fresh=fresh, discard=discard), head_only=True),
             Step("train_wait", train_start.wait, head_only=True)]
    console = make_console(highlight=False)
    try:
        if dry_run:
            return print_plan(cluster, [Step("connect", steps.connect, head_only=True), check, *start], console)
        head = cluster.head
        try:
            steps.connect(cluster, head)
            why = train_start.running(cluster, head, cfg)
        except StepFailed as e:
            raise RunFailed(f"cluster {name}, head {head.name}: {e}") from None
        if why:
            raise UserError(why)
        console.print(f"train {preset} on cluster {name} ({opts.runtime}), head {head.name}; logs in {opts.log_dir}",
                      markup=False, soft_wrap=True)
        ok = run_steps(cluster, start, console)
    finally:
        _close(cluster)
    said = [o.message for o in (head.outcomes.get("train_wait"), head.outcomes.get("train")) if o and o.status != "skipped"]
    if ok and said:  # where the run stands (train_wait's), else where its log is (train's, not waited for)
        console.print(said[0], markup=False, soft_wrap=True)
    return ExitCode.OK if ok else ExitCode.FAILED


@command(*_TARGET)
def status(**given: Any) -> int:
    """Report, per host, the Ray process and whether Ray counts it as a live node."""
    from areal_kit.cluster import ray_cluster, steps
    from areal_kit.cluster.parallel import Step, run_steps
    from areal_kit.console import make_console

    cluster = _reach(build(Target, given), given)
    console = make_console(highlight=False)
    try:
        ok = run_steps(cluster, [Step("connect", steps.connect), Step("ray", ray_cluster.probe)], console)
        head = cluster.head
        alive = None
        if not head.failed:
            res = head.remote.run(ray_cluster.nodes_cmd(cluster, [], 0, 0), sudo=cluster.opts.runtime == "docker",
                                  timeout=60)
            alive = ray_cluster.parse_nodes(res)
        console.print(_status_table(cluster, alive))
        console.print(f"Ray reports {len(alive)} alive node(s)" if alive is not None else "Ray head not answering")
        if not head.failed:
            console.print(f"training: {ray_cluster.training_state(cluster, head)}", markup=False, soft_wrap=True)
    finally:
        _close(cluster)
    ok = ok and alive is not None and all(h.ip in alive for h in cluster.hosts)
    return ExitCode.OK if ok else ExitCode.FAILED


def _status_table(cluster: Cluster, alive: dict[str, float] | None) -> Table:
    from rich.table import Table

    t = Table(title=f"cluster {cluster.opts.spec.cluster_name} ({cluster.opts.runtime})")
    for col in ("host", "address", "ray process", "in Ray cluster", "GPUs"):
        t.add_column(col)
    for h in cluster.hosts:
        member = "?" if alive is None or not h.ip else ("yes" if h.ip in alive else "NO")
        gpus = f"{alive[h.ip]:g}" if alive and h.ip in alive else "-"
        t.add_row(h.name, h.ip or "-", h.facts.get("ray_state", "unreachable"), member, gpus)
    return t


@command(*_TARGET, params(Output, "dry_run"))
def down(
    grace: float = typer.Option(STOP_GRACE, "--grace", min=0, help="Seconds training may take, after SIGTERM, to "
                                "finish its step and write that step's recover checkpoint; 0: stop it with Ray at "
                                "once."),
    **given: Any,
) -> int:
    """Stop training, then Ray and its containers on every host (workers first).

    Training gets SIGTERM first, so it checkpoints the step under way; secrets files are removed.
    """
    from areal_kit.cluster import ray_cluster, steps
    from areal_kit.cluster.parallel import Step, dry_run, run_steps
    from areal_kit.console import make_console

    cluster = _reach(build(Target, given), given, dry_run=given["dry_run"])
    # Training first, while its workers still run: it checkpoints the step under way.
    plan = [Step("connect", steps.connect),
            Step("stop training", functools.partial(ray_cluster.stop_training, grace=grace), head_only=True),
            Step("down", ray_cluster.down, head_last=True)]
    console = make_console(highlight=False)
    try:
        if cluster.opts.dry_run:
            return dry_run(cluster, plan, console)
        return ExitCode.OK if run_steps(cluster, plan, console) else ExitCode.FAILED
    finally:
        _close(cluster)


@command(*_TARGET, params(Limits, "preset min_shm_gb min_nofile"), params(SetupOptions, "min_disk_gb"),
         params(Limits, "net_mb rl_step"), params(Output, "as_json"))
def doctor(**given: Any) -> int:
    """Check the running cluster: every host's limits and versions, shared storage, Ray, the network.

    Every failed check is one line: host, check, what was measured, what it should be, the fix.
    Exit 0 only when all pass. The figures are saved for `areal-kit train PRESET --dry-run`.
    """
    import json
    import sys

    from areal_kit import netfigures
    from areal_kit.cluster import doctor as doc
    from areal_kit.cluster import steps
    from areal_kit.cluster.parallel import Step, run_steps
    from areal_kit.console import make_console

    as_json = given["as_json"]
    limits = build(Limits, given)
    if limits.preset:
        from areal_kit.config.loader import load_config

        limits.gpus_per_node = load_config(limits.preset, []).n_gpus_per_node
    target = build(Target, given)
    cluster = _reach(target, given)
    console = make_console(highlight=False, file=sys.stderr if as_json else None)
    try:
        ok = run_steps(cluster, [Step("connect", steps.connect), *doctor_steps(limits, network=True)], console)
    finally:
        _close(cluster)
    fault = doc.run_fault(cluster)
    if fault and target.runtime_assumed():
        doc.blame_the_run(cluster)
    rep = doc.report(cluster, ok)
    if not fault:  # a run that saw no host keeps the figures of the last one that did
        netfigures.save(cluster.opts.spec.cluster_name, rep)
    if as_json:
        print(json.dumps(rep, indent=1))
    else:
        _print_doctor(cluster, rep, console)
    return ExitCode.OK if ok else ExitCode.FAILED


def _print_doctor(cluster: Cluster, rep: dict, console: Console) -> None:
    """The link matrix, a FAIL line per finding, and where the figures are."""
    from rich.table import Table

    from areal_kit import netfigures
    from areal_kit.cluster import doctor as doc

    links = (rep.get("network") or {}).get("links_gbps")
    if links:
        head, *rows = doc.link_rows(links)
        t = Table(title=f"point-to-point bandwidth, GB/s ({rep['network']['backend']})")
        for col in head:
            t.add_column(col)
        for row in rows:
            t.add_row(*row)
        console.print(t)
    _print_findings(cluster, console)
    name = cluster.opts.spec.cluster_name
    path = netfigures.result_path(name)
    if rep["fault"]:
        said = (f"{rep['fault']}, so nothing was measured (the recap above says why); the figures in {path} "
                "are kept")
    else:
        said = ("every check passed" if rep["ok"] else "checks failed (the FAIL lines and the recap above)") + \
            f"; figures in {path}"
    console.print(f"doctor {name}: {said}", markup=False, soft_wrap=True)


def _print_findings(cluster: Cluster, console: Console) -> None:
    for f in cluster.doctor.findings:
        console.print(f"FAIL {f.line()}", markup=False, soft_wrap=True)


def doctor_steps(limits: Limits, network: bool) -> list[Step]:
    """doctor's checks as steps; setup runs the fast ones (limits.quick_network: no link matrix)."""
    from areal_kit.cluster import doctor as doc
    from areal_kit.cluster.parallel import Step

    bound = lambda fn: functools.partial(fn, limits=limits)
    plan = [Step("host", bound(doc.host_step), head_first=True), Step("agree", bound(doc.agree_step)),
            Step("in-ray", bound(doc.ray_step), head_first=True)]
    if network:
        plan.append(Step("network", bound(doc.network_step), head_first=True))
    if network and limits.rl_step:
        plan.append(Step("rl-step", bound(doc.rl_step_step), head_only=True))
    return plan

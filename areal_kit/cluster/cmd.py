"""`areal-kit setup | status | down`: bare SSH hosts to a Ray cluster, report on it, tear it down.

    areal-kit setup --hostnames h1 h2 h3 h4 --private_key_file ~/.ssh/id_ed25519 \\
        --username root --ssh_port 22 --train_param 1.5B_n4
    areal-kit setup --inventory cluster_specs/hosts_4node.yaml --dry-run   # print every command
    areal-kit status            # the cluster set up last from this machine (--name to choose)
    areal-kit down

Steps (cluster/steps.py, cluster/ray_cluster.py, cluster/data.py) run on all hosts in parallel
via cluster/parallel.py; exit code 0 when every host succeeded, 1 when any failed, 2 for bad
input. Per-host logs go to --log-dir.
"""

from __future__ import annotations

import functools
import os
import re
import secrets as secrets_mod
from pathlib import Path

import typer
from typer import Option as _O  # every flag below is one

from areal_kit.cluster.options import STOP_GRACE, Cluster, SetupOptions, load_state, save_state, state_dir
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec, load_cluster_spec
from areal_kit.errors import UserError


def _spec(hosts, hostnames, inventory, username, ssh_port, key, storage, name, n_gpus) -> ClusterSpec:
    """Hosts from --inventory, or from --hostnames plus positional HOSTS; flags override."""
    names = [h for arg in (hostnames or []) + (hosts or []) for h in arg.split(",") if h]
    if inventory and names:
        raise UserError("give hosts either with --hostnames or with --inventory, not both")
    if inventory:
        spec = load_cluster_spec(inventory)
        for h in spec.hosts:
            h.user = username or h.user
            h.port = ssh_port if ssh_port is not None else h.port
            h.__post_init__()
            h.key_file = os.path.expanduser(key) if key else h.key_file
        if storage:
            spec.storage = storage
        if name:
            spec.cluster_name = name
        if n_gpus is not None:
            spec.n_gpus_per_node = n_gpus
        return ClusterSpec(**{**spec.__dict__, "fileroot": spec.fileroot, "hosts": spec.hosts})
    hs = [HostSpec(hostname=n, user=username, port=ssh_port, key_file=key) for n in names]
    return ClusterSpec(cluster_name=name or "areal", storage=storage or "/storage",
                       n_gpus_per_node=n_gpus or 0, hosts=hs)


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


def _build(opts, copts, secrets: dict[str, str]):
    from areal_kit.cluster.parallel import HostState
    from areal_kit.cluster.remote import DryRemote, HostLog, Remote, check_key_file

    for k in {h.key_file for h in opts.spec.hosts}:
        check_key_file(k)
    hosts = []
    for i, spec in enumerate(opts.spec.hosts):
        h = HostState(spec=spec, index=i)
        if opts.dry_run:
            h.remote = DryRemote(spec, copts.gateway)
        else:
            h.log_path = Path(opts.log_dir) / (re.sub(r"[^A-Za-z0-9_.-]", "_", spec.label) + ".log")
            h.remote = Remote(spec, copts, HostLog(h.log_path, list(secrets.values())))
        hosts.append(h)
    return Cluster(opts=opts, hosts=hosts, secrets=secrets)


def _close(cluster) -> None:
    for h in cluster.hosts:
        h.remote.close()


# doctor's thresholds: the same flags on setup (its fast checks) and on doctor.
_MIN_SHM = _O(1.0, "--min-shm-gb", min=0, help="/dev/shm each host (container) must have, in GB (doctor's check).")
_MIN_NOFILE = _O(65536, "--min-nofile", min=0, help="Open-file hard limit each host (container) must allow "
                 "(doctor's check).")


def setup(
    hosts: list[str] = typer.Argument(None, help="More hostnames, so the guide's `--hostnames h1 h2 h3` works.",
                                      show_default=False),
    hostnames: list[str] = _O(None, "--hostnames", help="Hosts to provision (repeat, or comma-separate); "
                              "the first is the Ray head."),
    inventory: str = _O(None, "--inventory", "--cluster-spec", help="YAML inventory or JSON cluster spec "
                        "(cluster_specs/) instead of --hostnames."),
    private_key_file: str = _O(None, "--private_key_file", "--private-key-file",
                               help="SSH private key (must be chmod 600)."),
    username: str = _O(None, "--username", help="SSH user (default: the ssh config's User, else root); "
                       "others need passwordless sudo."),
    ssh_port: int = _O(None, "--ssh_port", "--ssh-port", help="SSH port (default: the ssh config's Port, else 22)."),
    ssh_config: str = _O(None, "--ssh-config", help="OpenSSH client config for host aliases, User, Port, "
                         "IdentityFile, ProxyJump (default ~/.ssh/config)."),
    gateway: str = _O(None, "--gateway", help="Jump host [user@]host[:port] through which every host is "
                      "reached (default: the ssh config's ProxyJump, if any)."),
    storage: str = _O(None, "--storage", help="Shared storage path, the same on every host (default /storage)."),
    nas_url: str = _O(None, "--nas_url", "--nas-url", help="NFS export (server:/path) to mount at --storage "
                      "where it is not mounted yet."),
    name: str = _O(None, "--name", help="Cluster name: names containers, logs, saved state (default areal)."),
    runtime: str = _O("docker", "--runtime", help="docker: Ray in containers; host: Ray directly on the "
                      "hosts (no Docker)."),
    image: str = _O("areal-kit:latest", "--image", help="Runtime image (docker/Dockerfile)."),
    image_tar: str = _O(None, "--image-tar", help="`docker load` this tarball (on shared storage) instead "
                        "of pulling: for air-gapped clusters."),
    python: str = _O("python3", "--python", help="Python with ray and areal_kit: inside the image "
                     "(docker) or on the hosts (host)."),
    mount: list[str] = _O(None, "--mount", help="Extra bind mount SRC[:DST[:ro]] for the containers (repeat)."),
    env: list[str] = _O(None, "--env", help="Extra KEY=VALUE for Ray processes (repeat)."),
    n_gpus_per_node: int = _O(None, "--n-gpus-per-node", help="Fail unless every host has this many GPUs."),
    ray_port: int = _O(6379, "--ray-port", help="Ray GCS port on the head."),
    dashboard: bool = _O(True, "--dashboard/--no-dashboard", help="Ray dashboard on the head, bound to "
                         "its cluster address."),
    num_cpus: int = _O(None, "--num-cpus", help="CPUs each Ray node offers (default: all)."),
    object_store_memory: str = _O(None, "--object-store-memory", help="Object store per node, e.g. 2g."),
    shm_size: str = _O("16g", "--shm-size", help="Container /dev/shm size (holds the object store)."),
    ray_auth_mode: str = _O("disabled", "--ray-auth-mode", help="RAY_AUTH_MODE on every node: disabled | token."),
    data: list[str] = _O(None, "--data", help="Model/dataset URI to fetch once onto storage: hf://org/name, "
                         "hf://datasets/org/name, https://..., file://...; add #sha256=HEX to verify (repeat)."),
    train_param: str = _O(None, "--train_param", "--train-param", help="Preset to start training in the "
                          "head container after setup (log on shared storage)."),
    train_arg: list[str] = _O(None, "--train-arg", help="Extra key=value override for that training (repeat)."),
    hf_token: str = _O(None, "--hf-token", envvar="HF_TOKEN", show_default=False, show_envvar=True,
                       help="Hugging Face token for hf:// data and training; never printed or logged."),
    wandb_key: str = _O(None, "--wandb-key", envvar="WANDB_API_KEY", show_default=False, show_envvar=True,
                        help="Weights & Biases API key for training; never printed or logged."),
    known_hosts: str = _O("~/.ssh/known_hosts", "--known-hosts", help="known_hosts file to check host keys against."),
    host_key_policy: str = _O("accept-new", "--host-key-policy", help="accept-new (record unknown, refuse "
                              "changed) | strict | off."),
    connect_timeout: float = _O(10.0, "--connect-timeout", help="Seconds for one SSH connection attempt."),
    ssh_wait: float = _O(30.0, "--ssh-wait", help="Keep retrying unreachable hosts this many seconds."),
    ray_wait: float = _O(180.0, "--ray-wait", help="Seconds to wait for every node to join Ray."),
    min_disk_gb: float = _O(20.0, "--min-disk-gb", help="Free space required on --storage, in GB."),
    log_dir: str = _O(None, "--log-dir", help="Per-host log files (default ~/.areal-kit/logs/NAME/TIME)."),
    dry_run: bool = _O(False, "--dry-run", help="Print every command per host; run nothing."),
    skip_doctor: bool = _O(False, "--skip-doctor", help="Skip doctor's fast checks at the end (host limits, "
                           "shared storage, versions, Ray), which otherwise keep a failed cluster from training."),
    min_shm_gb: float = _MIN_SHM,
    min_nofile: int = _MIN_NOFILE,
) -> int:
    """Provision bare hosts over SSH into a Ray cluster (containers or host), optionally start training."""
    from areal_kit.cluster import data as data_step
    from areal_kit.cluster import ray_cluster, steps
    from areal_kit.cluster.parallel import Step, make_console, print_dry_run, run_steps
    from areal_kit.cluster.remote import ConnectOptions

    spec = _spec(hosts, hostnames, inventory, username, ssh_port, private_key_file, storage, name, n_gpus_per_node)
    opts = SetupOptions(spec=spec, runtime=runtime, image=image, image_tar=image_tar, python=python,
                        mounts=mount or [], env=env or [], ray_port=ray_port, dashboard=dashboard,
                        num_cpus=num_cpus, object_store_memory=object_store_memory, shm_size=shm_size,
                        ray_auth_mode=ray_auth_mode, data=data or [], train_param=train_param,
                        train_args=train_arg or [], min_disk_gb=min_disk_gb, ray_wait=ray_wait,
                        log_dir=log_dir or "", dry_run=dry_run, nas_url=nas_url, ssh_config=ssh_config,
                        gateway=gateway)
    copts = ConnectOptions(known_hosts=known_hosts, host_key_policy=host_key_policy,
                           connect_timeout=connect_timeout, wait=ssh_wait, ssh_config=ssh_config, gateway=gateway)
    data_step.validate(opts.data)
    secrets = {k: v for k, v in (("HF_TOKEN", hf_token), ("WANDB_API_KEY", wandb_key)) if v}
    if ray_auth_mode == "token":
        secrets["RAY_AUTH_TOKEN"] = _ray_token(spec.cluster_name)
    cluster = _build(opts, copts, secrets)
    plan = [Step("connect", steps.connect), Step("preflight", steps.preflight),
            Step("storage", steps.storage, head_first=True), Step("install", steps.install),
            Step("image", steps.image), Step("data", data_step.data, head_only=True),
            Step("ray", ray_cluster.ray, head_first=True), Step("ray_ready", ray_cluster.ray_ready, head_only=True)]
    if not skip_doctor and not dry_run:
        from areal_kit.cluster.doctor import Limits

        plan += doctor_steps(Limits(min_shm_gb=min_shm_gb, min_nofile=min_nofile, min_disk_gb=min_disk_gb),
                             network=False)
    plan.append(Step("train", ray_cluster.train, head_only=True))
    console = make_console()
    try:
        if dry_run:
            for s in plan:
                for h in cluster.hosts:
                    if (s.head_only and not h.is_head):
                        continue
                    s.fn(cluster, h)
            print_dry_run(cluster, console)
            return 0
        console.print(f"setup {spec.cluster_name}: {len(spec.hosts)} hosts, runtime {runtime}, "
                      f"logs in {opts.log_dir}")
        ok = run_steps(cluster, plan, console)
        _print_findings(cluster, console)
        save_state(opts)
    finally:
        _close(cluster)
    head = cluster.head
    if ok:
        console.print(f"cluster {spec.cluster_name} is up: Ray at {head.ip}:{ray_port}"
                      + (f", dashboard http://{head.ip}:8265" if dashboard else ""))
    return 0 if ok else 1


def _saved_or_given(name, hosts, hostnames, inventory, username, ssh_port, key, runtime, python):
    if hosts or hostnames or inventory:
        spec = _spec(hosts, hostnames, inventory, username, ssh_port, key, None, name, None)
        return SetupOptions(spec=spec, runtime=runtime or "docker", python=python or "python3")
    opts = load_state(name or "areal")
    if runtime:
        opts.runtime = runtime
    return opts


def _reach(name, hosts, hostnames, inventory, username, ssh_port, private_key_file, runtime, python, known_hosts,
           host_key_policy, ssh_wait, ssh_config, gateway, dry_run):
    """The cluster that status, down and doctor act on: the saved one, or the hosts given."""
    from areal_kit.cluster.remote import ConnectOptions

    opts = _saved_or_given(name, hosts, hostnames, inventory, username, ssh_port, private_key_file, runtime, python)
    opts.dry_run = dry_run
    opts.log_dir = ""
    opts.ssh_config = ssh_config or opts.ssh_config
    opts.gateway = gateway or opts.gateway
    opts.__post_init__()
    copts = ConnectOptions(known_hosts=known_hosts, host_key_policy=host_key_policy, wait=ssh_wait,
                           ssh_config=opts.ssh_config, gateway=opts.gateway)
    secrets = {"RAY_AUTH_TOKEN": _ray_token(opts.spec.cluster_name)} if opts.ray_auth_mode == "token" else {}
    return opts, _build(opts, copts, secrets)


def _manage(which: str, name, hosts, hostnames, inventory, username, ssh_port, private_key_file, runtime,
            python, known_hosts, host_key_policy, ssh_wait, ssh_config, gateway, dry_run, grace: float = 0.0) -> int:
    from rich.table import Table

    from areal_kit.cluster import ray_cluster, steps
    from areal_kit.cluster.parallel import Step, make_console, print_dry_run, run_steps

    opts, cluster = _reach(name, hosts, hostnames, inventory, username, ssh_port, private_key_file, runtime, python,
                           known_hosts, host_key_policy, ssh_wait, ssh_config, gateway, dry_run)
    console = make_console()
    try:
        if which == "down":
            # Training first, while its workers still run: it checkpoints the step under way.
            plan = [Step("connect", steps.connect),
                    Step("stop training", functools.partial(ray_cluster.stop_training, grace=grace), head_only=True),
                    Step("down", ray_cluster.down, head_last=True)]
            if dry_run:
                for h in cluster.hosts:
                    for s in plan:
                        if h.is_head or not s.head_only:
                            s.fn(cluster, h)
                print_dry_run(cluster, console)
                return 0
            return 0 if run_steps(cluster, plan, console) else 1
        plan = [Step("connect", steps.connect), Step("ray", ray_cluster.probe)]
        ok = run_steps(cluster, plan, console)
        head = cluster.head
        alive = None
        if not head.failed:
            res = head.remote.run(ray_cluster.nodes_cmd(cluster, [], 0, 0), sudo=opts.runtime == "docker", timeout=60)
            alive = ray_cluster.parse_nodes(res)
        t = Table(title=f"cluster {opts.spec.cluster_name} ({opts.runtime})")
        for col in ("host", "address", "ray process", "in Ray cluster", "GPUs"):
            t.add_column(col)
        for h in cluster.hosts:
            member = "?" if alive is None or not h.ip else ("yes" if h.ip in alive else "NO")
            gpus = f"{alive[h.ip]:g}" if alive and h.ip in alive else "-"
            t.add_row(h.name, h.ip or "-", h.facts.get("ray_state", "unreachable"), member, gpus)
        console.print(t)
        console.print(f"Ray reports {len(alive)} alive node(s)" if alive is not None else "Ray head not answering")
        if not head.failed:
            console.print(f"training: {ray_cluster.training_state(cluster, head)}", markup=False, soft_wrap=True)
        ok = ok and alive is not None and all(h.ip in alive for h in cluster.hosts)
        return 0 if ok else 1
    finally:
        _close(cluster)


# status and down find and reach the cluster the same way: each of those options is defined once
# here (flags, help, default) and both signatures use it, so the two commands cannot drift apart.
_NAME = _O(None, "--name", help="Cluster name given at setup (default areal).")
_HOSTS = typer.Argument(None, help="Hosts, instead of the saved state of the last setup.")
_HOSTNAMES = _O(None, "--hostnames", help="Hosts (repeat or comma-separate); default: saved state.")
_INVENTORY = _O(None, "--inventory", "--cluster-spec", help="YAML inventory or JSON cluster spec.")
_USERNAME = _O(None, "--username", help="SSH user (default: as at setup, else root).")
_SSH_PORT = _O(None, "--ssh_port", "--ssh-port", help="SSH port.")
_KEY_FILE = _O(None, "--private_key_file", "--private-key-file", help="SSH private key.")
_RUNTIME = _O(None, "--runtime", help="docker | host (default: as at setup).")
_PYTHON = _O(None, "--python", help="Python with ray (default: as at setup).")
_KNOWN_HOSTS = _O("~/.ssh/known_hosts", "--known-hosts", help="known_hosts file.")
_HOST_KEY_POLICY = _O("accept-new", "--host-key-policy", help="accept-new | strict | off.")
_SSH_WAIT = _O(10.0, "--ssh-wait", help="Seconds to keep retrying unreachable hosts.")
_SSH_CONFIG = _O(None, "--ssh-config", help="OpenSSH client config (default: as at setup, else ~/.ssh/config).")
_GATEWAY = _O(None, "--gateway", help="Jump host [user@]host[:port] (default: as at setup).")


def status(
    name: str = _NAME, hosts: list[str] = _HOSTS, hostnames: list[str] = _HOSTNAMES, inventory: str = _INVENTORY,
    username: str = _USERNAME, ssh_port: int = _SSH_PORT, private_key_file: str = _KEY_FILE,
    runtime: str = _RUNTIME, python: str = _PYTHON, known_hosts: str = _KNOWN_HOSTS,
    host_key_policy: str = _HOST_KEY_POLICY, ssh_wait: float = _SSH_WAIT, ssh_config: str = _SSH_CONFIG,
    gateway: str = _GATEWAY,
) -> int:
    """Report, per host, the Ray process and whether Ray counts it as a live node."""
    return _manage("status", name, hosts, hostnames, inventory, username, ssh_port, private_key_file,
                   runtime, python, known_hosts, host_key_policy, ssh_wait, ssh_config, gateway, False)


def down(
    name: str = _NAME, hosts: list[str] = _HOSTS, hostnames: list[str] = _HOSTNAMES, inventory: str = _INVENTORY,
    username: str = _USERNAME, ssh_port: int = _SSH_PORT, private_key_file: str = _KEY_FILE,
    runtime: str = _RUNTIME, python: str = _PYTHON, known_hosts: str = _KNOWN_HOSTS,
    host_key_policy: str = _HOST_KEY_POLICY, ssh_wait: float = _SSH_WAIT, ssh_config: str = _SSH_CONFIG,
    gateway: str = _GATEWAY,
    dry_run: bool = _O(False, "--dry-run", help="Print the commands; run nothing."),
    grace: float = _O(STOP_GRACE, "--grace", min=0, help="Seconds training may take, after SIGTERM, to finish its step "
                      "and write that step's recover checkpoint; 0: stop it with Ray at once."),
) -> int:
    """Stop training, then Ray and its containers on every host (workers first).

    Training gets SIGTERM first, so it checkpoints the step under way; secrets files are removed.
    """
    return _manage("down", name, hosts, hostnames, inventory, username, ssh_port, private_key_file,
                   runtime, python, known_hosts, host_key_policy, ssh_wait, ssh_config, gateway, dry_run, grace)


def doctor(
    name: str = _NAME, hosts: list[str] = _HOSTS, hostnames: list[str] = _HOSTNAMES, inventory: str = _INVENTORY,
    username: str = _USERNAME, ssh_port: int = _SSH_PORT, private_key_file: str = _KEY_FILE,
    runtime: str = _RUNTIME, python: str = _PYTHON, known_hosts: str = _KNOWN_HOSTS,
    host_key_policy: str = _HOST_KEY_POLICY, ssh_wait: float = _SSH_WAIT, ssh_config: str = _SSH_CONFIG,
    gateway: str = _GATEWAY,
    preset: str = _O(None, "--preset", help="Also check against this preset: Ray has its GPUs per node, its "
                     "placement groups are reserved (and released), one of its vLLM engines generates."),
    min_shm_gb: float = _MIN_SHM,
    min_nofile: int = _MIN_NOFILE,
    min_disk_gb: float = _O(20.0, "--min-disk-gb", min=0, help="Free space required on the storage, in GB."),
    net_mb: float = _O(16.0, "--net-mb", min=0.01, help="Megabytes each bandwidth measurement sends."),
    rl_step: bool = _O(False, "--rl-step", help="Also one tiny RL step across the cluster (2 trainer ranks and an "
                       "engine apart, a weight sync, engine logprobs against the trainers')."),
    as_json: bool = _O(False, "--json", help="Print the results as one JSON object (the live view goes to stderr)."),
) -> int:
    """Check the running cluster: every host's limits and versions, shared storage, Ray, the network.

    Every failed check is one line: host, check, what was measured, what it should be, the fix.
    Exit 0 only when all pass. The figures are saved for `areal-kit train PRESET --dry-run`.
    """
    import json as json_mod
    import sys

    from areal_kit.cluster import doctor as doc
    from areal_kit.cluster import steps
    from areal_kit.cluster.parallel import Step, make_console, run_steps
    from areal_kit.console import make_console as shared_console

    limits = doc.Limits(min_shm_gb=min_shm_gb, min_nofile=min_nofile, min_disk_gb=min_disk_gb, net_mb=net_mb,
                        preset=preset, rl_step=rl_step)
    if preset:
        from areal_kit.config.loader import load_config

        limits.gpus_per_node = load_config(preset, []).n_gpus_per_node
    opts, cluster = _reach(name, hosts, hostnames, inventory, username, ssh_port, private_key_file, runtime, python,
                           known_hosts, host_key_policy, ssh_wait, ssh_config, gateway, False)
    console = shared_console(highlight=False, file=sys.stderr) if as_json else make_console()
    try:
        ok = run_steps(cluster, [Step("connect", steps.connect), *doctor_steps(limits, network=True)], console)
    finally:
        _close(cluster)
    rep = doc.report(cluster, ok)
    doc.save(cluster, rep)
    if as_json:
        print(json_mod.dumps(rep, indent=1))
    else:
        links = (rep.get("network") or {}).get("links_gbps")
        if links:
            from rich.table import Table

            head, *rows = doc.link_rows(links)
            t = Table(title=f"point-to-point bandwidth, GB/s ({rep['network']['backend']})")
            for col in head:
                t.add_column(col)
            for row in rows:
                t.add_row(*row)
            console.print(t)
        _print_findings(cluster, console)
        console.print(f"doctor {opts.spec.cluster_name}: " + ("every check passed" if ok else "checks failed (the "
                      "FAIL lines and the recap above)") + f"; figures in {doc.result_path(opts.spec.cluster_name)}",
                      markup=False, soft_wrap=True)
    return 0 if ok else 1


def _print_findings(cluster, console) -> None:
    for f in cluster.doctor.get("findings", []):
        console.print(f"FAIL {f.line()}", markup=False, soft_wrap=True)


def doctor_steps(limits, network: bool) -> list:
    """doctor's checks as steps; setup runs the fast ones (network=False)."""
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


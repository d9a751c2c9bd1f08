"""The Ray steps: start head and workers (in containers or on the hosts), wait until every node
has joined; and the probes/teardown behind `areal-kit status` and `areal-kit down`, the
training's state and its stop among them. setup's train step, which starts training on the head,
is in cluster/train_start.py.

Docker runtime: one container per host (``areal-<cluster>-head`` / ``-worker``) with
``--network host`` (Ray needs the hosts' real addresses), ``--shm-size`` for the object
store, the storage and extra mounts, ``--gpus all`` where nvidia-smi found GPUs, the host's
InfiniBand devices with locked memory allowed (for NCCL's RDMA transport), the cluster spec's
NCCL_* / GLOO_* settings, the Hugging Face hub switched off (models come from storage, so an
air-gapped cluster never waits on it), vLLM's compile cache on storage, and ``RAY_AUTH_MODE``
set explicitly (a head with token auth and workers without fail with "InvalidAuthToken"). A
label holds a digest of the whole `docker run` command: a container started with other options
is replaced, an identical running one is left alone (ok).
Host runtime: the same `ray start` arguments run directly with ``--python``.

Ray's dashboard listens on the head's cluster address (``--dashboard-host``), not 0.0.0.0.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from typing import TYPE_CHECKING

from areal_kit import logs
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import STOP_GRACE, env_prefix, parse_size, q
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.steps import must
from areal_kit.config.loader import RUN_ENV

if TYPE_CHECKING:
    from areal_kit.cluster.remote import Result

# Runs on the head with the cluster's Python: waits (in one driver connection) until every
# expected node address is alive with its GPUs, once each, prints {ip: gpus} of alive nodes.
NODES_SNIPPET = """
import json, socket, sys, time
addr, want, gpus, wait = sys.argv[1], set(filter(None, sys.argv[2].split(","))), float(sys.argv[3]), float(sys.argv[4])
try:  # a dead head would make ray.init hang for a minute: fail fast instead
    socket.create_connection((addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1])), timeout=5).close()
except OSError as e:
    print(f"NODES null  # GCS at {addr} unreachable: {e}")
    sys.exit(4)
import ray
ray.init(address=addr, logging_level="ERROR", log_to_driver=False)
end = time.time() + wait
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    alive = {n["NodeManagerAddress"]: n["Resources"].get("GPU", 0) for n in nodes}
    # A replaced node's old entry stays alive until its heartbeats are missed: wait for it to go,
    # or a driver started now may place work on the ghost.
    ips = [n["NodeManagerAddress"] for n in nodes]
    ok = want <= set(alive) and all(alive[ip] >= gpus for ip in want) and len(ips) == len(set(ips))
    if ok or time.time() > end:
        break
    time.sleep(1)
print("NODES " + json.dumps(alive))
print("TWICE " + json.dumps(sorted({ip for ip in ips if ips.count(ip) > 1})))
sys.exit(0 if ok else 3)
"""


def container_name(c: Cluster, h: HostState) -> str:
    return f"{c.opts.container_prefix}-{'head' if h.is_head else 'worker'}"


def ray_cli(c: Cluster) -> list[str]:
    return [c.opts.python, "-m", "ray.scripts.scripts"]


def ray_start_args(c: Cluster, h: HostState) -> list[str]:
    o = c.opts
    args = [*ray_cli(c), "start", "--node-ip-address", h.ip, "--disable-usage-stats"]
    if h.is_head:
        args += ["--head", "--port", str(o.ray_port)]
        args += ["--include-dashboard=true", "--dashboard-host", h.ip] if o.dashboard \
            else ["--include-dashboard=false"]
    else:
        args += ["--address", f"{c.head.ip}:{o.ray_port}"]
    if o.num_cpus:
        args += ["--num-cpus", str(o.num_cpus)]
    osm = parse_size(o.object_store_memory, "--object-store-memory")
    if osm:
        args += ["--object-store-memory", str(osm)]
    return args


def host_env(c: Cluster, h: HostState, saved: bool = False) -> str:
    """Prefix for host-runtime commands: Ray env, plus the secrets file when there is one (this run's;
    saved: the one setup left on the host, if any, for a later command that brings no secrets)."""
    pre = env_prefix(runtime_env(c))
    if not (c.secrets or saved):
        return pre
    sec = shlex.quote(c.opts.secrets_path(h.remote.user))
    load = f"set -a; . {sec}; set +a;"
    return f"{load} {pre}" if c.secrets else f"if [ -f {sec} ]; then {load} fi; {pre}"


INFINIBAND = "/dev/infiniband"


def runtime_env(c: Cluster) -> dict[str, str]:
    """Environment of every Ray process on a host (the container's, or the host runtime's command
    prefix), so of every worker it runs: fixed settings, then the cluster spec's NCCL_* / GLOO_*
    ones, then `--env` (later wins)."""
    o = c.opts
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           # The training's cache folder (its fileroot's), so vLLM compiles a model once per cluster.
           "VLLM_CACHE_ROOT": f"{o.spec.fileroot.rstrip('/')}/cache/vllm",
           # The defaults of `areal-kit train` run here by hand (config/loader.py): the places setup's
           # own driver is given, and this cluster's Ray, so such a run resumes setup's.
           **{RUN_ENV[key]: value for key, value in (("fileroot", o.spec.fileroot), ("storage_root", o.storage),
                                                     ("ray_address", "auto"))}}
    return {**env, **o.spec.env, **o.ray_env()}


def docker_run_args(c: Cluster, h: HostState) -> list[str]:
    o = c.opts
    args = ["docker", "run", "-d", "--name", container_name(c, h), "--network", "host",
            "--shm-size", o.shm_size, "--label", f"areal-kit.cluster={o.spec.cluster_name}",
            "--label", f"areal-kit.role={'head' if h.is_head else 'worker'}"]
    if h.facts.get("gpus"):
        args += ["--gpus", "all"]
    if h.facts.get("infiniband"):
        args += ["--device", INFINIBAND]
    if h.facts.get("gpus") or h.facts.get("infiniband"):
        # Pinned host buffers (CUDA) and RDMA registrations lock their pages: NCCL needs both
        # allowed without a limit, or it falls back to slower paths or fails to register.
        args += ["--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1:-1"]
    if c.secrets:
        args += ["--env-file", o.secrets_path(h.remote.user)]
    for k, v in runtime_env(c).items():
        args += ["-e", f"{k}={v}"]
    args += o.volume_args()
    args += [c.image, *ray_start_args(c, h), "--block"]
    digest = hashlib.sha256(shlex.join(args).encode()).hexdigest()[:16]
    return args[:3] + ["--label", f"areal-kit.config={digest}"] + args[3:]


def _digest(args: list[str]) -> str:
    return args[args.index("--label") + 1].split("=", 1)[1]


# -- 6. ray -----------------------------------------------------------------------------------
def ray(c: Cluster, h: HostState) -> Outcome:
    return _ray_docker(c, h) if c.opts.runtime == "docker" else _ray_host(c, h)


def _wait_head(c: Cluster, h: HostState, status_cmd: str, logs_cmd: str) -> None:
    if c.opts.dry_run:
        h.remote.run(status_cmd, check=True)
        return
    end = time.monotonic() + 90
    while True:
        # The nodes probe fails fast (TCP check) while the GCS is not listening yet, where
        # `ray status` would sit ~45 s before giving up.
        res = h.remote.run(status_cmd, sudo=c.opts.runtime == "docker", quiet=True, timeout=60)
        if res.ok:
            return
        if time.monotonic() > end:
            logs = h.remote.run(logs_cmd, sudo=True)
            raise StepFailed(f"Ray head on {h.name} did not answer within 90s", logs)
        time.sleep(2)


def probe_infiniband(c: Cluster, h: HostState) -> bool:
    """Whether the host has InfiniBand devices to hand to its container (remembered in its facts)."""
    if "infiniband" not in h.facts:
        h.facts["infiniband"] = h.remote.run(q("test", "-d", INFINIBAND), check=True).ok
    return h.facts["infiniband"]


def _ray_docker(c: Cluster, h: HostState) -> Outcome:
    name = container_name(c, h)
    probe_infiniband(c, h)
    args = docker_run_args(c, h)
    fmt = '{{.State.Running}} {{index .Config.Labels "areal-kit.config"}}'
    res = h.remote.run(q("docker", "inspect", "--format", fmt, name), sudo=True, check=True)
    head_changed = c.head.facts.get("ray_changed", False)
    if res.ok and res.stdout.split() == ["true", _digest(args)] and not (head_changed and not h.is_head):
        return Outcome("ok", f"{name} running")
    why = "not running" if not res.ok else (
        "head was restarted" if head_changed and not h.is_head else "stopped or started with other options")
    if res.ok:
        why += _stop_training_once(c, h)
        # Leave Ray politely first: a raylet killed with its container stays an alive node in the
        # head's view until its heartbeats are missed, and work placed there meanwhile is lost.
        h.remote.run(q("docker", "exec", name, *ray_cli(c), "stop"), sudo=True, timeout=60)
        must(c, h, q("docker", "rm", "-f", name), f"removing old {name}", sudo=True)
    run = must(c, h, shlex.join(args), f"starting {name}", sudo=True, timeout=300)
    if h.is_head:
        h.facts["ray_changed"] = True
        _wait_head(c, h, nodes_cmd(c, [], 0, 0), q("docker", "logs", "--tail", "30", name))
    else:
        # A worker that cannot reach the head exits after a while; catch the quick failures.
        time.sleep(0 if c.opts.dry_run else 2)
        st = h.remote.run(q("docker", "inspect", "--format", "{{.State.Running}}", name), sudo=True, check=True)
        if not c.opts.dry_run and st.stdout.strip() != "true":
            raise StepFailed(f"{name} exited right after start on {h.name}",
                             h.remote.run(q("docker", "logs", "--tail", "30", name), sudo=True))
    return Outcome("changed", f"{name} started ({why}); container {run.stdout.strip()[:12]}")


def _stop_training_once(c: Cluster, h: HostState) -> str:
    """Before a container of the cluster is removed, SIGTERM the training so that it checkpoints its
    step: its driver runs in the head's container, its actors in any of them. Hosts replace their
    containers in parallel; the first to ask stops it (up to STOP_GRACE), the others wait for that.
    Returns what to add to the host's message."""
    with c.stop_lock:
        first = c.training_stop is None
        if c.training_stop is None:
            c.training_stop = (h.name, stop_training(c, c.head, STOP_GRACE))
        by, stopped = c.training_stop
    if stopped.status != "changed":
        return ""
    return f"; first, {stopped.message}" if first else f"; after training was stopped for {by}'s container"


def _ray_host(c: Cluster, h: HostState) -> Outcome:
    o = c.opts
    pre = host_env(c, h)
    head_addr = f"{c.head.ip}:{o.ray_port}"
    if h.is_head:
        # `ray status` against nothing takes ~45 s to give up: look for a local GCS first.
        gcs = f"pgrep -af '[g]cs_server' | grep -qF -- {shlex.quote(f'--gcs_server_port={o.ray_port}')}"
        if h.remote.run(gcs, check=True).ok and h.remote.run(nodes_cmd(c, [], 0, 0), check=True, timeout=60).ok:
            return Outcome("ok", f"Ray head running at {head_addr} (run `areal-kit down` to restart)")
    else:
        # The bracket keeps this check from matching the shell that runs it.
        check = f"pgrep -af '[r]aylet' | grep -qF -- {shlex.quote('--gcs-address=' + head_addr)}"
        if h.remote.run(check, check=True).ok and not c.head.facts.get("ray_changed"):
            return Outcome("ok", f"raylet running, joined {head_addr}")
        h.remote.run(f"{pre} {q(*ray_cli(c), 'stop', '--force')}")
    must(c, h, f"{pre} {shlex.join(ray_start_args(c, h))}", "ray start", timeout=180)
    if h.is_head:
        h.facts["ray_changed"] = True
    return Outcome("changed", "Ray head started" if h.is_head else f"Ray worker joined {head_addr}")


# -- 6b. wait for all nodes -------------------------------------------------------------------
def nodes_cmd(c: Cluster, want_ips: list[str], gpus: int, wait: float) -> str:
    head = c.head
    args = [c.opts.python, "-c", NODES_SNIPPET, f"{head.ip}:{c.opts.ray_port}", ",".join(want_ips),
            str(gpus), str(wait)]
    if c.opts.runtime == "docker":
        return q("docker", "exec", container_name(c, head), *args)
    return f"{host_env(c, head)} {q(*args)}"


def parse_nodes(res: Result) -> dict[str, float] | None:
    for line in res.stdout.splitlines():
        if line.startswith("NODES "):
            return json.loads(line[6:].split("  #")[0])
    return None


def ray_ready(c: Cluster, h: HostState) -> Outcome:
    live = [x for x in c.hosts if not x.failed]
    gpus = min((x.facts.get("gpus", 0) or 0 for x in live), default=0)
    res = h.remote.run(nodes_cmd(c, [x.ip for x in live], gpus, c.opts.ray_wait), sudo=c.opts.runtime == "docker",
                       timeout=c.opts.ray_wait + 60)
    if c.opts.dry_run:
        return Outcome("ok", "dry run")
    alive = parse_nodes(res)
    if alive is None:
        raise StepFailed("could not ask Ray for its nodes", res)
    missing = [f"{x.name} ({x.ip})" for x in live if x.ip not in alive]
    if missing:
        raise StepFailed(f"Ray reports {len(alive)} node(s) after {c.opts.ray_wait:.0f}s; missing: "
                         f"{', '.join(missing)}; see their logs", res)
    twice: list[str] = next((json.loads(ln[6:]) for ln in res.stdout.splitlines() if ln.startswith("TWICE ")), [])
    if twice:
        raise StepFailed(f"Ray counts two live nodes at {', '.join(twice)} after {c.opts.ray_wait:.0f}s: a "
                         "replaced node not yet gone, or a second raylet on that host; run `areal-kit down` "
                         "and setup again", res)
    short = [f"{x.name} ({alive[x.ip]:g} GPUs)" for x in live if alive[x.ip] < gpus]
    if short:
        raise StepFailed(f"Ray sees fewer GPUs than nvidia-smi on: {', '.join(short)}", res)
    total = sum(alive.values())
    return Outcome("ok", f"Ray reports {len(alive)} nodes, {total:g} GPUs")


# -- status and down --------------------------------------------------------------------------
def in_head(c: Cluster, h: HostState, body: str) -> str:
    """A shell script as a command where training runs: the head's container, or the head host."""
    return q("docker", "exec", container_name(c, h), "sh", "-c", body) if c.opts.runtime == "docker" \
        else q("sh", "-c", body)


# The training driver however it was started (setup's `python -m areal_kit.cli`, or a user's
# `areal-kit train`). "[.]" and "(" keep the shell running this pattern from matching itself.
TRAIN_DRIVER = "areal(_kit[.]cli|-kit) train"

def _grep(*heads: str) -> str:
    """A grep for the log lines of these kinds (logs.py's), as a _head_script template holds it."""
    return "grep -aE " + shlex.quote(logs.grep_pattern(*heads)).replace("{", "{{").replace("}", "}}")


# SIGTERM the driver, wait for it to go, print the lines its log wrote of the stop since the
# SIGTERM, else its log's last line. Exit 4: still running after the grace period.
_STOP_TRAINING = (
    "n=$(wc -c < \"$log\" 2>/dev/null || echo 0); kill -TERM $p; i=0; "
    # gone: no state (ps prints none), or a zombie its parent has not reaped yet
    "while s=$(ps -o stat= -p $p | tr -d ' ') && [ -n \"$s\" ] && [ \"${{s#Z}}\" = \"$s\" ]; do "
    "i=$((i+1)); [ $i -gt {grace} ] && exit 4; sleep 1; done; "
    "[ -f \"$log\" ] || exit 0; "
    f"said=$(tail -c +$((n+1)) \"$log\" | {_grep(logs.RUN_HEAD, logs.AFTER_SIGTERM_HEAD)}); "
    "[ -n \"$said\" ] && echo \"$said\" || echo \"its log's last line: $(tail -n 1 \"$log\")\"; exit 0")


def _head_script(c: Cluster, h: HostState, script: str, **fields: object) -> str:
    """`script` as a command where training runs (the head's container, or the head host), run with
    $p the training driver's pid and $log the file its output goes to; exit 3 when none runs."""
    find = f"pgrep -o -f {shlex.quote(TRAIN_DRIVER)}"
    if c.opts.runtime == "host":  # the pid setup recorded, else any driver
        pidfile = shlex.quote(f"{c.opts.storage.rstrip('/')}/.areal-kit/train-{c.opts.spec.cluster_name}.pid")
        find = f"{{ p=$(cat {pidfile} 2>/dev/null) && kill -0 $p 2>/dev/null && echo $p; }} || {find}"
    body = f"p=$({find}) || exit 3; log=$(readlink /proc/$p/fd/1); " + script.format(**fields)
    return in_head(c, h, body)


def stop_training(c: Cluster, h: HostState, grace: float) -> Outcome:
    """SIGTERM the training driver on the head and wait up to `grace` seconds for it to exit. It
    finishes the step under way and writes that step's recover checkpoint first, so a re-run loses
    no step. Never fails the host: `down` goes on either way."""
    if grace <= 0:
        return Outcome("skipped", "--grace 0: training stops with Ray, from its last checkpoint")
    cmd = _head_script(c, h, _STOP_TRAINING, grace=int(grace + 0.999))
    res = h.remote.run(cmd, sudo=c.opts.runtime == "docker", timeout=grace + 60)
    if c.opts.dry_run:
        return Outcome("ok", f"would SIGTERM training and wait up to {grace:g}s")
    if res.rc == 0:
        return Outcome("changed", f"training stopped after SIGTERM: {_how_it_stopped(res.stdout)}")
    if res.rc == 4:
        return Outcome("changed", f"training still running {grace:g}s after SIGTERM: stopped with Ray, "
                                  "from its last checkpoint")
    if _no_driver(res):
        return Outcome("ok", "no training running")
    return Outcome("ok", f"could not stop training (exit {res.rc}: {res.tail(1)}); it stops with Ray")


def _how_it_stopped(said: str) -> str:
    """The message of the last stop line the driver's log wrote (logs.py's, the time and level
    left out), else what the script printed instead: the log's last line."""
    lines = said.strip().splitlines()
    for line in reversed(lines):
        if (stop := logs.parse_stopped(line)) is not None:
            return logs.stopped_line(stop.signame, stop.global_step, stop.checkpoint)
        if (error := logs.parse_after_sigterm(line)) is not None:
            return logs.after_sigterm_line(error)
    return lines[-1] if lines else "its log did not say how"


def _no_driver(res: Result) -> bool:
    """The head script found no training driver (or no head container to look in)."""
    return res.rc == 3 or (res.rc == 1 and "No such container" in res.stderr)


# Prints the driver's log file and its last finished step.
_TRAINING_STATE = ("echo \"$log\"; "
                   f"[ -f \"$log\" ] && tail -n 200 \"$log\" | {_grep(logs.EPOCH_HEAD)} | tail -n 1; exit 0")


def training_state(c: Cluster, h: HostState) -> str:
    """One line for `areal-kit status`: is training running on the head, at which step, logging where."""
    res = h.remote.run(_head_script(c, h, _TRAINING_STATE), sudo=c.opts.runtime == "docker", check=True, timeout=60)
    if _no_driver(res):
        return "not running"
    if not res.ok:
        return f"unknown (exit {res.rc}: {res.tail(1)})"
    log, *last = res.stdout.strip().splitlines() or [""]
    where = f"log {log}" if log.startswith("/") else "its output is not a file"
    step = logs.parse_epoch(last[-1]) if last else None
    if step is None:
        return f"running, no step finished yet; {where}"
    eta = f", about {step.eta:.3f}s to go" if step.eta is not None else ""
    return f"running, global step {step.global_step} finished{eta}; {where}"


def probe(c: Cluster, h: HostState) -> Outcome:
    """What Ray process runs on this host (for `areal-kit status`)."""
    if c.opts.runtime == "docker":
        res = h.remote.run(q("docker", "ps", "-a", "--filter", f"label=areal-kit.cluster={c.opts.spec.cluster_name}",
                             "--format", "{{.Names}}: {{.Status}}"), sudo=True, check=True)
        if not res.ok:
            raise StepFailed(f"docker not usable on {h.name}", res)
        state = res.stdout.strip() or "no container"
        h.facts["ray_up"] = " Up " in f" {state} "
    else:
        res = h.remote.run("pgrep -af '[r]aylet' >/dev/null && echo raylet running || echo no raylet", check=True)
        state = res.stdout.strip()
        h.facts["ray_up"] = state == "raylet running"
    h.facts["ray_state"] = state
    return Outcome("ok", state)


def down(c: Cluster, h: HostState) -> Outcome:
    o = c.opts
    removed = []
    if o.runtime == "docker":
        ids = h.remote.run(q("docker", "ps", "-aq", "--filter", f"label=areal-kit.cluster={o.spec.cluster_name}"),
                           sudo=True, check=True)
        if not ids.ok and not o.dry_run:
            raise StepFailed(f"docker not usable on {h.name}", ids)
        if ids.stdout.split() or o.dry_run:
            must(c, h, q("docker", "rm", "-f", *ids.stdout.split()) if ids.stdout.split() else
                 "docker rm -f <ids>", "removing containers", sudo=True, timeout=120)
            removed.append(f"removed {len(ids.stdout.split())} container(s)")
    else:
        pidfile = f"{o.storage.rstrip('/')}/.areal-kit/train-{o.spec.cluster_name}.pid"
        if h.is_head:
            h.remote.run(f"p=$(cat {shlex.quote(pidfile)} 2>/dev/null) && kill -- -$p $p 2>/dev/null; "
                         f"rm -f {shlex.quote(pidfile)}")
        if h.remote.run("pgrep -f '[r]aylet' >/dev/null", check=True).ok:
            must(c, h, f"{host_env(c, h)} {q(*ray_cli(c), 'stop', '--force')}", "ray stop", timeout=120)
            # `ray stop --force` returns before the killed processes are gone.
            h.remote.run("for i in $(seq 1 50); do pgrep -f '[r]aylet' >/dev/null || exit 0; sleep 0.2; done; exit 1")
            removed.append("ray stopped")
    sec = o.secrets_path(h.remote.user)
    if h.remote.run(q("test", "-e", sec), check=True).ok:
        h.remote.run(q("rm", "-f", sec))
        removed.append("secrets file removed")
    return Outcome("changed", "; ".join(removed)) if removed else Outcome("ok", "nothing running")

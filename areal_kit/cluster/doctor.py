"""`areal-kit doctor`: the pre-flight check of a running cluster. It names the host and the check
that failed, what was measured, what it should be, and the fix.

    areal-kit doctor                       # the cluster set up last from this machine
    areal-kit doctor --preset 1.5B_n4      # also: Ray has what the preset needs, its layout places
    areal-kit doctor --json                # for programs; exit 0 only when every check passed

Steps (run on every host in parallel with setup's live view and recap; a failed check does not
stop a host's later checks, so one run finds every fault):
  host     inside the runtime (cluster/probe.py): /dev/shm, open-file limit, free disk on storage and
           Ray's temp dir, the storage holds the head's token (shared) and survives write, fsync,
           rename; clock offset to this machine; Docker, Ray, torch, vLLM versions; GPUs; on a host
           with GPUs the GPU stack (cluster/gpu_stack.py): the driver against what the image's CUDA
           needs, the runtime sees every GPU the host has, torch sees them, an NCCL all-reduce over
           them with its bus bandwidth (skipped, with the reason, on a host without GPUs)
  agree    each host against the others: versions, GPU count, model, memory, driver, CUDA; clock skew
  ray      Ray counts the host alive, with the GPUs the preset needs
  network  (rl/preflight.py, run on the head) every ordered pair of nodes point to point and an
           all-reduce over all, on the run's own backend (gloo on CPU, NCCL on GPUs) and weight-sync
           transport; a host whose best link is far below the others' is slow; with --preset, its
           placement groups are reserved and released and one of its vLLM engines generates
  rl-step  (--rl-step; rl/preflight.py, run on the head) one tiny RL step across the cluster: 2
           trainer ranks and an engine placed apart, a weight sync, the engine's logprobs against
           the trainers'
`areal-kit setup` runs host (the GPU stack included), agree, ray and the network step's all-reduce
over the weight sync's group (NCCL across the GPU nodes) at its end and starts no training after a
failed one (unless --skip-doctor). `areal-kit train` on a GPU runs the host step's GPU-stack check
of its own node before it builds any actor (probe.py `cuda`, through hardware.check_cuda). The
figures are saved beside the cluster's
state (netfigures.py), where `areal-kit train PRESET --dry-run` finds the measured bandwidth for its
weight-sync estimate.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from areal_kit.cluster import gpu_stack
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import Limits, q
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.ray_cluster import container_name, host_env, nodes_cmd, parse_nodes
from areal_kit.cluster.steps import GPU_COUNT, parse_gpu_count
from areal_kit.findings import Finding

# A host's best link below this fraction of the median host's best is named slow.
SLOW_FRACTION = 0.5
MAX_CLOCK_SKEW_S = 1.0
MIN_RAY_TMP_GB = 5.0


# What doctor runs where the workers run, each printing `PROBE <json>`: this host's facts, and the
# training's own parts on the cluster (run as a command: the cluster package never imports rl).
HOST_PROBE = "areal_kit.cluster.probe"
PREFLIGHT = "areal_kit.rl.preflight"


def _in_runtime(c: Cluster, h: HostState, module: str, args: list[str]) -> str:
    """A command run where the training's workers run: the host's Ray container, or the host."""
    cmd = [c.opts.python, "-m", module, *args]
    if c.opts.runtime == "docker":
        return q("docker", "exec", container_name(c, h), *cmd)
    return f"{host_env(c, h)} {q(*cmd)}"


def _probe(c: Cluster, h: HostState, module: str, args: list[str], timeout: float) -> dict:
    res = h.remote.run(_in_runtime(c, h, module, args), sudo=c.opts.runtime == "docker", timeout=timeout)
    for line in res.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise StepFailed(f"the probe did not run there (exit {res.rc})", res)


def _need_gpus(c: Cluster, limits: Limits) -> int:
    """GPUs each host must have: the preset's where the hosts have GPUs (on CPU nodes a preset's
    GPUs are CPU slots, which the placement check covers)."""
    return limits.gpus_per_node if any(f["gpus"] for f in c.doctor.hosts.values()) else 0


def _fail(c: Cluster, h: HostState, found: list[Finding], ok: str) -> Outcome:
    """Record the host's findings; a failed outcome that does not stop its later checks."""
    c.doctor.findings.extend(found)
    if found:
        return Outcome("failed", " | ".join(f"{f.measured}, expected {f.expected}" for f in found),
                       blocking=False)
    return Outcome("ok", ok)


# -- host -------------------------------------------------------------------------------------
def host_gpus(h: HostState) -> int:
    """The GPUs the host itself has (nvidia-smi -L outside the runtime): setup's preflight counted
    them; doctor asks the host."""
    if "gpus" not in h.facts:
        h.facts["gpus"] = parse_gpu_count(h.remote.run(GPU_COUNT, check=True).stdout)
    return h.facts["gpus"] or 0


def host_step(c: Cluster, h: HostState, limits: Limits) -> Outcome:
    """This host's facts, checked against the limits (the head first: it writes the storage token)."""
    o = c.opts
    gpus_here = host_gpus(h)
    args = ["host", "--storage", o.storage, *(["--write-token", c.token] if h.is_head else ["--read-token"]),
            *(["--host-gpus", str(gpus_here)] if gpus_here else [])]
    t0 = time.time()
    clock = h.remote.run("date +%s.%N", check=True)
    t1 = time.time()
    try:
        # With GPUs the probe also spawns a process a GPU for the NCCL all-reduce.
        facts = _probe(c, h, HOST_PROBE, args, timeout=300 if gpus_here else 120)
    except StepFailed as e:
        return _fail(c, h, [Finding(h.name, "runtime", f"{e} ({e.result.tail(1) if e.result else ''})",
                                    f"the {o.runtime} runtime to answer", "areal-kit setup (it restarts what is down)")], "")
    facts["clock_offset_s"] = float(clock.stdout.strip() or "nan") - (t0 + t1) / 2
    facts["clock_uncertainty_s"] = (t1 - t0) / 2
    if o.runtime == "docker":
        v = h.remote.run(q("docker", "version", "--format", "{{.Server.Version}}"), sudo=True, check=True)
        facts["versions"]["docker"] = v.stdout.strip() or "-"
    c.doctor.hosts[h.name] = facts
    found = []
    f = lambda check, measured, expected, fix: found.append(Finding(h.name, check, measured, expected, fix))
    shm_fix = (f"areal-kit setup --shm-size {max(16, limits.min_shm_gb):g}g (docker run --shm-size)" if o.runtime == "docker"
               else "mount -o remount,size=16g /dev/shm (and in /etc/fstab)")
    if facts["shm_gb"] < limits.min_shm_gb:
        f("shm", f"/dev/shm is {facts['shm_gb']:.2g} GB", f">= {limits.min_shm_gb:g} GB", shm_fix)
    if facts["nofile"] < limits.min_nofile:
        f("nofile", f"open-file hard limit {facts['nofile']}", f">= {limits.min_nofile}",
          "docker run --ulimit nofile=1048576:1048576 (daemon.json default-ulimits)" if o.runtime == "docker"
          else "'* - nofile 1048576' in /etc/security/limits.conf, or LimitNOFILE= for the service")
    if facts["storage_free_gb"] is not None and facts["storage_free_gb"] < limits.min_disk_gb:
        f("disk", f"{facts['storage_free_gb']:.1f} GB free at {o.storage}", f">= {limits.min_disk_gb:g} GB",
          "free space on the shared storage (old checkpoints, datasets)")
    if facts["ray_tmp_free_gb"] < MIN_RAY_TMP_GB:
        f("ray-tmp", f"{facts['ray_tmp_free_gb']:.1f} GB free for /tmp/ray", f">= {MIN_RAY_TMP_GB:g} GB",
          "free space under /tmp, or start Ray with --temp-dir on a larger disk")
    if facts["storage_io"]:
        f("storage-io", f"write, fsync, rename at {o.storage}: {facts['storage_io']}", "all three to work",
          f"mount {o.storage} read-write with a filesystem that supports fsync and rename (NFS, Lustre, CephFS)")
    elif not h.is_head and facts["token"] != c.token:
        f("shared-storage", f"{o.storage} does not hold the token the head wrote there",
          f"the same filesystem as on {c.head.name}", f"mount the shared storage at {o.storage} on {h.name} "
          "(areal-kit setup --nas-url server:/export), also inside the container (--mount)")
    gpus, stack_facts = facts["gpus"], facts.get("gpu_stack") or {}
    found += gpu_stack.findings(h.name, stack_facts, o.runtime)
    return _fail(c, h, found, f"/dev/shm {facts['shm_gb']:.2g} GB, nofile {facts['nofile']}, "
                              f"{facts['storage_free_gb']} GB free on storage, {len(gpus)} GPUs, "
                              f"clock {facts['clock_offset_s']:+.3f}s; {gpu_stack.summary(stack_facts)}")


# -- agree ------------------------------------------------------------------------------------
def _reference(c: Cluster, key: Callable[[dict], Any]) -> Any:
    """The value most hosts have (the head's on a tie): a JSON value."""
    values = [key(f) for f in c.doctor.hosts.values()]
    if not values:
        return None
    counts = Counter(json.dumps(v, sort_keys=True) for v in values)
    top = max(counts.values())
    head = c.doctor.hosts.get(c.head.name)
    if head is not None and counts[json.dumps(key(head), sort_keys=True)] == top:
        return key(head)
    return json.loads(counts.most_common(1)[0][0])


def _version_of(pkg: str) -> Callable[[dict], Any]:
    """A host's version of pkg, from its facts."""
    return lambda f: f["versions"].get(pkg)


def agree_step(c: Cluster, h: HostState, limits: Limits) -> Outcome:
    facts = c.doctor.hosts.get(h.name)
    if facts is None:
        return Outcome("skipped", "no facts from the host step")
    found = []
    for pkg in sorted(facts["versions"]):
        want = _reference(c, _version_of(pkg))
        if facts["versions"][pkg] != want:
            found.append(Finding(h.name, "versions", f"{pkg} {facts['versions'][pkg]}", f"{pkg} {want} as on the others",
                                 "one runtime image (or environment) on every host: areal-kit setup --image ..."))
    gpu_want = _need_gpus(c, limits) or len(_reference(c, lambda f: f["gpus"]) or [])
    if len(facts["gpus"]) != gpu_want:
        found.append(Finding(h.name, "gpus", f"{len(facts['gpus'])} GPUs", f"{gpu_want}",
                             "check nvidia-smi on the host (a GPU fallen off the bus needs a reset or a reboot)"))
    for what, key in (("gpu-model", lambda f: sorted({(g["name"], g["memory_gb"]) for g in f["gpus"]})),
                      ("driver", lambda f: sorted({g["driver"] for g in f["gpus"]})),
                      ("cuda", lambda f: f["cuda"])):
        want = _reference(c, key)
        if key(facts) != want:
            found.append(Finding(h.name, what, f"{key(facts)}", f"{want} as on the others",
                                 "the same GPU driver and runtime image on every host"))
    offsets = [f["clock_offset_s"] for f in c.doctor.hosts.values()]
    skew = facts["clock_offset_s"] - statistics.median(offsets)
    if abs(skew) - facts["clock_uncertainty_s"] > MAX_CLOCK_SKEW_S:
        found.append(Finding(h.name, "clock", f"{skew:+.2f}s from the other hosts' median",
                             f"within {MAX_CLOCK_SKEW_S:g}s", "run chrony or systemd-timesyncd on every host"))
    return _fail(c, h, found, f"versions, GPUs and clock agree ({skew:+.3f}s)")


# -- ray --------------------------------------------------------------------------------------
def _unseen() -> Outcome:
    """The later checks of a run in which no host's runtime answered: they would only fail the same way."""
    return Outcome("skipped", "no host's runtime answered the host step")


def ray_step(c: Cluster, h: HostState, limits: Limits) -> Outcome:
    if not c.doctor.hosts:
        return _unseen()
    if h.is_head:
        res = h.remote.run(nodes_cmd(c, [x.ip for x in c.hosts], _need_gpus(c, limits), 5),
                           sudo=c.opts.runtime == "docker", timeout=120)
        c.doctor.ray_nodes = parse_nodes(res)
        if c.doctor.ray_nodes is None:
            raise StepFailed("the Ray head does not answer; areal-kit setup starts it again", res)
    alive = c.doctor.ray_nodes or {}
    found = []
    if h.ip not in alive:
        found.append(Finding(h.name, "ray", f"Ray does not count {h.ip} alive ({len(alive)} nodes are)",
                             "every host a Ray node", "areal-kit setup (it restarts the missing Ray nodes)"))
    elif alive[h.ip] < _need_gpus(c, limits):
        found.append(Finding(h.name, "ray-gpus", f"Ray sees {alive[h.ip]:g} GPUs", f"{_need_gpus(c, limits)}",
                             "areal-kit setup again (the container started without --gpus all?)"))
    return _fail(c, h, found, f"alive in Ray with {alive.get(h.ip, 0):g} GPUs")


# -- network ----------------------------------------------------------------------------------
def host_bandwidth(links: dict[str, float]) -> dict[str, float]:
    """Each host's best link, a link counting at its slower direction: a slow host is slow both ways
    on every link (a rate limit on its egress shows on every link it is in), a fast host has at
    least one fast link left."""
    pairs: dict[frozenset, float] = {}
    for k, v in links.items():
        a, b = k.split(">")
        pairs[frozenset((a, b))] = min(v, pairs.get(frozenset((a, b)), float("inf")))
    best: dict[str, float] = {}
    for pair, v in pairs.items():
        for ip in pair:
            best[ip] = max(v, best.get(ip, 0.0))
    return best


def slow_hosts(links: dict[str, float]) -> dict[str, tuple[float, float]]:
    """ip -> (its best link, the median host's) for hosts far below the others (3 hosts or more:
    with 2, one link cannot tell which end is slow)."""
    best = host_bandwidth(links)
    if len(best) < 3:
        return {}
    med = statistics.median(best.values())
    return {ip: (v, med) for ip, v in best.items() if v < SLOW_FRACTION * med}


def network_step(c: Cluster, h: HostState, limits: Limits) -> Outcome:
    if not c.doctor.hosts:
        return _unseen()
    if h.is_head:
        args = ["net", "--address", f"{h.ip}:{c.opts.ray_port}", "--mb", f"{limits.net_mb:g}",
                "--fileroot", _fileroot(c), *(["--quick"] if limits.quick_network else [])]
        c.doctor.network = _probe(c, h, PREFLIGHT, args + (["--preset", limits.preset] if limits.preset else []),
                                     timeout=900)
    net = c.doctor.network or {}
    links = net.get("links_gbps", {})
    if h.ip not in net.get("nodes", {}):
        return Outcome("skipped", "not a Ray node (see the ray step)")
    found = sync_group_findings(h, net)
    slow = slow_hosts(links).get(h.ip)
    if slow:
        found.append(Finding(h.name, "network", f"best link {slow[0]:.3g} GB/s", f">= {SLOW_FRACTION:g} x "
                             f"{slow[1]:.3g} GB/s (the median host's best link)",
                             "check the host's NIC (ethtool, link speed, errors), its cabling and switch port, and "
                             "the interface NCCL/gloo use (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)"))
    if h.is_head and net.get("placement"):
        found.append(Finding(h.name, "placement", net["placement"], f"the {limits.preset} layout placed",
                             "a layout that fits the cluster (allocation_mode, n_nodes) or more nodes"))
    if h.is_head and net.get("engine"):
        found.append(Finding(h.name, "engine", f"a {limits.preset} vLLM engine did not generate: {net['engine']}",
                             "up to 8 tokens", "the runtime's vLLM and the model on the storage (areal-kit setup --data)"))
    best = host_bandwidth(links).get(h.ip)
    iface = dict(zip(net.get("nodes", {}), net.get("interfaces", []))).get(h.ip, "")
    ok = (f"best link {best:.3g} GB/s over {net.get('backend')} on {iface}" if best is not None
          else "one node: no link")
    if h.is_head and "all_reduce_busbw_gbps" in net:
        ok += (f"; all-reduce over the weight sync's {net.get('backend')} group across "
               f"{(net.get('all_reduce') or {}).get('nodes', len(net['nodes']))} nodes "
               f"{net['all_reduce_busbw_gbps']:.3g} GB/s bus bandwidth")
    if h.is_head and limits.preset and not net.get("placement"):
        ok += f"; the {limits.preset} layout places"
    if h.is_head and "engine_tokens" in net:
        ok += f"; its engine generated in {net['engine_s']:g}s"
    return _fail(c, h, found, ok)


def sync_group_findings(h: HostState, net: dict) -> list[Finding]:
    """The all-reduce across nodes over the weight sync's group: a finding on each node that did not
    finish it (on the head when the failure names none: the group did not form)."""
    ar = net.get("all_reduce") or {}
    if not ar.get("error") or not (h.ip in ar.get("failed", []) or (h.is_head and not ar.get("failed"))):
        return []
    backend = net.get("backend", "nccl")
    fix = ("check that the nodes reach each other on every TCP port (NCCL opens ephemeral ones), set "
           "NCCL_SOCKET_IFNAME to the cluster's interface in the runtime's environment, and run it again with "
           "NCCL_DEBUG=INFO" if backend == "nccl" else
           "check that the nodes reach each other on every TCP port and GLOO_SOCKET_IFNAME")
    return [Finding(h.name, "sync-group", f"{backend} all-reduce over the weight sync's group across {ar['nodes']} "
                    f"nodes failed here: {ar['error']}", "the sum over every node", fix)]


def _fileroot(c: Cluster) -> str:
    """Where doctor's engine and RL step keep their model and run: on the shared storage."""
    return f"{c.opts.storage.rstrip('/')}/.areal-kit/doctor"


# -- rl step ----------------------------------------------------------------------------------
# Engine and trainer compute the same logprobs in fp32 (the tiny preset's dtype) up to rounding;
# a weight sync that left the engine stale or garbled misses by far more.
LOGPROB_GAP = 1e-3


def rl_step_step(c: Cluster, h: HostState, limits: Limits) -> Outcome:
    """One tiny RL step across the cluster (head only): it runs, syncs, and the engine agrees."""
    got = c.doctor.rl_step = _probe(c, h, PREFLIGHT, ["rlstep", "--fileroot", _fileroot(c)], timeout=1200)
    found = []
    if got["rl_step"]:
        found.append(Finding(h.name, "rl-step", f"the tiny RL step failed: {got['rl_step']}", "one step to finish",
                             f"read its log {got['log']}"))
    elif got["logprob_gap"] > LOGPROB_GAP:
        found.append(Finding(h.name, "rl-step", f"engine logprobs {got['logprob_gap']:.2g} from the trainer's after "
                             "the weight sync", f"<= {LOGPROB_GAP:g}", "weight_sync=disk to tell a transport fault "
                             f"from an engine one; the run's log {got['log']}"))
    return _fail(c, h, found, f"1 step in {got.get('seconds', 0):g}s, trainers on {', '.join(got.get('trainer_ips', []))}, "
                              f"engine on {', '.join(got.get('engine_ips', []))}, logprob gap "
                              f"{got.get('logprob_gap', float('nan')):.1g}")


# -- results ----------------------------------------------------------------------------------
def link_rows(links: dict[str, float]) -> list[list[str]]:
    """The links as a matrix for people: a header row of destinations, then one row per source (GB/s)."""
    ips = sorted({ip for k in links for ip in k.split(">")})
    return [["from \\ to", *ips]] + [[s, *("-" if s == d else f"{links.get(f'{s}>{d}', float('nan')):.3g}" for d in ips)]
                                    for s in ips]


def report(c: Cluster, ok: bool) -> dict:
    """Everything doctor measured and found; ok: every step passed on every host (an unreachable
    host fails without a finding); fault: why the run saw no host ("" when it did)."""
    d = c.doctor
    return {"cluster": c.opts.spec.cluster_name, "time": time.time(), "ok": ok, "fault": run_fault(c),
            "findings": [asdict(f) for f in d.findings], "hosts": d.hosts, "ray_nodes": d.ray_nodes,
            "network": d.network, "rl_step": d.rl_step}


def run_fault(c: Cluster) -> str:
    """Why this run says nothing about the hosts, "" when it does: it reached none of them over SSH,
    or the runtime it was told to use answered on none (a --runtime or --python other than the
    cluster's, or a cluster that is not set up). Such a run keeps the figures saved before it."""
    if not any(h.outcomes.get("connect") and h.outcomes["connect"].status == "ok" for h in c.hosts):
        return "no host could be reached over SSH"
    if not c.doctor.hosts:
        return f"the {c.opts.runtime} runtime ({c.opts.python}) answered on no host"
    return ""


def blame_the_run(c: Cluster) -> None:
    """Point the runtime findings of a run that reached no runtime at its settings: the hosts may be
    fine, and setup run again with these settings would only repeat them."""
    fix = (f"check --runtime and --python (this run: {c.opts.runtime}, {c.opts.python}; leave them out to use "
           "the cluster's saved ones); areal-kit status shows whether Ray runs there")
    c.doctor.findings = [replace(f, fix=fix) if f.check == "runtime" else f for f in c.doctor.findings]

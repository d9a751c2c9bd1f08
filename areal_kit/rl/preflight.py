"""The training's own parts tried on a running Ray cluster: the network and --rl-step checks of
`areal-kit doctor`. doctor (cluster/doctor.py) runs this module on the head, where the training's
workers run (inside the Ray container, or with the host's Python), and reads the one line it
prints, `PROBE <json>`: the cluster side starts the training's code through a command and never
imports it.

    python -m areal_kit.rl.preflight net --address HEAD:6379 --mb 16 [--preset tiny --fileroot F] [--quick]
    python -m areal_kit.rl.preflight rlstep --fileroot /storage/.areal-kit/doctor

`net` (a Ray driver on the head): one actor on every alive node joins a group over the run's own
backend and transport (gloo on CPU, NCCL on GPUs: the weight sync's), then measures every ordered
pair of nodes point to point and an all-reduce over all of them (its sum checked, its bus bandwidth
reported; the nodes that did not finish it named); with --preset it also reserves and releases the
preset's placement groups and starts one of its vLLM engines on the cluster, which generates a few
tokens. --quick (setup's fast checks): the group and its all-reduce only.
`rlstep`: one tiny RL step end to end on the cluster (2 trainer ranks and an engine, each where
spread_roles places them), its weight sync, then the engine's logprobs against the trainers'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_kit import hardware, runlog
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.errors import ExitCode, UserError, describe
from areal_kit.eval.engine import GenRequest, RayEngines
from areal_kit.rl.agreement import engine_vs_trainer
from areal_kit.rl.driver import controller, groups, placement
from areal_kit.rl.driver.job import prepare, resolve_model
from areal_kit.rl.weight_sync.transport import init_group

# How long the all-reduce across nodes may take before the nodes that did not finish are named.
ALL_REDUCE_TIMEOUT_S = 300


def all_reduce_across(peers: list, ips: list[str], nbytes: int, timeout_s: float = ALL_REDUCE_TIMEOUT_S) -> dict:
    """The weight sync's group's all-reduce over every node: {nodes, mb, seconds, busbw_gbps} or
    {nodes, mb, error, failed: [ips]} (a rank that raised, returned a wrong sum, or did not finish)."""
    n = len(peers)
    out: dict = {"nodes": n, "mb": nbytes / (1 << 20)}
    refs = [p.all_reduce.remote(nbytes) for p in peers]
    done, _ = ray.wait(refs, num_returns=n, timeout=timeout_s)
    got, failed, why = [], [], ""
    for ip, ref in zip(ips, refs):
        if ref not in done:
            failed.append(ip)
            why = why or f"did not finish within {timeout_s:g}s"
            continue
        try:
            secs, total = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the node's failure is the finding
            failed.append(ip)
            why = why or describe(e)
            continue
        if total != n:
            failed.append(ip)
            why = why or f"reduced to {total:g}, expected {n} (the sum over the nodes)"
        got.append(secs)
    if failed:
        return {**out, "error": why, "failed": failed}
    secs = max(got)
    return {**out, "seconds": secs, "busbw_gbps": round(2 * (n - 1) / n * nbytes / secs / 1e9, 4)}


def _links(peers: list, ips: list[str], nbytes: int) -> dict[str, float]:
    """Every ordered pair of nodes, point to point, GB/s."""
    links = {}
    for s in range(len(peers)):
        for d in range(len(peers)):
            if s != d:
                _, secs = ray.get([peers[s].send.remote(d, nbytes), peers[d].recv.remote(s, nbytes)])
                links[f"{ips[s]}>{ips[d]}"] = round(2 * nbytes / secs / 1e9, 4)
    return links


def _measure(peers: list, ips: list[str], nbytes: int, backend: str, quick: bool) -> dict:
    """The group over every node, its all-reduce, then (unless quick, or the group failed) the links."""
    out: dict = {}
    port = ray.get(peers[0].free_port.remote())
    try:
        out["interfaces"] = ray.get([p.join.remote(ips[0], port, r, len(peers), backend, ips[r])
                                     for r, p in enumerate(peers)], timeout=ALL_REDUCE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a group that does not form is the finding
        out["all_reduce"] = {"nodes": len(peers), "mb": nbytes / (1 << 20), "failed": [],
                             "error": f"the weight sync's group did not form: {describe(e)}"}
        return out
    out["all_reduce"] = all_reduce_across(peers, ips, nbytes)
    if "busbw_gbps" in out["all_reduce"]:
        out["all_reduce_busbw_gbps"] = out["all_reduce"]["busbw_gbps"]
    if not quick and not out["all_reduce"].get("error"):
        out["links_gbps"] = _links(peers, ips, nbytes)
    return out


def net(address: str, mb: float, preset: str | None, fileroot: str, quick: bool = False) -> dict:
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    gpu = all(n["Resources"].get("GPU", 0) >= 1 for n in nodes)
    backend = "nccl" if gpu else "gloo"
    out: dict = {"backend": backend, "nodes": {n["NodeManagerAddress"]: {k: n["Resources"].get(k, 0)
                                                                        for k in ("CPU", "GPU")} for n in nodes}}
    ips = list(out["nodes"])
    peer = ray.remote(_Peer)
    peers = [peer.options(num_cpus=0, num_gpus=1 if gpu else 0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in nodes]
    if len(peers) > 1:
        out.update(_measure(peers, ips, int(mb * (1 << 20)), backend, quick))
    if preset and not quick:
        out["placement"] = _place(preset)
        out.update(_engine(preset, fileroot, gpu))
    return out


def _engine(preset: str, fileroot: str, gpu: bool) -> dict:
    """One of the preset's vLLM engines, on the cluster as training starts them, generates (up to 8 tokens)."""
    t0 = time.time()
    engines = None
    try:
        cfg = load_config(preset, [f"fileroot={fileroot}"])
        model = resolve_model(cfg)  # tiny://: built on the shared storage, where the engine's node reads it
        engines = RayEngines(model, 64, 1, tp=parse_allocation(cfg.allocation_mode).gen.tp, use_gpu=gpu)
        got = engines.generate([GenRequest("doctor", (1, 2, 3), 1.0, 1.0, 8, 0)])[0]
        return {"engine": "", "engine_tokens": len(got.token_ids), "engine_s": round(time.time() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - reported as the check's finding
        return {"engine": describe(e)}
    finally:
        if engines is not None:
            engines.close()


def _place(preset: str) -> str:
    """'' when the preset's placement groups are reserved (then released); else why not."""
    try:
        groups.reserve(load_config(preset, []), hardware.detect())
        return ""
    except UserError as e:
        return str(e)
    finally:
        placement.release()


def rl_step(fileroot: str) -> dict:
    """One tiny RL step across the cluster; the engine's logprobs against the trainers' after the sync."""
    trial = time.strftime("doctor-%Y%m%d-%H%M%S")
    cfg = load_config("tiny", [f"fileroot={fileroot}", f"trial_name={trial}", "tensorboard=false", "ray_address=auto",
                               "spread_roles=true", "allocation_mode=vllm.d1p1m1+d2p1m1", "n_nodes=3",
                               "n_gpus_per_node=1", "exp_ctrl.total_train_steps=1"])
    t0 = time.time()
    job = prepare(cfg)
    log = runlog.RunLogger(job.paths, tensorboard=False, console=False)
    ctrl = controller.Controller(job, log)
    try:
        controller.start_ray(cfg)
        ctrl.start()
        ctrl.run()
        gap = engine_vs_trainer(ctrl.running, job.loader.rows)
        row = runlog.read_metrics(job.paths.metrics_file)[-1]
        where = _actor_ips()
        return {"rl_step": "", "logprob_gap": gap, "trainer_ips": where["trainer"], "engine_ips": where["engine"],
                "sync_time": row.get("sync_time"), "seconds": round(time.time() - t0, 1), "log": job.paths.log_file,
                "gpu": not hardware.detect().is_cpu}
    except Exception as e:  # noqa: BLE001 - reported as the check's finding
        return {"rl_step": describe(e), "log": job.paths.log_file}
    finally:
        ctrl.stop()
        log.close()


def _actor_ips() -> dict[str, list[str]]:
    """The nodes of this job's live trainer and engine actors, by role."""
    job_id = ray.get_runtime_context().get_job_id()
    where: dict[str, list[str]] = {"trainer": [], "engine": []}
    for a in ray._private.state.actors().values():
        name = a.get("ActorClassName") or ""
        role = "trainer" if "Trainer" in name else "engine" if "Rollout" in name else None
        if role and a.get("State") == "ALIVE" and a.get("JobID") == job_id:
            where[role].append(a["Address"]["IPAddress"])
    return {role: sorted(ips) for role, ips in where.items()}


class _Peer:
    """One node's end of the measurements: the weight sync's group on the weight sync's transport."""

    def free_port(self) -> int:
        return hardware.free_port()

    def join(self, host: str, port: int, rank: int, world: int, backend: str, ip: str) -> str:
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.store, self.group = init_group(host, port, rank, world, backend, timeout_s=300, local_ip=ip)
        if backend == "nccl":  # NCCL picks its own interface unless told
            return os.environ.get("NCCL_SOCKET_IFNAME") or "NCCL's choice (NCCL_SOCKET_IFNAME unset)"
        return f"{hardware.interface_of(ip) or '?'} ({ip})"  # gloo binds the node's cluster address

    def _buf(self, nbytes: int) -> torch.Tensor:
        return torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)

    def send(self, dst: int, nbytes: int) -> float:
        buf = self._buf(nbytes)
        for _ in range(3):  # one warm-up, two timed (the receiver times them)
            self.group.send([buf], dst, 0).wait()
        return 0.0

    def recv(self, src: int, nbytes: int) -> float:
        buf = self._buf(nbytes)
        self.group.recv([buf], src, 0).wait()
        self._sync()
        t0 = time.perf_counter()
        for _ in range(2):
            self.group.recv([buf], src, 0).wait()
        self._sync()
        return time.perf_counter() - t0

    def all_reduce(self, nbytes: int) -> tuple[float, float]:
        """(seconds of the timed all-reduce, the first one's sum: the number of nodes when sound)."""
        buf = self._buf(nbytes)
        self.group.allreduce([buf]).wait()
        self._sync()
        total = float(buf[-1].item())  # ones summed over the ranks
        t0 = time.perf_counter()
        self.group.allreduce([buf]).wait()
        self._sync()
        return time.perf_counter() - t0, total

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m areal_kit.rl.preflight")
    sub = ap.add_subparsers(dest="what", required=True)
    n = sub.add_parser("net")
    n.add_argument("--address", required=True)
    n.add_argument("--mb", type=float, default=16)
    n.add_argument("--preset")
    n.add_argument("--fileroot", default="/tmp/areal-kit-doctor")
    n.add_argument("--quick", action="store_true", help="the weight sync's group and its all-reduce only")
    r = sub.add_parser("rlstep")
    r.add_argument("--fileroot", required=True)
    a = ap.parse_args(argv)
    res = net(a.address, a.mb, a.preset, a.fileroot, a.quick) if a.what == "net" else rl_step(a.fileroot)
    print("PROBE " + json.dumps(res), flush=True)
    sys.exit(ExitCode.OK)


if __name__ == "__main__":
    main()

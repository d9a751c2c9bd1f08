"""What `areal-kit doctor` measures inside the runtime the training uses (the Ray container of each
host, or the host's Python for the host runtime). Each command prints one line, `PROBE <json>`.

    python -m areal_kit.cluster.probe host --storage /storage --ray-tmp /tmp/ray [--write-token T | --read-token]
    python -m areal_kit.cluster.probe net --address HEAD:6379 --mb 16 [--preset tiny --fileroot F]
    python -m areal_kit.cluster.probe rlstep --fileroot /storage/.areal-kit/doctor

`host`: this host's limits and versions, its accelerators, and whether the shared storage holds the
head's token and survives the write, fsync, rename sequence the recover checkpoints rely on.
`net` (a Ray driver on the head): one actor on every alive node joins a group over the run's own
backend and transport (gloo on CPU, NCCL on GPUs: the weight sync's), then measures every ordered
pair of nodes point to point and an all-reduce over all of them; with --preset it also reserves and
releases the preset's placement groups and starts one of its vLLM engines on the cluster, which
generates a few tokens.
`rlstep`: one tiny RL step end to end on the cluster (2 trainer ranks and an engine, each where
spread_roles places them), its weight sync, then the engine's logprobs against the trainers'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_kit import hardware, logs
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.durable import replace_lines
from areal_kit.errors import UserError
from areal_kit.eval.engine import GenRequest, RayEngines
from areal_kit.rl import controller
from areal_kit.rl.agreement import engine_vs_trainer
from areal_kit.rl.job import prepare, resolve_model
from areal_kit.rl.weight_sync.transport import init_group
from areal_kit.rl.workers import groups, placement

TOKEN_FILE = ".areal-kit/doctor-token"


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "-"


def _free_gb(path: str) -> float:
    while path and not os.path.exists(path):  # Ray's temp dir may not exist yet: its filesystem counts
        path = os.path.dirname(path.rstrip("/")) or "/"
    return shutil.disk_usage(path).free / 1e9


def _gpus() -> list[dict]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=False).stdout
    return [{"name": n.strip(), "memory_gb": round(float(m) / 1024, 1), "driver": d.strip()}
            for n, m, d in (line.split(",") for line in out.strip().splitlines() if line.count(",") == 2)]


def _storage_io(storage: str) -> str:
    """'' when a file written the way the recover checkpoints write theirs (a temporary file, fsynced,
    renamed into place, its folder fsynced: durable.replace_lines) reads back the same; else what failed."""
    d = os.path.join(storage, ".areal-kit")
    path = os.path.join(d, f"doctor-{socket.gethostname()}-{os.getpid()}")
    data = os.urandom(1 << 15).hex()
    try:
        os.makedirs(d, exist_ok=True)
        replace_lines(path, [data])
        with open(path) as f:
            if f.read() != data:
                return "the file read back differs from what was written"
        return ""
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        for p in (f"{path}.tmp", path):
            if os.path.exists(p):
                os.remove(p)


def host(storage: str, ray_tmp: str, write_token: str | None, read_token: bool) -> dict:
    token_path = os.path.join(storage, TOKEN_FILE)
    shm = os.statvfs("/dev/shm")
    facts = {"shm_gb": round(shm.f_blocks * shm.f_frsize / 1e9, 3),
             # the hard limit: Ray's processes raise their soft limit to it, none can go past it
             "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
             "storage_free_gb": round(_free_gb(storage), 2) if os.path.isdir(storage) else None,
             "ray_tmp_free_gb": round(_free_gb(ray_tmp), 2),
             "versions": {p: _version(p) for p in ("ray", "torch", "vllm", "deepspeed", "areal-kit")},
             "cuda": None, "gpus": _gpus(), "storage_io": "", "token": None}
    facts["cuda"] = torch.version.cuda
    if facts["storage_free_gb"] is None:
        facts["storage_io"] = f"{storage} does not exist"
        return facts
    facts["storage_io"] = _storage_io(storage)
    if write_token:
        replace_lines(token_path, [write_token])  # its folder exists: _storage_io made it
        facts["token"] = write_token
    elif read_token:
        try:
            with open(token_path) as f:
                facts["token"] = f.read()
        except OSError:
            facts["token"] = None
    return facts


def net(address: str, mb: float, preset: str | None, fileroot: str) -> dict:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    gpu = all(n["Resources"].get("GPU", 0) >= 1 for n in nodes)
    backend = "nccl" if gpu else "gloo"
    out: dict = {"backend": backend, "nodes": {n["NodeManagerAddress"]: {k: n["Resources"].get(k, 0)
                                                                        for k in ("CPU", "GPU")} for n in nodes}}
    ips = list(out["nodes"])
    Peer = ray.remote(_Peer)
    peers = [Peer.options(num_cpus=0, num_gpus=1 if gpu else 0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote() for n in nodes]
    if len(peers) > 1:
        port = ray.get(peers[0].free_port.remote())
        out["interfaces"] = ray.get([p.join.remote(ips[0], port, r, len(peers), backend, ips[r])
                                 for r, p in enumerate(peers)])
        nbytes = int(mb * (1 << 20))
        links = {}
        for s in range(len(peers)):
            for d in range(len(peers)):
                if s != d:
                    _, secs = ray.get([peers[s].send.remote(d, nbytes), peers[d].recv.remote(s, nbytes)])
                    links[f"{ips[s]}>{ips[d]}"] = round(2 * nbytes / secs / 1e9, 4)
        out["links_gbps"] = links
        secs = max(ray.get([p.all_reduce.remote(nbytes) for p in peers]))
        n = len(peers)
        out["all_reduce_busbw_gbps"] = round(2 * (n - 1) / n * nbytes / secs / 1e9, 4)
    if preset:
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
        return {"engine": _said(e)}
    finally:
        if engines is not None:
            engines.close()


def _said(e: Exception) -> str:
    """An exception in one line: its type and the last line of its message (a Ray task error's
    message ends with the worker's own error)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def rl_step(fileroot: str) -> dict:
    """One tiny RL step across the cluster; the engine's logprobs against the trainers' after the sync."""
    trial = time.strftime("doctor-%Y%m%d-%H%M%S")
    cfg = load_config("tiny", [f"fileroot={fileroot}", f"trial_name={trial}", "tensorboard=false", "ray_address=auto",
                               "spread_roles=true", "allocation_mode=vllm.d1p1m1+d2p1m1", "n_nodes=3",
                               "n_gpus_per_node=1", "exp_ctrl.total_train_steps=1"])
    t0 = time.time()
    job = prepare(cfg)
    log = logs.RunLogger(job.paths, tensorboard=False, console=False)
    ctrl = controller.Controller(job, log)
    try:
        ctrl.start()
        ctrl.run()
        gap = engine_vs_trainer(ctrl.workers, job.loader.rows, ctrl.workers.engines.actors[0])
        job_id = ray.get_runtime_context().get_job_id()
        where: dict[str, list[str]] = {"trainer": [], "engine": []}
        for a in ray._private.state.actors().values():
            role = "trainer" if "Trainer" in (a.get("ActorClassName") or "") else \
                "engine" if "Rollout" in (a.get("ActorClassName") or "") else None
            if role and a.get("State") == "ALIVE" and a.get("JobID") == job_id:
                where[role].append(a["Address"]["IPAddress"])
        row = logs.read_metrics(job.paths.metrics_file)[-1]
        return {"rl_step": "", "logprob_gap": gap, "trainer_ips": sorted(where["trainer"]),
                "engine_ips": sorted(where["engine"]), "sync_time": row.get("sync_time"),
                "seconds": round(time.time() - t0, 1), "log": job.paths.log_file, "gpu": not hardware.detect().is_cpu}
    except Exception as e:  # noqa: BLE001 - reported as the check's finding
        return {"rl_step": _said(e), "log": job.paths.log_file}
    finally:
        ctrl.stop()
        log.close()


def _place(preset: str) -> str:
    """'' when the preset's placement groups are reserved (then released); else why not."""
    try:
        groups.reserve(load_config(preset, []), hardware.detect())
        return ""
    except UserError as e:
        return str(e)
    finally:
        placement.release()


class _Peer:
    """One node's end of the measurements: the weight sync's group on the weight sync's transport."""

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def join(self, host: str, port: int, rank: int, world: int, backend: str, ip: str) -> str:
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        self.store, self.group = init_group(host, port, rank, world, backend, timeout_s=300, local_ip=ip)
        if backend == "nccl":  # NCCL picks its own interface unless told
            return os.environ.get("NCCL_SOCKET_IFNAME") or "NCCL's choice (NCCL_SOCKET_IFNAME unset)"
        return f"{hardware.interface_of(ip) or '?'} ({ip})"  # gloo binds the node's cluster address

    def _buf(self, nbytes: int):
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

    def all_reduce(self, nbytes: int) -> float:
        buf = self._buf(nbytes)
        self.group.allreduce([buf]).wait()
        self._sync()
        t0 = time.perf_counter()
        self.group.allreduce([buf]).wait()
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m areal_kit.cluster.probe")
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("host")
    h.add_argument("--storage", required=True)
    h.add_argument("--ray-tmp", default="/tmp/ray")
    h.add_argument("--write-token")
    h.add_argument("--read-token", action="store_true")
    n = sub.add_parser("net")
    n.add_argument("--address", required=True)
    n.add_argument("--mb", type=float, default=16)
    n.add_argument("--preset")
    n.add_argument("--fileroot", default="/tmp/areal-kit-doctor")
    r = sub.add_parser("rlstep")
    r.add_argument("--fileroot", required=True)
    a = ap.parse_args(argv)
    if a.what == "host":
        res = host(a.storage, a.ray_tmp, a.write_token, a.read_token)
    elif a.what == "net":
        res = net(a.address, a.mb, a.preset, a.fileroot)
    else:
        res = rl_step(a.fileroot)
    print("PROBE " + json.dumps(res), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()

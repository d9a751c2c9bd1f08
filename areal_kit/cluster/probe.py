"""What `areal-kit doctor` measures of each host inside the runtime the training uses (the Ray
container of each host, or the host's Python for the host runtime). It prints one line,
`PROBE <json>`.

    python -m areal_kit.cluster.probe host --storage /storage --ray-tmp /tmp/ray [--write-token T | --read-token]
        [--host-gpus 8]
    python -m areal_kit.cluster.probe cuda

`host`: this host's limits and versions, its accelerators, and whether the shared storage holds the
head's token and survives the write, fsync, rename sequence the recover checkpoints rely on; on a
host with GPUs (nvidia-smi here, or --host-gpus: what the host itself counts) the GPU stack as the
training meets it: the driver, the GPUs this runtime and torch see, and an NCCL all-reduce over
them, one spawned process a GPU (cluster/gpu_stack.py judges the figures).
`cuda`: the same GPU stack of the node it runs on, judged, within CUDA_VISIBLE_DEVICES:
`areal-kit train` runs it (hardware.check_cuda) on a cuda device before it builds any actor.
doctor's checks that run the training's own parts on the cluster (its network, --rl-step) are
rl/preflight.py, which doctor runs the same way.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import resource
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from areal_kit import hardware
from areal_kit.cluster import gpu_stack
from areal_kit.durable import replace_lines
from areal_kit.errors import ExitCode

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

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
    out = subprocess.run(hardware.GPU_QUERY, capture_output=True, text=True, timeout=60, check=False).stdout
    return gpu_stack.parse_gpu_query(out)


# -- the GPU stack ------------------------------------------------------------------------------
ALL_REDUCE_ITERS = 5
ALL_REDUCE_TIMEOUT_S = 180.0


def gpu_stack_facts(gpus: list[dict], host_gpus: int, required: bool = False) -> dict:
    """The GPU stack as the training meets it here; {"skipped": why} on a host without GPUs, unless
    required (the device is cuda: no GPU found is then a finding)."""
    why = gpu_stack.skipped(len(gpus), host_gpus)
    if why and not required:
        return {"skipped": why}
    facts = {"skipped": "", "host_gpus": host_gpus or len(gpus), "runtime_gpus": len(gpus),
             "driver": gpus[0]["driver"] if gpus else "", "cuda": torch.version.cuda, "torch": torch.__version__,
             **_torch_cuda()}
    n = facts["torch_gpus"]
    facts["all_reduce"] = all_reduce(n, gpu_stack.ALL_REDUCE_MB << 20) if n else {"skipped": "torch sees no GPU"}
    return facts


def _torch_cuda() -> dict:
    try:
        torch.cuda.init()  # raises with the reason (an old driver, no device) where is_available() says False
        error = ""
    except Exception as e:  # noqa: BLE001 - the reason is what the finding reports
        error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    ok = torch.cuda.is_available()
    return {"torch_cuda_available": ok, "torch_gpus": torch.cuda.device_count() if ok else 0, "torch_error": error}


def all_reduce(n: int, nbytes: int, device: str = "cuda", timeout_s: float = ALL_REDUCE_TIMEOUT_S) -> dict:
    """An all-reduce of nbytes over n processes on this host, one a GPU (NCCL), or gloo on CPU
    (device="cpu", for tests); gpu_stack.all_reduce_result says how it went."""
    ctx = multiprocessing.get_context("spawn")  # a fork would inherit this process's CUDA state
    results = ctx.Queue()
    port = hardware.free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, n, port, nbytes, device, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    got: list[dict] = []
    deadline, lost = time.monotonic() + timeout_s, f"no result within {timeout_s:g}s"
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = [f"rank {r} exited {p.exitcode}" for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # the others wait in the collective for it until their timeout
                    lost = ", ".join(dead)
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return gpu_stack.all_reduce_result(n, nbytes, got, lost)


def _all_reduce_rank(rank: int, n: int, port: int, nbytes: int, device: str, results: Queue[dict]) -> None:
    """One rank of the all-reduce, in its own process: a warm-up whose sum is checked, then
    ALL_REDUCE_ITERS timed; reports {rank, seconds, sum_ok, error}."""
    try:
        dev = torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(rank)
            dev = torch.device("cuda", rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=n, timeout=timedelta(seconds=ALL_REDUCE_TIMEOUT_S / 2))
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        dist.all_reduce(buf)  # NCCL builds its rings and channels on the first call
        sum_ok = bool((buf == n).all())
        hardware.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(ALL_REDUCE_ITERS):
            dist.all_reduce(buf)
        hardware.synchronize(dev)
        results.put({"rank": rank, "seconds": (time.perf_counter() - t0) / ALL_REDUCE_ITERS, "sum_ok": sum_ok,
                     "error": ""})
    except Exception as e:  # noqa: BLE001 - the error is what the finding reports
        results.put({"rank": rank, "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def visible(gpus: list[dict], cuda_visible: str | None) -> list[dict]:
    """nvidia-smi's GPUs narrowed to CUDA_VISIBLE_DEVICES (indices, or UUIDs counted): what torch
    may see in a process the user started on some of a node's GPUs on purpose."""
    if cuda_visible is None:
        return gpus
    entries = [e.strip() for e in cuda_visible.split(",") if e.strip()]
    if all(e.isdigit() for e in entries):
        return [gpus[int(e)] for e in entries if int(e) < len(gpus)]
    return gpus[:len(entries)]


def cuda() -> dict:
    """`areal-kit train`'s check before it builds any actor, on a cuda device: the GPU stack of
    this node judged as doctor judges a host's (driver, the GPUs torch sees, an NCCL all-reduce over
    them), within the GPUs CUDA_VISIBLE_DEVICES leaves it. {findings: [lines], summary, gpu_stack}."""
    facts = gpu_stack_facts(visible(_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES")), 0, required=True)
    found = gpu_stack.findings(socket.gethostname(), facts, "host")
    return {"findings": [f.line() for f in found], "summary": gpu_stack.summary(facts), "gpu_stack": facts}


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


def host(storage: str, ray_tmp: str, write_token: str | None, read_token: bool, host_gpus: int = 0) -> dict:
    token_path = os.path.join(storage, TOKEN_FILE)
    shm = os.statvfs("/dev/shm")
    facts: dict[str, Any] = {"shm_gb": round(shm.f_blocks * shm.f_frsize / 1e9, 3),
             # the hard limit: Ray's processes raise their soft limit to it, none can go past it
             "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
             "storage_free_gb": round(_free_gb(storage), 2) if os.path.isdir(storage) else None,
             "ray_tmp_free_gb": round(_free_gb(ray_tmp), 2),
             "versions": {p: _version(p) for p in ("ray", "torch", "vllm", "deepspeed", "areal-kit")},
             "cuda": None, "gpus": _gpus(), "storage_io": "", "token": None}
    facts["cuda"] = torch.version.cuda
    facts["gpu_stack"] = gpu_stack_facts(facts["gpus"], host_gpus)
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m areal_kit.cluster.probe")
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("host")
    h.add_argument("--storage", required=True)
    h.add_argument("--ray-tmp", default="/tmp/ray")
    h.add_argument("--write-token")
    h.add_argument("--read-token", action="store_true")
    h.add_argument("--host-gpus", type=int, default=0, help="GPUs nvidia-smi -L counts on the host itself")
    sub.add_parser("cuda", help="this node's GPU stack, judged (areal-kit train runs it on a cuda device)")
    a = ap.parse_args(argv)
    res = cuda() if a.what == "cuda" else host(a.storage, a.ray_tmp, a.write_token, a.read_token, a.host_gpus)
    print("PROBE " + json.dumps(res), flush=True)
    sys.exit(ExitCode.OK)


if __name__ == "__main__":
    main()

"""What `areal-kit doctor` measures of each host inside the runtime the training uses (the Ray
container of each host, or the host's Python for the host runtime). It prints one line,
`PROBE <json>`.

    python -m areal_kit.cluster.probe host --storage /storage --ray-tmp /tmp/ray [--write-token T | --read-token]

`host`: this host's limits and versions, its accelerators, and whether the shared storage holds the
head's token and survives the write, fsync, rename sequence the recover checkpoints rely on.
doctor's checks that run the training's own parts on the cluster (its network, --rl-step) are
rl/preflight.py, which doctor runs the same way.
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
from importlib import metadata

import torch

from areal_kit.durable import replace_lines
from areal_kit.errors import ExitCode

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m areal_kit.cluster.probe")
    sub = ap.add_subparsers(dest="what", required=True)
    h = sub.add_parser("host")
    h.add_argument("--storage", required=True)
    h.add_argument("--ray-tmp", default="/tmp/ray")
    h.add_argument("--write-token")
    h.add_argument("--read-token", action="store_true")
    a = ap.parse_args(argv)
    res = host(a.storage, a.ray_tmp, a.write_token, a.read_token)
    print("PROBE " + json.dumps(res), flush=True)
    sys.exit(ExitCode.OK)


if __name__ == "__main__":
    main()

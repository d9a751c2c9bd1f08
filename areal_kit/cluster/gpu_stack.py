"""The GPU stack inside a host's runtime, judged. doctor's host probe (cluster/probe.py) measures,
where the training's workers run, the NVIDIA driver, the GPUs the runtime and torch see and an
NCCL all-reduce over the node's GPUs (one process a GPU); the functions here read nvidia-smi's
output and turn those figures into findings, each with its fix, and into doctor's ok line. Pure
functions (no torch, no GPU): tests feed them real-looking nvidia-smi outputs and torch results.

    facts = probe.gpu_stack(gpus, host_gpus=8)             # on the host, inside the runtime
    gpu_stack.findings("node1", facts, runtime="docker")   # on the machine running doctor
    gpu_stack.summary(facts)

On a host without GPUs (no nvidia-smi in the runtime and none counted on the host) the checks are
skipped and the facts say why: a CPU cluster's doctor reports what it did before.
"""

from __future__ import annotations

from areal_kit import stack
from areal_kit.findings import Finding

# What the all-reduce sends: a few MB, so the check stays within setup's fast ones; it shows that
# NCCL runs over every GPU pair, not the links' peak.
ALL_REDUCE_MB = 32
NO_GPU = "no GPU on this host (no nvidia-smi in the runtime, none counted on the host)"


def parse_gpu_query(text: str) -> list[dict]:
    """nvidia-smi's hardware.GPU_QUERY output -> [{name, memory_gb, driver}], a GPU a line (other lines,
    such as an error nvidia-smi printed instead, are left out)."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            continue
        name, mib, driver = fields
        try:
            gpus.append({"name": name, "memory_gb": round(float(mib) / 1024, 1), "driver": driver})
        except ValueError:
            continue
    return gpus


def skipped(runtime_gpus: int, host_gpus: int) -> str:
    """Why this host's GPU checks do not run, "" when they do."""
    return "" if runtime_gpus or host_gpus else NO_GPU


def driver_major(version: str) -> int | None:
    """580 of "580.65.06"; None when nvidia-smi gave none."""
    head = str(version or "").split(".")[0].strip()
    return int(head) if head.isdigit() else None


def busbw_gbps(n: int, nbytes: int, seconds: float) -> float | None:
    """An all-reduce's bus bandwidth in GB/s, as nccl-tests report it: 2 (n-1)/n x bytes / time
    (the share of the buffer each GPU sends and receives in a ring); None for one GPU, where
    nothing crosses a bus."""
    if n < 2 or seconds <= 0:
        return None
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


def all_reduce_result(n: int, nbytes: int, ranks: list[dict], lost: str = "") -> dict:
    """The all-reduce's outcome from what its ranks reported, each {rank, seconds, sum_ok, error}:
    its time is the slowest rank's; lost says why ranks that did not report are missing."""
    errors = [f"rank {r['rank']}: {r['error']}" for r in sorted(ranks, key=lambda r: r["rank"]) if r.get("error")]
    if not errors and len(ranks) < n:
        errors = [f"{n - len(ranks)} of {n} ranks did not finish ({lost or 'no reason given'})"]
    if not errors and not all(r["sum_ok"] for r in ranks):
        errors = ["the reduced values are wrong (expected the sum over the GPUs)"]
    out = {"gpus": n, "mb": nbytes / (1 << 20), "error": errors[0] if errors else ""}
    if not errors:
        seconds = max(r["seconds"] for r in ranks)
        out.update(seconds=seconds, busbw_gbps=busbw_gbps(n, nbytes, seconds))
    return out


def driver_fix(need: int) -> str:
    return (f"install NVIDIA driver {need} or newer on the host (Ubuntu: apt-get install nvidia-driver-{need}, or "
            "NVIDIA's CUDA repository), then reboot")


def driver_needed(driver: str, cuda: str) -> int | None:
    """The driver (major version) CUDA `cuda` needs where `driver` ("550.54.15") is older; None
    when it is new enough, or either is unknown (nvidia-smi gave none, a CUDA stack.py has no row for)."""
    need, have = stack.min_driver(cuda), driver_major(driver)
    return need if need is not None and have is not None and have < need else None


def _runtime_fix(runtime: str) -> str:
    if runtime == "docker":
        return ("areal-kit setup again: the container starts with --gpus all, which needs nvidia-container-toolkit "
                "(nvidia-ctk runtime configure --runtime=docker, then restart docker); NVIDIA_VISIBLE_DEVICES must "
                "not narrow it")
    return "unset CUDA_VISIBLE_DEVICES in the environment the runtime starts with"


def _driver_findings(host: str, g: dict) -> list[Finding]:
    cuda = g.get("cuda") or stack.versions("cuda")["cuda"]
    need = driver_needed(g.get("driver", ""), cuda)
    if need is not None:
        return [Finding(host, "gpu-driver", f"NVIDIA driver {g['driver']}",
                        f">= {need} for CUDA {cuda} (torch {g.get('torch') or stack.TORCH})", driver_fix(need))]
    if not (g.get("driver") or g.get("runtime_gpus") or g.get("host_gpus")):
        # Checked where a GPU is required (`areal-kit train` on a cuda device), not counted on any side.
        need = stack.min_driver(cuda) or 0
        return [Finding(host, "gpu-driver", "no NVIDIA driver answers here (nvidia-smi is missing or lists no GPU)",
                        f"a driver >= {need} for CUDA {cuda} and its GPUs", driver_fix(need))]
    return []


def _visible_findings(host: str, g: dict, runtime: str) -> list[Finding]:
    """The runtime sees the host's GPUs, and torch sees the runtime's."""
    found = []
    host_n, seen = g.get("host_gpus", 0), g.get("runtime_gpus", 0)
    if seen < host_n:
        found.append(Finding(host, "gpu-runtime", f"the {runtime} runtime sees {seen} of the host's {host_n} GPUs",
                             f"all {host_n}", _runtime_fix(runtime)))
    want = max(seen, host_n)
    if not g.get("torch_cuda_available"):
        why = g.get("torch_error") or "no reason given"
        need = driver_needed(g.get("driver", ""), g.get("cuda") or "")
        if not g.get("cuda") and runtime == "docker":
            fix = "use the CUDA image (the runtime's torch is a CPU build): areal-kit setup on the GPU hosts builds it"
        elif not g.get("cuda"):
            fix = ("this Python's torch is a CPU build: install the CUDA one (pip install 'areal-kit[gpu]'), or run "
                   "in areal-kit's CUDA image")
        elif need:
            fix = driver_fix(need)
        else:
            fix = _runtime_fix(runtime) + "; nvidia-smi on the host must list the GPUs"
        found.append(Finding(host, "torch-cuda", f"torch.cuda.is_available() is False ({why})",
                             f"True, with {want} GPUs" if want else "True", fix))
    elif g.get("torch_gpus", 0) < want:
        found.append(Finding(host, "torch-cuda", f"torch sees {g.get('torch_gpus', 0)} of the {want} GPUs",
                             f"all {want}", "unset CUDA_VISIBLE_DEVICES in the runtime's environment"))
    return found


def findings(host: str, g: dict, runtime: str) -> list[Finding]:
    """What is wrong with a host's GPU stack (g: the probe's gpu_stack facts); [] when it is
    sound, or when the checks were skipped."""
    if not g or g.get("skipped"):
        return []
    found = _driver_findings(host, g) + _visible_findings(host, g, runtime)
    ar = g.get("all_reduce") or {}
    if ar.get("error"):
        found.append(Finding(host, "nccl", f"NCCL all-reduce over {ar['gpus']} GPUs failed: {ar['error']}",
                             "it to finish with the sum over the GPUs",
                             "run it again with NCCL_DEBUG=INFO in the runtime's environment; check /dev/shm "
                             "(--shm-size), GPU peer-to-peer (nvidia-smi topo -m; NCCL_P2P_DISABLE=1 where the "
                             "IOMMU or PCIe ACS blocks it) and that no other job holds the GPUs"))
    return found


def summary(g: dict) -> str:
    """doctor's ok words for a host's GPU stack."""
    if not g or g.get("skipped"):
        return f"GPU checks skipped: {(g or {}).get('skipped') or NO_GPU}"
    words = [f"driver {g.get('driver') or '?'} (CUDA {g.get('cuda') or '?'})",
             f"torch sees {g.get('torch_gpus', 0)} of {g.get('host_gpus', 0)} GPUs"]
    ar = g.get("all_reduce") or {}
    if ar.get("busbw_gbps") is not None:
        words.append(f"NCCL all-reduce over {ar['gpus']} GPUs {ar['busbw_gbps']:.3g} GB/s bus bandwidth")
    elif "seconds" in ar:
        words.append(f"NCCL all-reduce on {ar['gpus']} GPU ran")
    return ", ".join(words)

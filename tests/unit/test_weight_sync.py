"""The sync group's bucketed, pipelined broadcast between two real processes over gloo."""

from __future__ import annotations

import io
import multiprocessing as mp
import socket

import pytest
import torch

from areal_kit.rl.weight_sync import transport

BUCKET = 16384  # the first bucket is 2 KiB: "a" and "b" together


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # "big" goes in a broadcast of its own, the small ones in runs (transport.runs).
    return {"a": torch.randn(300, generator=g), "b": torch.randn(20, 10, generator=g),
            "big": torch.randn(transport.SMALL_BYTES // 4 + 1, generator=g),
            "c": torch.randint(0, 9, (7,), generator=g), "d": torch.randn(5, 4, 3, generator=g),
            "e": torch.randn(1000, generator=g)}


def _receiver(port: int, plan, reps: int, out) -> None:
    _, group = transport.init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    for _ in range(reps):
        # Keep every yielded view: each bucket has its own buffer, so none is overwritten later.
        buckets = list(transport.receive(group, plan, "cpu"))
    out.put(_bytes(([[name for name, _ in b] for b in buckets], {k: v.clone() for b in buckets for k, v in b})))


def _placing_receiver(port: int, plan, out) -> None:
    """Receives with places for a big tensor (broadcast alone), a small one (which travels in a run
    with others) and one of the wrong shape: only the first can land in place."""
    _, group = transport.init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    into = {"big": torch.zeros(transport.SMALL_BYTES // 4 + 1), "a": torch.zeros(300), "e": torch.zeros(10, 100)}
    got = {k: v for b in transport.receive(group, plan, "cpu", into=into) for k, v in b}
    out.put(_bytes(({k: got[k].data_ptr() == into[k].data_ptr() for k in into}, {k: v.clone() for k, v in into.items()},
                    {k: v.clone() for k, v in got.items()})))


def _bytes(obj) -> bytes:
    """obj serialized by value: tensors put on a Queue as they are travel as handles to the
    child's shared memory, which fail to open once the child has exited."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _result(out):
    return torch.load(io.BytesIO(out.get(timeout=60)), weights_only=False)


def _serve(target, plan, *args):
    """A receiving child process and this process as rank 0."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(port, plan, *args, out), daemon=True)
    child.start()
    _, group = transport.init_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    return child, group, out


@pytest.mark.slow
def test_buckets_arrive_intact_in_order(tmp_path):
    tensors = _tensors()
    # 16 KiB buckets (the first 2 KiB): float tensors split over several buckets, the int tensor
    # in its own (one dtype each), two small tensors sharing one broadcast
    plan = transport.make_plan(list(tensors.items()), bucket_bytes=BUCKET)
    assert any(b - a > 1 for bucket in plan for a, b in transport.runs(bucket))
    assert len(plan) >= 4
    assert all(len({m.dtype for m in b}) == 1 for b in plan)
    child, group, out = _serve(_receiver, plan, 2)
    sent = [transport.send(group, plan, tensors, "cpu") for _ in range(2)]
    names, got = _result(out)
    child.join(30)
    assert child.exitcode == 0
    assert sent[0] == sent[1] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert names == [[m.name for m in b] for b in plan]  # one list per bucket, in order
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


@pytest.mark.slow
def test_tensors_with_a_place_arrive_straight_in_it():
    tensors = _tensors()
    plan = transport.make_plan(list(tensors.items()), bucket_bytes=BUCKET)
    child, group, out = _serve(_placing_receiver, plan)
    transport.send(group, plan, tensors, "cpu")
    in_place, into, got = _result(out)
    child.join(30)
    assert child.exitcode == 0
    assert in_place == {"big": True, "a": False, "e": False}
    assert torch.equal(into["big"], tensors["big"])
    assert not into["a"].any()
    assert not into["e"].any()  # no place for them: untouched
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k


def test_outbox_holds_the_optimizer_step_until_live_weights_are_sent():
    """Real threads: the trainer's main thread (wait_sent) and its send thread (send)."""
    import threading
    import time

    box = transport.Outbox()
    assert box.wait_sent() >= 0.0  # nothing staged: no wait
    box.stage({"w": torch.ones(2)}, live=True)
    order = []
    release = threading.Event()

    def slow_send(state):
        release.wait(10)
        order.append("sent")
        return sum(t.numel() * 4 for t in state.values())

    sender = threading.Thread(target=lambda: order.append(box.send(slow_send)))
    sender.start()
    waiter = threading.Thread(target=lambda: (box.wait_sent(), order.append("step")))
    waiter.start()
    time.sleep(0.3)
    assert order == []  # the step is held while the send is pending
    release.set()
    sender.join(10)
    waiter.join(10)
    assert order[0] == "sent"
    assert "step" in order
    assert next(x for x in order if isinstance(x, dict))["sync_bytes"] == 8


def test_outbox_copies_do_not_hold_the_step_and_a_failed_send_surfaces():
    import pytest

    box = transport.Outbox()
    box.stage({"w": torch.ones(2)}, live=False)  # ZeRO-3's gathered copy
    assert box.wait_sent() < 1.0

    def broken(state):
        raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError):
        box.send(broken)
    with pytest.raises(RuntimeError, match="the last weight send failed: peer gone"):
        box.wait_sent()
    with pytest.raises(RuntimeError, match="no weights staged"):
        box.send(broken)


def test_first_bucket_is_an_eighth_so_engines_start_loading_early():
    plan = transport.make_plan([(f"t{i}", torch.empty(256)) for i in range(20)], bucket_bytes=8192)  # 1 KiB each
    assert [len(b) for b in plan] == [1, 8, 8, 3]
    assert [m.name for b in plan for m in b] == [f"t{i}" for i in range(20)]


def test_runs_group_consecutive_small_tensors_only():
    big = transport.SMALL_BYTES // 4  # float32 elements of one "big" tensor
    plan = transport.make_plan([("n1", torch.empty(8)), ("n2", torch.empty(8)), ("w", torch.empty(big)),
                                  ("n3", torch.empty(8)), ("w2", torch.empty(big)), ("n4", torch.empty(4)),
                                  ("n5", torch.empty(4))], bucket_bytes=1 << 30)
    assert transport.runs(plan[0]) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 7)]
    # Shared-memory tensors travel in no broadcast and break a run of small ones.
    assert transport.runs(plan[0], skip={1, 2}) == [(0, 1), (3, 4), (4, 5), (5, 7)]


def _shared_receiver(port: int, plan, names, out) -> None:
    """Puts `names` in shared memory (as an engine's parameters), tells rank 0 where, then takes
    two syncs: the shared tensors are written by rank 0, the rest arrive over gloo."""
    _, group = transport.init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
    metas = {transport.as_meta(m).name: transport.as_meta(m) for b in plan for m in b}
    sizes = {n: metas[n].nbytes for n in names}
    starts = dict(zip(names, [sum(list(sizes.values())[:i]) for i in range(len(names))]))
    buf, region = transport.new_region(sum(sizes.values()))
    into = {n: transport.region_view(buf, starts[n], metas[n]) for n in names}
    out.put({**region, "places": starts})
    for _ in range(2):
        got = {k: v for b in transport.receive(group, plan, "cpu", into=into, shared=set(names)) for k, v in b}
        out.put(_bytes(({k: v.clone() for k, v in got.items()},
                        {n: got[n].data_ptr() == into[n].data_ptr() for n in names})))


@pytest.mark.slow
def test_shared_tensors_are_written_straight_into_the_receivers_memory():
    """Rank 0 maps the receiver's region (a memfd, through /proc) and writes the shared tensors
    there; a doorbell per bucket tells the receiver they are in. Two syncs with different values,
    so a second write that did not land would show."""
    tensors = _tensors()
    plan = transport.make_plan(list(tensors.items()), bucket_bytes=BUCKET)
    names = ["big", "a", "d"]  # one alone, two that would otherwise travel in runs
    child, group, out = _serve(_shared_receiver, plan, names)
    region = out.get(timeout=60)
    buf = transport.open_region(region)
    metas = {transport.as_meta(m).name: m for b in plan for m in b}
    shared = {n: [transport.region_view(buf, region["places"][n], metas[n])] for n in names}
    second = {k: v * 2 for k, v in tensors.items()}
    syncs = []
    for t in (tensors, second):
        transport.send(group, plan, t, "cpu", shared)
        syncs.append(_result(out))  # as the controller does: no send while a receiver still loads
    child.join(30)
    assert child.exitcode == 0
    for (got, in_place), sent in zip(syncs, (tensors, second)):
        assert in_place == {n: True for n in names}
        for k, v in sent.items():
            assert torch.equal(got[k], v), k


def test_a_region_opens_only_as_the_memory_it_names():
    import pytest

    buf, region = transport.new_region(64)
    other = transport.open_region(region)
    other[:8] = 7  # the same bytes, seen through a second mapping
    assert buf[:8].tolist() == [7] * 8
    with pytest.raises(RuntimeError, match="another process"):
        transport.open_region({**region, "tag": "areal-kit-weights-someone-else"})
    with pytest.raises(RuntimeError, match="not visible here"):
        transport.open_region({**region, "fd": 10**6})  # as an engine in another container

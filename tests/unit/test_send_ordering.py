"""When the trainer's weight send may run beside its own collectives, with real threads.

The send runs on the trainer actor's second thread while the main thread trains. On GPUs
(`Platform.exclusive_weight_send`) the two must never overlap: NCCL documents concurrent
collectives of two communicators on one GPU as a deadlock risk, and OpenRLHF and verl send between
steps. On CPU (gloo) they overlap, and only the optimizer step waits for live weights. These tests
force each platform's rule on this CPU: `hardware.detect("cuda")` gives the GPU rule without a GPU.

    .venv/bin/python -m pytest tests/unit/test_send_ordering.py
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from areal_kit import hardware
from areal_kit.config.loader import load_config
from areal_kit.rl.sample import TrainerRow
from areal_kit.rl.trainer.worker import TrainerWorker
from areal_kit.rl.weight_sync import transport

HELD = 0.3  # seconds a blocked thread is given to (wrongly) get through


def _slow_send(release: threading.Event, order: list):
    def send(state):
        release.wait(10)
        order.append("sent")
        return 0

    return send


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_collectives_wait_for_a_staged_send_on_gpus_only(device):
    """ZeRO-3 stages a copy (live=False): the optimizer step never waits for it, and on CPU no
    collective does either; on GPUs the next collective waits until it is sent."""
    box = transport.Outbox(exclusive=hardware.detect(device).exclusive_weight_send)
    box.stage({"w": torch.ones(2)}, live=False)
    order: list = []
    release = threading.Event()
    sender = threading.Thread(target=box.send, args=(_slow_send(release, order),))
    sender.start()
    main = threading.Thread(target=lambda: (box.before_collectives(), order.append("collective")))
    main.start()
    time.sleep(HELD)
    release.set()
    sender.join(10)
    main.join(10)
    assert order == (["sent", "collective"] if device == "cuda" else ["collective", "sent"])
    assert box.wait_sent() < 1.0


def test_gpu_rule_surfaces_a_failed_send_at_the_next_collective():
    box = transport.Outbox(exclusive=True)
    box.stage({"w": torch.ones(2)}, live=False)

    def broken(state):
        raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError):
        box.send(broken)
    with pytest.raises(RuntimeError, match="the last weight send failed: peer gone"):
        box.before_collectives()
    assert box.before_collectives() == pytest.approx(0.0, abs=0.5)  # reported once, nothing staged


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def trainer(tmp_path, monkeypatch):
    """A TrainerWorker of one rank without DeepSpeed: its sync group, outbox and allreduce are real."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "unset")  # the constructor sets them; restored afterwards
    worker = TrainerWorker(0, 1, load_config("tiny", [f"fileroot={tmp_path}"]), str(tmp_path), {})
    worker.device = torch.device("cpu")
    return worker


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_trainer_step_first_collective_waits_for_the_send_on_gpus(trainer, device):
    """The trainer's real send (send_weights over a gloo group to an engine that is slow to take
    it) against the real first collective of a step (allreduce, via micro_batches)."""
    trainer.outbox.exclusive = hardware.detect(device).exclusive_weight_send
    state = {"w": torch.randn(4 << 20)}  # 16 MB: more than the sockets buffer, so the send waits for the engine
    plan = transport.make_plan(list(state.items()))
    port = _port()
    engine_ready, go, order = threading.Event(), threading.Event(), []

    def engine():
        _, group = transport.init_group("127.0.0.1", port, 1, 2, "gloo", timeout_s=30, local_ip="127.0.0.1")
        engine_ready.set()
        go.wait(10)
        got = [t for bucket in transport.receive(group, plan, "cpu") for _, t in bucket]
        order.append(("received", torch.equal(got[0], state["w"])))

    receiver = threading.Thread(target=engine)
    receiver.start()
    trainer.init_sync("127.0.0.1", port, 2, "gloo", plan)
    assert engine_ready.wait(10)
    trainer.outbox.stage(state, live=False)
    sender = threading.Thread(target=lambda: order.append(("sent", trainer.send_weights()["sync_bytes"])))
    sender.start()
    time.sleep(0.1)  # the send is under way, blocked on the engine
    step = threading.Thread(target=lambda: order.append(("collective", trainer.micro_batches(
        [TrainerRow([1, 2], [3])], 16))))
    step.start()
    time.sleep(HELD)
    go.set()
    for t in (receiver, sender, step):
        t.join(20)
    kinds = [kind for kind, _ in order]
    if device == "cuda":
        assert kinds.index("sent") < kinds.index("collective")
    else:
        assert kinds[0] == "collective"  # trained on while the engine was still to receive
    assert dict(order)["received"] is True
    assert dict(order)["sent"] == state["w"].numel() * 4
    assert dict(order)["collective"] == [[0]]

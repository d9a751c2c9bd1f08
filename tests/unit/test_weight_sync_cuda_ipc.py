"""CUDA IPC weight sync for shared GPUs (areal_kit/rl/weight_sync/cuda_ipc.py) on CPU, up to the
handle exchange: the chunks of the reusable buffer, the tensors copied in and read back as views
(on a CPU buffer: the same bytes a CUDA buffer holds), the rebuild arguments' device index
localized where torch 2.13's rebuild_cuda_tensor takes it, and the handles merged by GPU, with the
reason a layout could not use them. Mapping a real handle needs a GPU: tests/gpu/test_cuda_ipc_gpu.py.

    .venv/bin/python -m pytest tests/unit/test_weight_sync_cuda_ipc.py -q
"""

import inspect
from itertools import pairwise

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from areal_kit.rl.weight_sync import cuda_ipc

pytestmark = pytest.mark.unit


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(37, 16, generator=g).to(torch.bfloat16),
            "layers.0.qkv.bias": torch.randn(7, generator=g),  # fp32, an odd size
            "layers.0.o.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "step": torch.tensor([3], dtype=torch.int64)}


def test_every_chunk_fits_the_buffer_at_aligned_offsets_in_order():
    model = _model()
    chunks = list(cuda_ipc.plan(model.items(), capacity=1536))
    assert [s.name for c in chunks for s in c] == list(model)
    assert len(chunks) > 1
    for c in chunks:
        assert all(s.offset % cuda_ipc.ALIGN == 0 for s in c)
        assert c[-1].offset + c[-1].nbytes <= 1536
        assert all(a.offset + a.nbytes <= b.offset for a, b in pairwise(c))  # no overlap
    with pytest.raises(ValueError, match=r"embed.weight is 1184 bytes, more than the IPC buffer's 1024"):
        list(cuda_ipc.plan(model.items(), capacity=1024))


def test_one_reused_buffer_carries_every_chunk_bit_for_bit():
    model = _model()
    buffer = torch.zeros(1536, dtype=torch.uint8)
    got = {}
    for chunk in cuda_ipc.plan(model.items(), capacity=buffer.numel()):
        cuda_ipc.fill(buffer, model, chunk)
        for name, view in cuda_ipc.views(buffer, chunk):
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
            got[name] = view.clone()  # the consumer loads it before the next fill
    assert got.keys() == model.keys()
    for name, t in model.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_the_consumer_puts_its_own_index_of_the_gpu_where_torch_reads_the_device():
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[cuda_ipc.DEVICE_ARG] == "storage_device"
    args = tuple(range(15))
    assert cuda_ipc.localize(args, 0)[cuda_ipc.DEVICE_ARG] == 0
    assert cuda_ipc.localize(args, 0)[:6] == list(range(6)) and args[cuda_ipc.DEVICE_ARG] == 6
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory, not cpu memory"):
        cuda_ipc.export(torch.zeros(4, dtype=torch.uint8))


def test_handles_merge_by_gpu_and_every_engine_gpu_needs_a_trainer_rank():
    a, b = {"GPU-a": ("args a",)}, {"GPU-b": ("args b",)}
    assert cuda_ipc.merge([a, b]) == {"GPU-a": ("args a",), "GPU-b": ("args b",)}
    with pytest.raises(ValueError, match="two trainer ranks export a buffer on GPU GPU-a"):
        cuda_ipc.merge([a, a])
    assert cuda_ipc.unreachable(["GPU-a", "GPU-b"], ["GPU-b", "GPU-a", "GPU-c"]) == ""
    assert cuda_ipc.unreachable(["GPU-a", "GPU-d"], ["GPU-a"]) == \
        "1 engine worker(s) on GPUs without a trainer rank, e.g. GPU-d"
    with pytest.raises(ValueError, match=r"no IPC buffer for GPU GPU-d; buffers came for \['GPU-a'\]"):
        cuda_ipc.Importer().open({"GPU-a": tuple(range(15))}, "GPU-d", 0)


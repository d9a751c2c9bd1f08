"""CUDA IPC weight sync for shared GPUs (areal_kit/rl/weight_sync/ipc.py) on CPU, up to the
handle exchange: the chunks of the reusable buffer, the tensors copied in and read back as views
(on a CPU buffer: the same bytes a CUDA buffer holds), the rebuild arguments' device index
localized where torch 2.13's rebuild_cuda_tensor takes it, and the handles merged by GPU, with the
reason a layout could not use them. Mapping a real handle needs a GPU: tests/gpu/test_cuda_ipc_gpu.py.

    .venv/bin/python -m pytest tests/unit/test_weight_sync_ipc.py -q
"""

import inspect
import json
import subprocess
import sys
from itertools import pairwise

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from areal_kit.rl.weight_sync import ipc

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
    chunks = list(ipc.plan(model.items(), capacity=1536))
    assert [s.name for c in chunks for s in c] == list(model)
    assert len(chunks) > 1
    for c in chunks:
        assert all(s.offset % ipc.ALIGN == 0 for s in c)
        assert c[-1].offset + c[-1].nbytes <= 1536
        assert all(a.offset + a.nbytes <= b.offset for a, b in pairwise(c))  # no overlap
    with pytest.raises(ValueError, match=r"embed.weight is 1184 bytes, more than the IPC buffer's 1024"):
        list(ipc.plan(model.items(), capacity=1024))


def test_one_reused_buffer_carries_every_chunk_bit_for_bit():
    model = _model()
    buffer = torch.zeros(1536, dtype=torch.uint8)
    got = {}
    for chunk in ipc.plan(model.items(), capacity=buffer.numel()):
        ipc.fill(buffer, model, chunk)
        for name, view in ipc.views(buffer, chunk):
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, no copy
            got[name] = view.clone()  # the consumer loads it before the next fill
    assert got.keys() == model.keys()
    for name, t in model.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _cuda_rebuild_args(n: int) -> tuple:
    """What torch 2.13's reduce_tensor returns for a CUDA uint8 buffer of n bytes (its CUDA branch:
    the classes, the sizes, the dtype, and the bytes of the IPC, ref-counter and event handles);
    only a GPU can make real ones."""
    t = torch.empty(n, dtype=torch.uint8)
    return (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 3, b"\x01" * 64, n, 512,
            False, b"\x02" * 64, 8, b"\x03" * 64, True)


def test_a_cuda_handle_crosses_vllms_engine_core_encoder_and_rebuilds_as_torch_takes_it(monkeypatch):
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    raw = _cuda_rebuild_args(4096)
    with pytest.raises(TypeError, match="is not serializable"):  # torch's own arguments do not cross
        MsgpackEncoder().encode(({"GPU-a": raw}, [], True, False))
    chunk = [tuple(vars(s).values()) for s in next(ipc.plan(_model().items(), capacity=4096))]
    call = ({"GPU-a": {"cuda": ipc.plain(raw)}}, chunk, True, False)  # receive_ipc's arguments
    handles, got_chunk, first, last = MsgpackDecoder().decode(MsgpackEncoder().encode(call))
    args = ipc.rebuild_args(handles["GPU-a"]["cuda"], 0)
    assert args[ipc.DEVICE_ARG] == 0  # the consumer's index of the GPU
    assert args[:ipc.DEVICE_ARG] == list(raw[:ipc.DEVICE_ARG]) and args[ipc.DEVICE_ARG + 1:] == list(raw[ipc.DEVICE_ARG + 1:])
    assert [type(a) for a in args[:6]] == [type(a) for a in raw[:6]]
    # Tuples come back as lists: the worker's views take a shape either way.
    assert [ipc.Slot(n, tuple(shape), *rest) for n, shape, *rest in got_chunk] == [ipc.Slot(*s) for s in chunk]
    assert (first, last) == (True, False)


def test_a_shared_memory_buffer_is_mapped_by_another_process_through_its_handle():
    buffer, handle = ipc.new_buffer(1024, torch.device("cpu"))
    buffer[:] = torch.arange(1024) % 251
    total = int(buffer.sum())
    code = ("import json, sys, torch; from areal_kit.rl.weight_sync import ipc; "
            "b = ipc.Importer().open(json.loads(sys.argv[1]), 'k', 0); print(int(b.sum())); b[:4] = 7")
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"k": handle})], capture_output=True, text=True,
                         check=True)
    assert int(out.stdout) == total  # the same bytes
    assert buffer[:4].tolist() == [7] * 4  # its writes are ours: one memory, not a copy
    ipc.free(handle)


def test_the_consumer_puts_its_own_index_of_the_gpu_where_torch_reads_the_device():
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert params[ipc.DEVICE_ARG] == "storage_device"
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory, not cpu memory"):
        ipc.export(torch.zeros(4, dtype=torch.uint8))


def test_handles_merge_by_device_and_every_engine_worker_needs_a_trainer_rank_beside_it():
    a, b = {"GPU-a": {"cuda": [1]}}, {"GPU-b": {"cuda": [2]}}
    assert ipc.merge([a, b]) == {"GPU-a": {"cuda": [1]}, "GPU-b": {"cuda": [2]}}
    with pytest.raises(ValueError, match="two trainer ranks export a buffer on GPU-a"):
        ipc.merge([a, a])
    assert ipc.unreachable(["GPU-a", "GPU-b"], ["GPU-b", "GPU-a", "GPU-c"]) == ""
    assert ipc.unreachable(["GPU-a", "GPU-d"], ["GPU-a"]) == \
        "1 engine worker(s) on devices without a trainer rank, e.g. GPU-d"
    with pytest.raises(ValueError, match=r"no IPC buffer for GPU-d; buffers came for \['GPU-a'\]"):
        ipc.Importer().open({"GPU-a": {"cuda": list(range(15))}}, "GPU-d", 0)


def test_cpu_workers_pair_with_the_trainer_ranks_their_engine_shares_slots_with(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(ipc.SHARED_RANKS_ENV, "2,3")  # engine 1 of tp 2 (rl/driver/groups.py)
    assert [ipc.worker_key(cpu, i) for i in (0, 1)] == [ipc.trainer_key(cpu, 2), ipc.trainer_key(cpu, 3)]
    assert ipc.trainer_key(cpu, 2) != ipc.trainer_key(cpu, 3)
    monkeypatch.delenv(ipc.SHARED_RANKS_ENV)
    assert ipc.worker_key(cpu, 0) == ""  # an engine of its own: no rank beside it
    assert "outside the shared layout" in ipc.unreachable([""], [ipc.trainer_key(cpu, 0)])

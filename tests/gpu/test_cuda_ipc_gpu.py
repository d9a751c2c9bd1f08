"""CUDA IPC weight chunks (areal_kit/rl/weight_sync/ipc.py) between two processes on one GPU,
as a trainer rank and the engine worker beside it exchange them: the parent fills one exported
buffer chunk by chunk; a spawned child maps it once (Importer) and reads every chunk's tensors,
which must equal the parent's bit for bit; then the same through the trainer's mixin
(IpcSender, rl/trainer/weight_send.py), whose buffer must be gone once the sync ends. Every message to the child
is encoded and decoded by vLLM's engine-core msgpack codec first, as a GPU engine's calls are.
tests/unit/test_weight_sync_ipc.py and test_weight_sync_colocated.py, and
tests/integration/test_weight_sync_ipc_ranks.py, run the same chunks on CPU through shared memory; the
acceptance suite's shared one-GPU cases (test_gpu_acceptance.py) run the whole sync in a real run.

    python -m pytest tests/gpu/test_cuda_ipc_gpu.py -v
"""

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

from areal_kit.rl.trainer.weight_send import IpcSender
from areal_kit.rl.weight_sync import ipc, mode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU (torch.cuda.device_count() is 0)")]


def _consumer(requests, replies) -> None:
    """The engine worker's side: map the buffer once, answer each chunk with its tensors' sums."""
    importer = ipc.Importer()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    from vllm.v1.serial_utils import MsgpackDecoder

    decoder = MsgpackDecoder()
    while (msg := requests.get()) is not None:
        handles, chunk = decoder.decode(msg)  # as the engine core receives receive_ipc's arguments
        chunk = [ipc.Slot(*s) for s in chunk]
        buffer = importer.open(handles, uuid, 0)
        replies.put({name: t.double().sum().item() for name, t in ipc.views(buffer, chunk)})
        torch.cuda.synchronize()  # read before the producer refills it
    importer.close()


def test_a_spawned_process_maps_the_buffer_and_reads_every_chunk():
    from acceptance import TABLE

    with TABLE.check("cuda_ipc", "weights chunk by chunk through one IPC buffer") as info:
        g = torch.Generator(device="cuda").manual_seed(0)
        model = {f"layers.{i}.w": torch.randn(256, 512, device="cuda", generator=g).to(torch.bfloat16)
                 for i in range(8)}
        buffer = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        handles = {str(torch.cuda.get_device_properties(0).uuid): ipc.export(buffer)}
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_consumer, args=(requests, replies))
        child.start()
        got = {}
        chunks = list(ipc.plan(model.items(), buffer.numel()))
        for chunk in chunks:
            ipc.fill(buffer, model, chunk)
            torch.cuda.synchronize()
            requests.put(_wire(handles, [dataclasses.astuple(s) for s in chunk]))
            got.update(replies.get(timeout=120))
        requests.put(None)
        child.join(timeout=120)
        assert child.exitcode == 0
        assert len(chunks) == 2 and got == {n: t.double().sum().item() for n, t in model.items()}
        info["detail"] = f"{len(chunks)} chunks of {buffer.numel() >> 20} MiB, {len(got)} tensors equal"


def _wire(handles, chunk) -> bytes:
    """receive_ipc's arguments as vLLM's engine-core client sends them (no insecure serialization)."""
    from vllm.v1.serial_utils import MsgpackEncoder

    return bytes(MsgpackEncoder().encode((handles, chunk))[0])


class Rank(IpcSender):
    """Trainer rank 1 on GPU 0 whose staged weights are `state` (a rank other than 0: each stages)."""

    device = torch.device("cuda", 0)
    rank = 1

    def __init__(self, state):
        self.state = state

    def _sync_state(self, every_rank: bool = False):
        return self.state if every_rank else {}


def test_the_trainer_mixin_sends_every_chunk_and_frees_its_buffer(monkeypatch):
    from acceptance import TABLE

    with TABLE.check("cuda_ipc", "the trainer's IPC buffer lives one sync") as info:
        monkeypatch.setattr(mode, "IPC_BUFFER_BYTES", 1 << 20)  # 4 of the 8 tensors a chunk
        g = torch.Generator(device="cuda").manual_seed(1)
        model = {f"layers.{i}.w": torch.randn(256, 512, device="cuda", generator=g).to(torch.bfloat16)
                 for i in range(8)}
        rank = Rank(model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = rank.ipc_start()
        assert start["chunks"] == 2 and list(start["handles"]) == [rank.ipc_key()]
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_consumer, args=(requests, replies))
        child.start()
        got = {}
        for i in range(start["chunks"]):
            requests.put(_wire(start["handles"], rank.ipc_fill(i)))
            got.update(replies.get(timeout=120))
        requests.put(None)
        child.join(timeout=120)
        during = torch.cuda.memory_allocated() - before
        left = rank.ipc_end()
        assert child.exitcode == 0 and got == {n: t.double().sum().item() for n, t in model.items()}
        assert during >= 1 << 20 and torch.cuda.memory_allocated() == before, (during, torch.cuda.memory_allocated())
        info["detail"] = f"{during >> 20} MiB during the sync, {left['reserved'] >> 20} MiB reserved after"

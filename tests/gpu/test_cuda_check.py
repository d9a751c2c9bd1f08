"""`areal-kit train`'s check that CUDA starts on the node, before it builds any actor
(hardware.check_cuda: doctor's GPU-stack probe of this node), on a real GPU: the driver, the GPUs
torch sees, an NCCL all-reduce over them; with CUDA_VISIBLE_DEVICES narrowing them on purpose.

    python -m pytest tests/gpu/test_cuda_check.py -v
"""

import pytest
import torch

from areal_kit import hardware

N_GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU node (torch.cuda.device_count() is 0)")]


def test_cuda_starts_here_with_every_gpu_and_an_all_reduce():
    summary = hardware.check_cuda()
    assert f"torch sees {N_GPUS} of {N_GPUS} GPUs" in summary, summary
    assert (f"NCCL all-reduce over {N_GPUS} GPUs" if N_GPUS > 1 else "NCCL all-reduce on 1 GPU ran") in summary, summary


def test_a_process_given_one_of_the_gpus_is_checked_on_that_one(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(N_GPUS - 1))
    summary = hardware.check_cuda()
    assert "torch sees 1 of 1 GPUs" in summary and "NCCL all-reduce on 1 GPU ran" in summary, summary

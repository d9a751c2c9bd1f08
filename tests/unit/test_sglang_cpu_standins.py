"""The SGLang CPU venv's stand-ins (areal_kit/rl/engine/sglang_cpu_standins.py), without SGLang:
the KV-slot copy does what SGLang's kernel of the same name does, and the import hook serves
`sgl_kernel` only where none is installed, failing loudly on a kernel it has no stand-in for."""

from __future__ import annotations

import sys

import pytest
import torch

from areal_kit.rl.engine import sglang_cpu_standins as standins

pytestmark = pytest.mark.unit


def test_slot_copy_writes_each_requests_run_into_its_row():
    table = torch.zeros(4, 8, dtype=torch.int32)
    rows, start, end = torch.tensor([2, 0]), torch.tensor([1, 3]), torch.tensor([4, 5])
    slots = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)  # request 0's three, then request 1's two
    standins.assign_req_to_token_pool_cpu(rows, table, start, end, slots, table.shape[1])
    assert table[2].tolist() == [0, 10, 11, 12, 0, 0, 0, 0]
    assert table[0].tolist() == [0, 0, 0, 20, 21, 0, 0, 0]
    assert table[[1, 3]].sum() == 0


def test_the_hook_serves_sgl_kernel_and_names_a_missing_kernel():
    finder = standins.StandinFinder()
    sys.meta_path.insert(0, finder)
    try:
        sys.modules.pop("sgl_kernel", None)
        import sgl_kernel  # type: ignore[import-not-found]

        assert sgl_kernel.assign_req_to_token_pool_cpu is standins.assign_req_to_token_pool_cpu
        with pytest.raises(NotImplementedError, match="sgl_kernel.copy_all_layer_kv_cache_cpu has no CPU stand-in"):
            sgl_kernel.copy_all_layer_kv_cache_cpu(None)
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("sgl_kernel", None)

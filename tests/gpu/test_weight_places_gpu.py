"""The engine's disk weight load on a real GPU (what shared GPUs sync by): the files' tensors are in
host memory, the parameters on the GPU; the first load learns where each tensor goes, comparing
them on the GPU, and the second copies into those places. tests/unit/test_weight_places.py runs the
same load with CUDA's device rules faked; here CUDA applies them.

    python -m pytest tests/gpu/test_weight_places_gpu.py -v
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_weight_places import FusedModel, Worker, write_folder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU (torch.cuda.device_count() is 0)")]


def test_a_disk_load_learns_its_places_and_reloads_on_the_gpu(tmp_path):
    from acceptance import TABLE

    with TABLE.check("weight_places", "disk load onto GPU parameters, twice") as info:
        v1, v2 = write_folder(tmp_path / "v1", 1), write_folder(tmp_path / "v2", 2)
        worker = Worker(FusedModel(device="cuda:0"), "cuda:0")
        worker.load_weights_from_disk(str(tmp_path / "v1"))
        assert worker.placed_weights() == ["kv.weight", "o.weight", "q.weight"]
        worker.load_weights_from_disk(str(tmp_path / "v2"))
        model = worker.model_runner.model
        assert model.qkv.device.type == "cuda"
        assert torch.equal(model.qkv.cpu(), torch.cat([v2["q.weight"], v2["kv.weight"]]))
        assert torch.equal(model.o.cpu(), v2["o.weight"]) and not torch.equal(v1["o.weight"], v2["o.weight"])
        info["detail"] = "3 places learned, reload equal"

"""GPU acceptance of the trainer alone: one DeepSpeed rank on one GPU, no engine, no Ray cluster.

What a node runs before, or without, the whole suite (test_gpu_acceptance.py needs vLLM's CUDA
build): for ZeRO 0, 2 and 3 and a LoRA adapter, TrainerWorker trains two steps in bf16 with NCCL on
a model of Qwen2-0.5B's shape (random weights, built here: no hub) and answers of a few hundred
tokens. Each setting checks that the loss is finite and counts every answer token, that the
weights moved, that the trainer's bf16 logprobs stay close to an fp32 forward of the folder it
saves (what eval and the engines load), and that the memory torch's caching allocator reserves
stays within the dry run's memory plan for the same settings: its peak within the plan's total,
what stays once the rank returns its cache (as before an engine wakes on a shared GPU) within the
plan's resident states. Reserved, not allocated: what the allocator keeps is what an engine on the
same GPU cannot have, and the plan is what refuses a preset that cannot fit, so it must not
undercount. Rows go into the suite's one table.

    python -m pytest tests/gpu/test_trainer_gpu.py -v
    AREAL_DEVICE=cpu python -m pytest tests/gpu/test_trainer_gpu.py -v   # the same steps on CPU, small model
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from acceptance import TABLE, reserved_failures

from areal_kit import hardware
from areal_kit.data.tiny_model import TinySpec, build

ON_CPU = os.environ.get("AREAL_DEVICE") == "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1 and not ON_CPU,
                       reason="needs a CUDA GPU (torch.cuda.device_count() is 0); AREAL_DEVICE=cpu runs the "
                              "same steps on CPU"),
]
CHECK = Path(__file__).with_name("trainer_check.py")
# Qwen2-0.5B's layers (hidden 896, 14 heads over 2 KV heads, MLP 4864) with a small vocabulary:
# big enough that weights, optimizer states and activations dominate the GPU's memory.
SPEC = (TinySpec(kind="bpe", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, bpe_vocab=1024)
        if ON_CPU else
        TinySpec(kind="bpe", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, bpe_vocab=1024))
# bf16 weights and activations against the same weights in fp32: a few 1e-2 on a random model's
# near-uniform logprobs; a wrong dtype or stale weights miss by more. fp32 on CPU: the same math.
TOLERANCE = 1e-4 if ON_CPU else 0.05
SETTINGS = [("zero0", 0, 0), ("zero2", 2, 0), ("zero3", 3, 0), ("lora_zero2", 2, 16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("model") / "qwen2_0.5b_shape"), SPEC)


def _port() -> str:
    return str(hardware.free_port())


@pytest.mark.parametrize("name,zero,lora", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_trainer_rank_trains_in_the_platforms_dtype_within_its_memory_plan(tmp_path, model_dir, name, zero, lora):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with TABLE.check(f"trainer_{name}", "2 steps, logprobs vs fp32, reserved memory vs plan") as info:
        p = subprocess.run([sys.executable, str(CHECK), str(zero), str(lora), str(tmp_path), model_dir, _port()],
                           capture_output=True, text=True, timeout=900, env=env, check=False)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        peak = ""
        if "peak_reserved" in r:
            ph = {k: f"{v / 1e9:.2f}" for k, v in r["phases"].items()}
            peak = (f", reserved peak {r['peak_reserved'] / 1e9:.2f} GB of a planned {r['plan_bytes'] / 1e9:.2f} GB "
                    f"(after setup {ph['setup']}, forward+backward {ph['forward_backward']}, optimizer step "
                    f"{ph['optimizer_step']}; allocated {r['peak_allocated'] / 1e9:.2f}), released "
                    f"{r['released_reserved'] / 1e9:.2f} GB of a planned resident {r['plan_resident'] / 1e9:.2f} GB")
        info["detail"] = (f"{r['device']}, setup {r['setup_s']:.1f} s, train {r['train_s']:.1f} s, loss "
                          f"{r['steps'][-1]['actor_loss']:.4f}, vs fp32 mean {r['vs_fp32_mean']:.4f} max "
                          f"{r['vs_fp32_max']:.3f}, moved {r['moved']:.4f}{peak}")
        for step in r["steps"]:
            assert math.isfinite(step["actor_loss"]), step
            assert step["n_valid_tokens"] > 0
        assert r["moved"] > 1e-3, "two steps left the logprobs where they were"
        assert r["vs_fp32_mean"] < TOLERANCE, r
        if "peak_reserved" in r:  # the dry run's plan must hold what the GPU held
            fails = reserved_failures(r["peak_reserved"], r["released_reserved"], r["plan_bytes"], r["plan_resident"])
            assert not fails, fails
        if lora:
            assert 0 < r["adapter_tensors"] and r["adapter_bytes"] < 0.05 * r["plan_bytes"], r

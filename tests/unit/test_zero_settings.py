"""What the trainer asks of DeepSpeed on the GPU presets, checked without a GPU.

- The "keep the logits for backward" test of functional.chunked_logprobs reads the head's real
  vocabulary under ZeRO-3, which empties a partitioned parameter outside its module's forward
  (`param.data = torch.empty(0)`) and keeps its shape as `ds_shape`. Here a head is partitioned
  the same way by hand; tests/integration/test_deepspeed_settings.py does it with real DeepSpeed.
- bf16 models accumulate gradients in fp32 under ZeRO 1-3 (DeepSpeed's default would be the
  model's dtype, over hundreds of micro-batches a step on the GPU presets); fp32 runs, the tiny
  preset's, get the same DeepSpeed config as before.
- The 1.5B presets train under ZeRO-2, the 7B ones under ZeRO-3.

    .venv/bin/python -m pytest tests/unit/test_zero_settings.py
"""

import pytest
import torch

from areal_kit.config.loader import load_config
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.trainer.deepspeed_zero import deepspeed_config

T, H, V = 64, 8, 4096  # T x V is over KEEP_LOGITS below: the logits are recomputed, not kept
KEEP = T * V // 2


def _partitioned(head: torch.nn.Linear) -> torch.nn.Linear:
    """The head as ZeRO-3 leaves it: empty data and ds_shape outside its forward, the full
    weight inside it (DeepSpeed's pre- and post-forward hooks gather and release it). Forward
    only: a backward would need DeepSpeed's own hooks, which the integration test has."""
    full = head.weight.data
    head.weight.ds_shape = full.shape
    head.weight.data = torch.empty(0)
    head.register_forward_pre_hook(lambda m, args: setattr(m.weight, "data", full))
    head.register_forward_hook(lambda m, args, out: setattr(m.weight, "data", torch.empty(0)))
    return head


def _checkpointed_chunks(head, monkeypatch) -> int:
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(Fn, "KEEP_LOGITS", KEEP)
    hidden = torch.randn(T, H, requires_grad=True)
    Fn.chunked_logprobs(hidden, head, torch.randint(0, V, (T,)), chunk=16)  # the forward decides
    return len(calls)


def test_a_zero3_partitioned_head_recomputes_its_logits_as_the_whole_head_does(monkeypatch):
    torch.manual_seed(0)
    whole = _checkpointed_chunks(torch.nn.Linear(H, V, bias=False), monkeypatch)
    assert whole == T // 16  # every chunk is to be recomputed in backward
    assert _checkpointed_chunks(_partitioned(torch.nn.Linear(H, V, bias=False)), monkeypatch) == whole


GPU_PRESETS = ["1.5B_n1", "1.5B_n4", "1.5B_n16", "1.5B_n1_dapo", "7B_n4", "7B_n16"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_bf16_presets_accumulate_gradients_in_fp32(preset):
    actor = load_config(preset).actor
    assert actor.dtype == "bf16"
    ds = deepspeed_config(actor, torch.bfloat16)
    assert ds["bf16"] == {"enabled": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["zero_optimization"]["stage"] == actor.zero_stage


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_stage_that_can_accumulates_bf16_gradients_in_fp32(stage):
    actor = load_config("tiny", [f"actor.zero_stage={stage}", "actor.dtype=bf16"]).actor
    assert deepspeed_config(actor, torch.bfloat16)["data_types"] == {"grad_accum_dtype": "fp32"}


def test_zero0_and_fp32_keep_deepspeeds_own_accumulation():
    """DeepSpeed 0.19.8 refuses fp32 accumulation of a bf16 model without ZeRO ("unsupported mix");
    an fp32 model accumulates in fp32 already. The tiny preset's config is as it was."""
    tiny = load_config("tiny").actor
    assert deepspeed_config(tiny, torch.float32) == {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "gradient_clipping": tiny.gradient_clipping, "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9, "bf16": {"enabled": False}}
    assert "data_types" not in deepspeed_config(tiny, torch.bfloat16)
    zero3_fp32 = load_config("tiny", ["actor.zero_stage=3"]).actor
    assert "data_types" not in deepspeed_config(zero3_fp32, torch.float32)


@pytest.mark.parametrize("preset, stage", [("1.5B_n1", 2), ("1.5B_n4", 2), ("1.5B_n16", 2), ("1.5B_n1_dapo", 2),
                                           ("7B_n4", 3), ("7B_n16", 3)])
def test_the_1_5b_presets_train_under_zero2_and_the_7b_ones_under_zero3(preset, stage):
    assert load_config(preset).actor.zero_stage == stage

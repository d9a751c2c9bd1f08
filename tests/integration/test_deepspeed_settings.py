"""The trainer's DeepSpeed settings under real DeepSpeed (CPU accelerator, gloo, one rank, in a child
process each), on a tiny Qwen2 with tied embeddings:

- under a real ZeRO-3 partition, functional.chunked_logprobs decides to keep or recompute the
  logits as it does for the whole model (ZeRO-3 empties the head's weight outside its forward),
  and backward through the recomputed chunks works;
- the config deepspeed_zero.deepspeed_config builds for a bf16 model is one DeepSpeed accepts at
  every ZeRO stage, and under ZeRO 1-3 its optimizer accumulates gradients in fp32.

    .venv/bin/python -m pytest tests/integration/test_deepspeed_settings.py
"""

import ds_child

LOGITS = r"""
import json, sys, torch, deepspeed
from transformers import AutoModelForCausalLM
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl.algo import functional as Fn

path = build(sys.argv[1], TinySpec(kind="bpe", heads=2, kv_heads=1))
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
deepspeed.init_distributed(dist_backend="gloo")
T, vocab = 64, model.get_output_embeddings().weight.shape[0]
Fn.KEEP_LOGITS = T * vocab // 2  # this batch's logits count as too big to keep
calls = []
real = torch.utils.checkpoint.checkpoint
torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)

def step(module, backward):
    calls.clear()
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    hidden = module.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    lp, _ = Fn.chunked_logprobs(hidden, module.get_output_embeddings(), ids[0], chunk=16)
    backward(lp.sum())
    return {"checkpointed": len(calls), "sum": float(lp.sum())}

whole = step(model, lambda loss: loss.backward())
model.zero_grad()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9})
numel = int(engine.module.get_output_embeddings().weight.numel())
print("RESULT " + json.dumps({"whole": whole, "zero3": step(engine.module, engine.backward), "head_numel": numel}))
"""

BF16 = r"""
import json, sys, torch, deepspeed
from transformers import AutoModelForCausalLM
from areal_kit.config.loader import load_config
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl.trainer.deepspeed_zero import deepspeed_config

path = build(sys.argv[1], TinySpec(kind="bpe", heads=2, kv_heads=1))
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for stage in range(4):
    actor = load_config("tiny", [f"actor.zero_stage={stage}", "actor.dtype=bf16"]).actor
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(actor, torch.bfloat16))
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    for j in range(3):  # the trainer's micro-batches: one optimizer step at the last
        engine.set_gradient_accumulation_boundary(j == 2)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    o = engine.optimizer
    accum = getattr(o, "gradient_accumulation_dtype", getattr(o, "grad_acc_dtype", None))
    out[stage] = {"optimizer": type(o).__name__, "accum": str(accum)}
print("RESULT " + json.dumps(out))
"""


def test_a_zero3_partition_recomputes_the_logits_as_the_whole_model_does(tmp_path):
    out = ds_child.run(LOGITS, tmp_path)
    assert out["head_numel"] == 0, out  # ZeRO-3 really partitioned the head
    assert out["whole"]["checkpointed"] == 4, out  # 64 tokens in chunks of 16, each recomputed
    assert out["zero3"]["checkpointed"] == out["whole"]["checkpointed"], out
    assert abs(out["zero3"]["sum"] - out["whole"]["sum"]) < 1e-3 * abs(out["whole"]["sum"]), out


def test_bf16_gradients_accumulate_in_fp32_under_zero_1_to_3(tmp_path):
    out = ds_child.run(BF16, tmp_path)
    # Without ZeRO DeepSpeed has bf16 gradients only (it refuses fp32 accumulation there).
    assert out["0"]["optimizer"] == "FP16_UnfusedOptimizer", out
    assert out["1"] == {"optimizer": "BF16_Optimizer", "accum": "torch.float32"}, out
    assert out["2"] == {"optimizer": "DeepSpeedZeroOptimizer", "accum": "torch.float32"}, out
    assert out["3"] == {"optimizer": "DeepSpeedZeroOptimizer_Stage3", "accum": "torch.float32"}, out

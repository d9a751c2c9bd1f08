"""ZeRO-3's full state, gathered a group of parameters at a time
(rl/workers/deepspeed_zero.gathered_state): real DeepSpeed (CPU accelerator, gloo, one rank) in a
child process, on a tiny Qwen2 with tied embeddings. With groups of 4 KB (dozens of gathers) and
with the default (one), the result must be the model's own state dict, tensor for tensor, the tied
head sharing the embedding's copy.

    .venv/bin/python -m pytest tests/integration/test_zero3_gather.py
"""

import ds_child

CHILD = r"""
import json, sys, torch, deepspeed
from transformers import AutoModelForCausalLM
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl.trainer.deepspeed_zero import gathered_state

path = build(sys.argv[1], TinySpec(kind="bpe", heads=2, kv_heads=1))
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
want = {k: v.detach().clone() for k, v in model.state_dict().items()}
deepspeed.init_distributed(dist_backend="gloo")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9})
out = {}
for label, group_bytes in (("4KB", 4096), ("default", 512 << 20)):
    got = gathered_state(engine.module, keep=True, group_bytes=group_bytes)
    tied = [n for n in got if n != "model.embed_tokens.weight" and got[n] is got.get("model.embed_tokens.weight")]
    out[label] = {"keys": sorted(got) == sorted(want),
                  "equal": all(torch.equal(got[k], want[k]) for k in want if k in got),
                  "tied": tied, "empty_outside": int(next(engine.module.parameters()).numel())}
out["discarded"] = len(gathered_state(engine.module, keep=False, group_bytes=4096))
out["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
print("RESULT " + json.dumps(out))
"""


def test_grouped_gather_returns_the_full_state(tmp_path):
    out = ds_child.run(CHILD, tmp_path)
    for label in ("4KB", "default"):
        assert out[label]["keys"], (label, out)
        assert out[label]["equal"], (label, out)
        assert out[label]["empty_outside"] == 0  # ZeRO-3 really partitioned: gathered only inside
        if out["tie_word_embeddings"]:
            assert out[label]["tied"] == ["lm_head.weight"], (label, out)
    assert out["discarded"] == 0  # the other ranks keep nothing

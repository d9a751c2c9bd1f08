"""LoRA benchmark: LoRA vs full-parameter training of the same model on this CPU.

The model is the tiny task's Qwen2 made big enough that the adapter's share is a real model's
(hidden 512, 4 layers, MLP 1536: 12.6M parameters); LoRA is rank 16 on every linear layer of the
blocks. Trainer memory is measured on the tensors themselves: one optimizer step of the model as
the trainer builds it (PEFT-wrapped or not, torch AdamW), then the bytes of its parameters,
gradients and optimizer states, in fp32 as trained here and in bf16 weights with fp32 gradients
and AdamW states as the GPU presets train. Sync and speed come from real `areal-kit train` runs
of both (synchronous, batch engines, one trainer rank and one vLLM engine): bytes a weight sync
sends, the engine's seconds to receive and load it (full: shared memory on one CPU node, or a
gloo broadcast as across nodes; LoRA: the adapter broadcast and served by vLLM's LoRA support),
and steps an hour.

    python bench/run.py lora
"""

from __future__ import annotations

import tempfile

from bench import engines
from bench.report import Result

MODEL = "tiny://toy?hidden=512&layers=4&intermediate=1536&heads=8&kv_heads=2"
RANK = 16
STEPS = 24
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def state_bytes(model_path: str, rank: int, bf16: bool) -> dict:
    """Bytes of parameters, gradients and AdamW states after one step (rank 0 = full training)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.config.lora import LoRAConfig
    from areal_kit.rl import lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16 if bf16 else torch.float32)
    model = lora.wrap(model, LoRAConfig(rank=rank, alpha=2 * rank or 16))
    params = list(lora.trainable(model))
    opt = torch.optim.AdamW(params, lr=1e-4)
    model(torch.tensor([[1, 2, 3, 4]])).logits.float().sum().backward()
    opt.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # bf16 on GPUs: DeepSpeed accumulates gradients in fp32 and AdamW keeps fp32 master weights.
    grads = sum(p.numel() * (4 if bf16 else p.grad.element_size()) for p in params)
    states = sum(t.numel() * (4 if bf16 else t.element_size()) for s in opt.state.values()
                 for t in s.values() if torch.is_tensor(t) and t.dim())
    master = sum(p.numel() * 4 for p in params) if bf16 else 0
    return {"weights": weights, "grads": grads, "optimizer": states + master,
            "trained": sum(p.numel() for p in params), "total": weights + grads + states + master}


def sync_bytes(model_path: str, rank: int) -> int:
    """Bytes one weight sync sends: the adapter's tensors, or the model's (a tied head once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.config.lora import LoRAConfig
    from areal_kit.rl import lora

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if rank:
        model = lora.wrap(model, LoRAConfig(rank=rank, alpha=2 * rank or 16))
        return sum(t.numel() * t.element_size() for t in lora.adapter_tensors(model.state_dict()).values())
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return sum(t.numel() * t.element_size() for t in state.values())


def _run(model_path: str, workdir: str, name: str, extra: list[str]) -> dict:
    got = engines.train_run(["tiny", f"actor.path={model_path}", f"exp_ctrl.total_train_steps={STEPS}",
                             "ppo.max_head_offpolicyness=0", "rollout.mode=batch", "ppo.gen.max_new_tokens=8",
                             *extra], workdir, name, timeout=1800)
    rows = engines.steady(got["rows"], skip=3)
    step = engines.median(r["e2e_time"] for r in rows)
    # Step 1 generated before any sync: its load_time is 0.
    return {"load_s": engines.median(r["load_time"] for r in rows if r.get("load_time")), "s_per_step": step,
            "steps_per_hour": 3600 / step}


def run() -> Result:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import resolve_model

    workdir = tempfile.mkdtemp(prefix="bench-lora-")
    cfg = load_config("tiny", [f"fileroot={workdir}", f"actor.path={MODEL}"])
    path = resolve_model(cfg)
    lora_args = [f"actor.lora.rank={RANK}", f"actor.lora.alpha={2 * RANK}"]
    runs = {"full (shared memory)": _run(path, workdir, "full-shm", []),
            "full (gloo broadcast)": _run(path, workdir, "full-bcast", ["weight_sync=broadcast"]),
            f"LoRA r{RANK} (adapter)": _run(path, workdir, "lora", lora_args)}
    mem = {(r, bf16): state_bytes(path, r, bf16) for r in (0, RANK) for bf16 in (False, True)}
    sent = {r: sync_bytes(path, r) for r in (0, RANK)}
    _, full_b, low = runs.values()
    figures = {"model": MODEL, "rank": RANK, "params": mem[0, False]["trained"], "adapter_params": mem[RANK, False]["trained"],
               "full_state_mb_fp32": mem[0, False]["total"] / 1e6, "lora_state_mb_fp32": mem[RANK, False]["total"] / 1e6,
               "full_state_mb_bf16": mem[0, True]["total"] / 1e6, "lora_state_mb_bf16": mem[RANK, True]["total"] / 1e6,
               "full_sync_mb": sent[0] / 1e6, "lora_sync_mb": sent[RANK] / 1e6,
               **{f"{k}_{f}": v for k, r in zip(("full_shm", "full_bcast", "lora"), runs.values()) for f, v in r.items()}}
    state_ratio = mem[0, False]["total"] / mem[RANK, False]["total"]
    sync_ratio = full_b["load_s"] / low["load_s"]
    checks = {"sync >= 10x faster than the full broadcast": sync_ratio >= 10,
              "trainer state >= 5x smaller (bf16, as on GPUs)": mem[0, True]["total"] >= 5 * mem[RANK, True]["total"]}
    rows = [[who, sent[0 if who.startswith("full") else RANK] / 1e6, r["load_s"], r["s_per_step"], r["steps_per_hour"]]
            for who, r in runs.items()]
    notes = [(f"Trainer state (parameters + gradients + AdamW states) per trainer: full {mem[0, False]['total'] / 1e6:.1f}"
              f" MB vs LoRA {mem[RANK, False]['total'] / 1e6:.1f} MB in fp32 (ratio {state_ratio:.2f}: the frozen fp32 "
              f"base stays), full {mem[0, True]['total'] / 1e6:.1f} MB vs LoRA {mem[RANK, True]['total'] / 1e6:.1f} MB "
              f"with bf16 weights as on GPUs (ratio {mem[0, True]['total'] / mem[RANK, True]['total']:.2f})."),
             f"Adapter: {mem[RANK, False]['trained']:,} of {mem[0, False]['trained']:,} parameters.",
             ("Ratio = the full model's gloo broadcast + load seconds / the adapter's (both over the same gloo "
              "group; on one CPU node the full weights go through shared memory, the first row).")]
    return Result("lora", f"LoRA (rank {RANK}, all linear) vs full training of one model: memory, sync, speed",
                  figures, ratio=sync_ratio, target=10.0, checks=checks,
                  columns=["training", "MB a sync", "sync s (engine receive + load)", "s/step (median)", "steps/hour"],
                  rows=rows, notes=notes)

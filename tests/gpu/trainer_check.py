"""One trainer rank on one GPU, with no engine and no Ray cluster: what tests/gpu/test_trainer_gpu.py
runs in a child process per setting (a fresh CUDA context and NCCL world each time).

It builds TrainerWorker from the tiny preset's config with the model and ZeRO stage given, trains
two steps on answers of a few hundred tokens in the platform's dtype (bf16 on a GPU), and prints
one `RESULT {json}` line: the steps' losses, the GPU memory its caching allocator reserved (the
peak, and what stays once the rank returns its cache as it does before an engine wakes on a
shared GPU) beside the dry run's memory plan for the same settings (its total, and its resident
states), how far the trainer's logprobs are from an fp32 forward of the weights it saves
(save_hf, the folder eval and the engines read), and how far the weights moved. Reserved, not
allocated: an engine sharing the GPU gets only what the allocator has not kept.

    python tests/gpu/trainer_check.py ZERO LORA_RANK ROOT MODEL_DIR PORT
"""

from __future__ import annotations

import json
import sys
import time

import torch

from areal_kit import hardware
from areal_kit.config.loader import load_config
from areal_kit.rl import memory, shapes
from areal_kit.rl.sample import TrainerRow
from areal_kit.rl.trainer.worker import TrainerWorker

PROMPT, ANSWER_MIN, ANSWER_MAX, SEQS = 64, 128, 512, 16


def batch(vocab: int, seed: int) -> list[dict]:
    """SEQS answers of uneven length, half rewarded: enough tokens for activations to count."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(SEQS):
        n = int(torch.randint(ANSWER_MIN, ANSWER_MAX, (1,), generator=g))
        answer = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(TrainerRow(torch.randint(3, vocab, (PROMPT,), generator=g).tolist(), answer,
                              logprobs=[-7.0] * n, seq_reward=float(i % 2)))
    return out


def fp32_logprobs(path: str, prompts: list[list[int]], answers: list[list[int]], device) -> list[list[float]]:
    """The saved folder's answer logprobs in fp32 with plain attention: the reference the bf16
    trainer is held to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    out = []
    with torch.no_grad():
        for p, a in zip(prompts, answers):
            ids = torch.tensor([p + a], device=device)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            out.append(logp[len(p) - 1:].gather(-1, ids[0, len(p):, None])[:, 0].tolist())
    del model
    return out


def trainer_plan(cfg, model_path: str, zero: int, lora_rank: int) -> memory.GpuPlan:
    """The dry run's trainer GPU for these settings (rl/plan.py reads the same fields)."""
    shape = shapes.model_shape(model_path)
    lora = shape.lora_params(lora_rank, cfg.actor.lora.target_modules) if lora_rank else 0
    plan = memory.trainer_plan(shape, zero, 1, cfg.actor_train.mb_spec.max_tokens_per_mb,
                               reference=cfg.ppo.kl_ctl > 0, checkpointing=cfg.actor.gradient_checkpointing,
                               dtype_bytes=2 if hardware.detect().device == "cuda" else 4, lora_params=lora)
    return plan


def watch_phases(worker) -> tuple[dict[str, int], dict[str, int]]:
    """The most the caching allocator reserved in each part of a step (forward + backward up to
    DeepSpeed's optimizer step; the step itself), and what it reserved after setup: which part of
    the plan a miss belongs to. reset_peak_memory_stats starts each part's peak at what is
    reserved then (the allocator keeps its blocks), so the largest part is the run's peak. Beside
    it, the same parts' peak allocation (what tensors held), for the table."""
    phases = {"setup": torch.cuda.memory_reserved(), "forward_backward": 0, "optimizer_step": 0}
    allocated = dict.fromkeys(phases, 0)
    torch.cuda.reset_peak_memory_stats()
    step = worker.engine.step

    def part_ends(name: str) -> None:
        torch.cuda.synchronize()
        phases[name] = max(phases[name], torch.cuda.max_memory_reserved())
        allocated[name] = max(allocated[name], torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    def timed_step(*args, **kwargs):
        part_ends("forward_backward")
        out = step(*args, **kwargs)
        part_ends("optimizer_step")
        return out

    worker.engine.step = timed_step
    return phases, allocated


def main(zero: int, lora_rank: int, root: str, model_path: str, port: str) -> dict:
    overrides = [f"fileroot={root}", f"actor.path={model_path}", "actor.dtype=auto", f"actor.zero_stage={zero}",
                 "ppo.kl_ctl=0.01", "actor.gradient_checkpointing=true"]
    # Rates that move the logprobs visibly in two steps (an adapter starts at zero, so it gets more).
    overrides.append(f"actor.lr={2e-3 if lora_rank else 1e-3}")
    if lora_rank:
        overrides += [f"actor.lora.rank={lora_rank}", f"actor.lora.alpha={2 * lora_rank}"]
    cfg = load_config("tiny", overrides)
    worker = TrainerWorker(0, 1, cfg, model_path, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}, total_steps=2)
    res: dict = {"setup_s": worker.setup(), "device": str(worker.device)}
    vocab = min(shapes.model_shape(model_path).vocab, 1024)  # ids the test's tokenizer has
    samples = batch(vocab, seed=1)
    prompts, answers = [s.prompt_ids for s in samples[:4]], [s.output_ids for s in samples[:4]]
    before = worker.logprobs(prompts, answers)
    on_gpu = worker.device.type == "cuda"
    if on_gpu:
        phases, allocated = watch_phases(worker)
        res["phases"] = phases
    t0 = time.perf_counter()
    res["steps"] = [worker.train_step(batch(vocab, seed=10 + i)).stats for i in range(2)]
    res["train_s"] = time.perf_counter() - t0
    if on_gpu:
        res["peak_reserved"] = max(phases.values())
        res["peak_allocated"] = max(allocated.values())
        res["released_reserved"] = worker.release_memory()["reserved"]  # what a shared GPU's engine cannot have
    plan = trainer_plan(cfg, model_path, zero, lora_rank)
    res["plan_bytes"], res["plan_resident"] = plan.total, plan.resident
    after = worker.logprobs(prompts, answers)
    saved = worker.save_hf(f"{root}/saved", merged=True if lora_rank else None)
    reference = fp32_logprobs(saved, prompts, answers, worker.device)
    flat = lambda xs: torch.tensor([v for x in xs for v in x], dtype=torch.float64)
    res["moved"] = float((flat(after) - flat(before)).abs().mean())
    res["vs_fp32_mean"] = float((flat(after) - flat(reference)).abs().mean())
    res["vs_fp32_max"] = float((flat(after) - flat(reference)).abs().max())
    res["answer_tokens"] = sum(map(len, answers))
    if lora_rank:
        res["adapter_tensors"] = len(worker.full_state(adapter_only=True))
        res["adapter_bytes"] = sum(t.numel() * t.element_size() for t in worker.full_state(adapter_only=True).values())
    return res


if __name__ == "__main__":
    z, r, root_dir, model_dir, master_port = sys.argv[1:6]
    print("RESULT " + json.dumps(main(int(z), int(r), root_dir, model_dir, master_port)), flush=True)

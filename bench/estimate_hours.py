"""Estimated hours a step, an epoch and a whole run of each GPU preset, from its token budget.

    python bench/estimate_hours.py                  # the README's "Hardware and time" table
    python bench/estimate_hours.py --answer-tokens 6000 --mfu 0.4

An estimate, not a measurement: areal-kit has not run these presets on GPUs. A step generates
train_bs_n_seqs x group_size answers on the generation GPUs, then trains on them on the training
GPUs (the presets are synchronous: one after the other). The assumptions, each a flag:

- answers average --answer-tokens tokens (8,000: the guide's own 7B log shows avg_seq_len
  7,773-8,204 at max_new_tokens 16384), prompts --prompt-tokens (its avg_prompt_len, about 110);
- training runs at --mfu of an H800/H100's dense bf16 peak (--peak-tflops 989); a token costs 4
  forward passes (forward, backward as two, the recompute of gradient checkpointing), one more for
  the reference model when kl_ctl > 0 and one for the recomputed logprobs when ppo_n_minibatches > 1;
  a forward pass is 2 x parameters + attention's 4 x layers x d_model x the mean causal context;
- generation: the 7B rate per GPU is what is left of the guide's measured 7B step (16 nodes,
  1024 x 16 answers, --guide-7b-step-s seconds) after its training time by the rule above; the
  1.5B rate is that times the ratio of bytes a decode step reads per token (bf16 weights over 256
  running sequences plus the KV cache of the mean context), 1.5B against 7B.

Only the standard library and areal_kit.config.loader (the presets themselves).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config

PRESETS = ("1.5B_n1", "1.5B_n4", "1.5B_n16", "7B_n4", "7B_n16")
# DeepSeek-R1-Distill-Qwen shapes (their config.json): parameters, layers, d_model, KV heads x head dim.
MODELS = {"1.5B": (1.78e9, 28, 1536, 2 * 128), "7B": (7.62e9, 28, 3584, 4 * 128)}
PROMPTS = 40315  # the guide's count of its training set (steps an epoch = PROMPTS // train_bs_n_seqs)
GUIDE_HOURS = {"1.5B_n1": 520, "1.5B_n4": 150, "1.5B_n16": 50, "7B_n4": 680, "7B_n16": 200}  # 10 epochs


def model_of(cfg) -> str:
    return "7B" if "7B" in os.path.basename(cfg.actor.path) else "1.5B"


def forward_flops(model: str, seq_tokens: float) -> float:
    """FLOPs of one token's forward pass in a sequence of seq_tokens (causal: half of it on average)."""
    params, layers, d_model, _ = MODELS[model]
    return 2 * params + 4 * layers * d_model * seq_tokens / 2


def train_flops_per_token(cfg, seq_tokens: float) -> float:
    passes = 4 + (1 if cfg.ppo.kl_ctl > 0 else 0) + (1 if cfg.ppo.ppo_n_minibatches > 1 else 0)
    return passes * forward_flops(model_of(cfg), seq_tokens)


def decode_bytes_per_token(model: str, context: float, running: int = 256) -> float:
    params, layers, _, kv_width = MODELS[model]
    return 2 * params / running + 2 * layers * kv_width * 2 * context  # bf16 weights; K and V in bf16


def gpus(cfg) -> tuple[int, int]:
    """(generation GPUs, training GPUs) as areal-kit runs the preset on GPUs: a shared allocation
    (1.5B_n1's) runs as its split, half the GPUs each."""
    a = parse_allocation(cfg.allocation_mode)
    a = parse_allocation(a.split() or a.text)
    return a.gen_gpus, a.train_gpus


def rates(args) -> dict[str, float]:
    """Generation tokens/s per GPU over a whole step: 7B from the guide's measured step, 1.5B scaled."""
    cfg = load_config("7B_n16")
    n = cfg.dataset.train_bs_n_seqs * cfg.ppo.group_size
    seq = args.prompt_tokens + args.answer_tokens
    gen_gpus, train_gpus = gpus(cfg)
    train_s = n * seq * train_flops_per_token(cfg, seq) / (train_gpus * args.peak_tflops * 1e12 * args.mfu)
    r7 = n * args.answer_tokens / ((args.guide_7b_step_s - train_s) * gen_gpus)
    context = args.prompt_tokens + args.answer_tokens / 2
    ratio = decode_bytes_per_token("7B", context) / decode_bytes_per_token("1.5B", context)
    return {"7B": r7, "1.5B": r7 * ratio}


def estimate(name: str, args, rate: dict[str, float]) -> dict:
    cfg = load_config(name)
    n = cfg.dataset.train_bs_n_seqs * cfg.ppo.group_size
    answer = min(args.answer_tokens, cfg.ppo.gen.max_new_tokens)
    seq = args.prompt_tokens + answer
    gen_gpus, train_gpus = gpus(cfg)
    gen_s = n * answer / (gen_gpus * rate[model_of(cfg)])
    train_s = n * seq * train_flops_per_token(cfg, seq) / (train_gpus * args.peak_tflops * 1e12 * args.mfu)
    steps = PROMPTS // cfg.dataset.train_bs_n_seqs
    step_h = (gen_s + train_s) / 3600
    return {"hardware": f"{cfg.n_nodes} x {cfg.n_gpus_per_node}", "split": f"{gen_gpus} + {train_gpus}",
            "tokens": n * answer, "step_h": step_h, "epoch_h": step_h * steps, "steps": steps,
            "run_h": step_h * steps * cfg.exp_ctrl.total_train_epochs, "gen_share": gen_s / (gen_s + train_s)}


def _hours(h: float) -> str:
    return f"{h:.0f}" if h >= 10 else f"{h:.1f}"


def table(args) -> str:
    rate = rates(args)
    lines = [(f"Assumed generation: {rate['1.5B']:,.0f} tokens/s per GPU (1.5B), {rate['7B']:,.0f} (7B); answers of "
             f"{args.answer_tokens:,} tokens; training at {args.mfu:.0%} of {args.peak_tflops:g} TFLOPS."), "",
             ("| preset | nodes x GPUs | generation + training GPUs | answer tokens a step | hours a step (generation "
             "share) | hours an epoch | hours, 10 epochs | the guide's v0.1 hours, 10 epochs |"),
             "|---|---|---|---|---|---|---|---|"]
    for name in PRESETS:
        e = estimate(name, args, rate)
        lines.append(f"| {name} | {e['hardware']} | {e['split']} | {e['tokens'] / 1e6:.0f}M | {e['step_h']:.2f} "
                     f"({e['gen_share']:.0%}) | {_hours(e['epoch_h'])} ({e['steps']} steps) | {_hours(e['run_h'])} | "
                     f"{GUIDE_HOURS[name]} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answer-tokens", type=int, default=8000, help="mean answer length (tokens)")
    p.add_argument("--prompt-tokens", type=int, default=110, help="mean prompt length (tokens)")
    p.add_argument("--mfu", type=float, default=0.3, help="training's share of the GPU's peak")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU")
    p.add_argument("--guide-7b-step-s", type=float, default=2260.0,
                   help="the guide's measured 7B step on 16 nodes (its log: 2,122-2,406 s, six steps)")
    print(table(p.parse_args(argv)))


if __name__ == "__main__":
    main()

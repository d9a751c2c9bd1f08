"""Rollout benchmark: generated tokens/s of our vLLM rollout engine vs transformers `generate`.

Same model, prompts and sampling on both sides, on the RL-shaped workload (bench/workload.py):
32 prompts x 8 samples, up to 256 new tokens, eos ~1/80 a token, temperature 1, behaviour
logprobs returned by both. Ours is areal_kit's RolloutWorker (vLLM with the settings of
areal_kit.hardware) in this process; the baseline is one batched `generate` call with KV cache
(what TRL and most hand-written loops do), logprobs from compute_transition_scores. The two
alternate, twice each, after a warm-up; the ratio is of median tokens/s.

    python bench/run.py rollout
"""

from __future__ import annotations

import time

from bench import engines, workload
from bench.report import Result

REPS = 2
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def hf_generate(model, rows: list[dict], group: int, max_new: int, temperature: float, seed: int) -> dict:
    """One batched `generate` over every prompt x group: (seconds, useful tokens, slot use)."""
    import torch

    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    prompts = [r["prompt_ids"] for r in rows for _ in range(group)]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: generation continues every row at the right
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    torch.manual_seed(seed)
    t0 = time.time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=max_new, eos_token_id=eos,
                             pad_token_id=pad, return_dict_in_generate=True, output_scores=True)
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    seconds = time.time() - t0
    new = out.sequences[:, width:].tolist()
    lengths = [r.index(eos) + 1 if eos in r else len(r) for r in new]
    steps = len(new[0]) if new else 0
    return {"seconds": seconds, "tokens": sum(lengths), "slot_use": sum(lengths) / max(len(new) * steps, 1),
            "max_len": max(lengths)}


def ours_generate(worker, rows: list[dict]) -> dict:
    out = worker.generate(rows)
    lengths = [len(s.output_ids) for s in out.samples]
    return {"seconds": out.gen_time, "tokens": sum(lengths), "max_len": max(lengths),
            "mean_len": sum(lengths) / len(lengths)}


def run() -> Result:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    model_path = workload.rl_model()
    cfg = engines.bench_config(model_path, tempfile.mkdtemp(prefix="bench-rollout-"))
    rows = engines.rows_for(cfg)
    worker = engines.rollout_worker(cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    g = cfg.ppo.gen
    # Warm-up both (first-call allocations, vLLM's first schedule), then alternate.
    worker.generate(rows[:2])
    hf_generate(hf, rows[:2], 2, 8, g.temperature, 0)
    ours, base = [], []
    try:
        for rep in range(REPS):
            base.append(hf_generate(hf, rows, cfg.ppo.group_size, g.max_new_tokens, g.temperature, rep))
            ours.append(ours_generate(worker, rows))
    finally:
        engines.close_llm(worker.llm)
    tps_o = [r["tokens"] / r["seconds"] for r in ours]
    tps_b = [r["tokens"] / r["seconds"] for r in base]
    o, b = engines.median(tps_o), engines.median(tps_b)
    sec_o, sec_b = engines.median(r["seconds"] for r in ours), engines.median(r["seconds"] for r in base)
    tok_o, tok_b = engines.mean(r["tokens"] for r in ours), engines.mean(r["tokens"] for r in base)
    slot = engines.mean(r["slot_use"] for r in base)
    n = workload.n_params(model_path)
    figures = {"params": n, "sequences": len(rows) * cfg.ppo.group_size, "max_new_tokens": g.max_new_tokens,
               "ours_tokens_per_s": o, "hf_tokens_per_s": b, "ours_seconds": sec_o, "hf_seconds": sec_b,
               "ours_tokens": tok_o, "hf_tokens": tok_b, "hf_decode_slot_use": slot, "reps": REPS}
    rows_t = [["areal-kit rollout (vLLM)", sec_o, tok_o, o, "-"],
              ["transformers generate", sec_b, tok_b, b, f"{slot:.0%}"]]
    notes = [(f"{n / 1e6:.1f}M-parameter model, {len(rows)} prompts x {cfg.ppo.group_size}, up to "
              f"{g.max_new_tokens} tokens, mean answer {engines.mean(r['mean_len'] for r in ours):.0f} tokens; "
              f"transformers uses {slot:.0%} of its decode slots (the rest wait for the longest answer).")]
    return Result("rollout", "generated tokens/s: our vLLM rollout vs transformers generate", figures,
                  ratio=o / b, target=3.0,
                  columns=["engine", "seconds", "tokens", "tokens/s", "decode slots used"], rows=rows_t,
                  notes=notes)

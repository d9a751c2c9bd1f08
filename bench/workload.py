"""The benchmarks' models and the RL-shaped workload, built locally (no hub) and cached.

RL-shaped means what a rollout of a reasoning model looks like: prompts x group samples that
share each prompt, completion lengths that vary widely and end at eos. A random-init model
samples nearly uniformly over its vocabulary, so eos would come once in ~500 tokens and every
answer would run to the limit; `rl_model` instead points eos's output row along the mean
direction of the model's final hidden states (random models have one) and scales it until
answers average the length of a 1/80-a-token eos hazard capped at 256 (~77 tokens): lengths
then vary widely, from a few tokens to the limit.

    from bench import workload
    path = workload.rl_model()            # ~10M params, byte-level BPE, eos ~1/80
    path = workload.sync_model()          # ~50M params (weight sync benchmark)
    rows = workload.prompts(32)           # the tiny preset's "a + b =" rows
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_kit.data.tiny_model import TinySpec, build, save_atomic

CACHE = os.environ.get("AREAL_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "areal-kit-bench"))

# RL-shaped workload (32 prompts x 8, up to 256 tokens, eos ~1/80).
N_PROMPTS = 32
GROUP = 8
MAX_NEW = 256
EOS_RATE = 1 / 80
TEMPERATURE = 1.0
PROMPT_LEN = 16  # dataset.max_prompt_len: "a + b =" is ~7 BPE tokens with bos

RL_SPEC = TinySpec(kind="bpe", hidden=256, layers=10, heads=4, kv_heads=2, intermediate=1024)
SYNC_SPEC = TinySpec(kind="bpe", hidden=512, layers=12, heads=8, kv_heads=4, intermediate=2048)


def cache_dir(*parts: str) -> str:
    path = os.path.join(CACHE, *parts)
    os.makedirs(path, exist_ok=True)
    return path


def sync_model() -> str:
    return build(os.path.join(CACHE, "models", "sync-50m"), SYNC_SPEC)


def rl_model(eos_rate: float = EOS_RATE) -> str:
    """The ~10M-parameter model of the RL-shaped workload, its eos calibrated to eos_rate."""
    out = os.path.join(CACHE, "models", f"rl-10m-eos{round(1 / eos_rate)}")
    marker = os.path.join(out, "bench_eos.json")
    if os.path.exists(marker) and json.loads(Path(marker).read_text()).get("eos_rate") == eos_rate:
        return out
    base = build(os.path.join(CACHE, "models", "rl-10m-base"), RL_SPEC)
    _calibrate_eos(base, out, eos_rate)
    return out


def _calibrate_eos(src: str, out: str, eos_rate: float) -> None:
    """Scale eos's output row until answers average the length a 1/eos_rate hazard gives.

    Contexts come from the model itself with eos suppressed: changing eos's row changes only
    where answers stop, not what they say before, so the expected length of every scale follows
    from the same contexts: E[len] = sum over t of P(no eos before t).
    """

    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.data.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = load_tokenizer(src)
    eos = model.config.eos_token_id
    ids = prompt_ids(tok, prompts(16))
    width = max(len(p) for p in ids)
    batch = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids])
    torch.manual_seed(0)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        seqs = model.generate(input_ids=batch, attention_mask=(batch != tok.pad_token_id).long(), do_sample=True,
                              top_k=0, top_p=1.0, temperature=TEMPERATURE, max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, suppress_tokens=[eos], eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
        att = (seqs != tok.pad_token_id).long()
        # Hidden states that predict answer tokens 1..MAX_NEW: positions width-1 .. end-1.
        hidden = model.model(input_ids=seqs, attention_mask=att).last_hidden_state[:, width - 1:-1]
        mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        direction = mean / mean.norm()

        def expected_len(scale: float) -> float:
            head[eos] = scale * direction
            p = torch.softmax(hidden @ head.T, -1)[..., eos]  # [seqs, MAX_NEW]
            alive = torch.cumprod(torch.cat([torch.ones_like(p[:, :1]), 1 - p[:, :-1]], 1), 1)
            return alive.sum(1).mean().item()

        want = (1 - (1 - eos_rate) ** MAX_NEW) / eos_rate  # a geometric length capped at MAX_NEW
        lo, hi = 0.0, 50.0
        for _ in range(40):  # bisection: answers get shorter as the scale grows
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_len(mid) > want else (lo, mid)
        got = expected_len(hi)
    save_atomic(model, tok, out, {"bench_eos.json": {"eos_rate": eos_rate, "expected_len": got,
                                                     "target_len": want, "scale": hi}})


def prompts(n: int = N_PROMPTS, seed: int = 1) -> list[dict]:
    """The tiny preset's "a + b =" rows (what `dataset.type=toy` gives a run with this seed)."""
    from areal_kit.data.toy_task import toy_rows

    return toy_rows(n, seed=seed)


def prompt_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """bos + question tokens, exactly as the training loop tokenizes prompts."""
    from areal_kit.data.prompts import tokenize_rows

    kept, _ = tokenize_rows(rows, tokenizer, PROMPT_LEN)
    return [r["prompt_ids"] for r in kept]


def n_params(path: str) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            total += _prod(f.get_slice(k).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

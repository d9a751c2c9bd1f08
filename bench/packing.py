"""Packing benchmark: trainer tokens/s, sequences packed without padding vs padded micro-batches.

One training pass (forward, token logprobs, backward) of the ~10M bench model over a batch of
64 sequences whose answer lengths vary widely (the RL-shaped workload's: roughly geometric,
mean ~80, capped at 256). Packed: areal_kit's trainer path (rl/algo/packing.py partition + pack, the
trainer's packed forward with restarting position ids and per-sequence attention, rl/algo/varlen.py)
in micro-batches of at most 4096 tokens; also the same packed rows under stock SDPA's dense
block-diagonal mask, for reference. Padded: the usual layout, micro-batches of a fixed number of sequences (4096 // 263 = 15) in
batch order, each padded to its longest sequence, with an attention mask. Tokens/s counts real
tokens only; the layouts alternate, twice each.

    python bench/run.py packing
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

from bench import engines, workload
from bench.report import Result

N_SEQS = 64
MAX_TOKENS = 4096  # the tiny preset's actor_train.mb_spec.max_tokens_per_mb
REPS = 2
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def batch(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 7 tokens and answers of geometric length (eos rate 1/80), capped at MAX_NEW."""
    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(n):
        length = 1
        while length < workload.MAX_NEW and rng.random() > workload.EOS_RATE:
            length += 1
        prompts.append([rng.randrange(4, 500) for _ in range(7)])
        answers.append([rng.randrange(4, 500) for _ in range(length)])
    return prompts, answers


def packed_pass(model, prompts, answers, max_tokens: int = MAX_TOKENS) -> int:
    """The trainer's own micro-batching and packed forward (TrainerWorker._logprobs); real tokens."""
    import torch

    from areal_kit.rl.algo import varlen
    from areal_kit.rl.algo.packing import pack, partition
    from areal_kit.rl.trainer.worker import TrainerWorker

    # The trainer's layout for its own attention; stock SDPA finds the sequences from the positions.
    ours = model.config._attn_implementation == varlen.NAME
    me = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(ppo=SimpleNamespace(
        gen=SimpleNamespace(temperature=workload.TEMPERATURE))),
        layout=lambda views, device: varlen.layout_kwargs(varlen.NAME, views, device) if ours else {})
    bins = partition([len(p) + len(a) for p, a in zip(prompts, answers)], max_tokens)
    for idx in bins:
        pk = pack([prompts[i] for i in idx], [answers[i] for i in idx])
        lp, _ = TrainerWorker._logprobs(me, model, pk, grad=True)
        lp.sum().backward()
    return sum(len(p) + len(a) for p, a in zip(prompts, answers))


def padded_pass(model, prompts, answers, pad_id: int) -> int:
    """Fixed-size micro-batches padded to their longest row (HF-Trainer style); real tokens."""
    import torch

    from areal_kit.rl.algo import functional as Fn
    from areal_kit.rl.algo.packing import pad

    per_mb = MAX_TOKENS // (max(len(p) for p in prompts) + workload.MAX_NEW)
    head = model.get_output_embeddings()
    for i in range(0, len(prompts), per_mb):
        ids, att = pad(prompts[i:i + per_mb], answers[i:i + per_mb], pad_id)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
        labels = torch.roll(ids, -1, dims=1).reshape(-1)
        lp, _ = Fn.chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), head, labels, workload.TEMPERATURE)
        (lp * torch.roll(att, -1, dims=1).reshape(-1)).sum().backward()
    return sum(len(p) + len(a) for p, a in zip(prompts, answers))


def _time(fn, model, *args) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.time()
    fn(model, *args)
    return time.time() - t0


def run() -> Result:
    import torch
    from transformers import AutoModelForCausalLM

    from areal_kit.rl.algo import varlen

    path = workload.rl_model()
    load = lambda attn: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).train()
    # Same weights, three attention set-ups: the trainer's varlen attention on packed rows, stock SDPA's
    # dense block-diagonal mask on the same packed rows (what packing cost before), SDPA on padded rows.
    ours, dense, padded = load(varlen.choose("cpu")), load("sdpa"), load("sdpa")
    prompts, answers = batch(N_SEQS)
    pad_id = padded.config.pad_token_id
    n = sum(len(p) + len(a) for p, a in zip(prompts, answers))
    for m in (ours, dense):
        packed_pass(m, prompts[:4], answers[:4])  # warm-up
    padded_pass(padded, prompts[:4], answers[:4], pad_id)
    tp, tq, td = [], [], []
    for _ in range(REPS):
        tq.append(_time(padded_pass, padded, prompts, answers, pad_id))
        tp.append(_time(packed_pass, ours, prompts, answers))
        td.append(_time(packed_pass, dense, prompts, answers))
    sp, sq, sd = engines.median(tp), engines.median(tq), engines.median(td)
    per_mb = MAX_TOKENS // (max(len(p) for p in prompts) + workload.MAX_NEW)
    padded_tokens = sum(len(prompts[0]) + max(len(a) for a in answers[i:i + per_mb]) for i in range(0, N_SEQS, per_mb)
                        for _ in answers[i:i + per_mb])
    figures = {"sequences": N_SEQS, "real_tokens": n, "padded_tokens": padded_tokens, "packed_s": sp,
               "padded_s": sq, "packed_tokens_per_s": n / sp, "padded_tokens_per_s": n / sq, "reps": REPS,
               "packed_dense_mask_s": sd, "packed_dense_mask_ratio": sq / sd}
    rows = [[f"packed (areal-kit, varlen attention), <= {MAX_TOKENS} tokens/mb", sp, n, n, n / sp],
            [f"packed, SDPA block-diagonal mask, <= {MAX_TOKENS} tokens/mb", sd, n, n, n / sd],
            [f"padded, {per_mb} sequences/mb", sq, padded_tokens, n, n / sq]]
    lens = [len(a) for a in answers]
    notes = [(f"Answer lengths {min(lens)}..{max(lens)} (mean {sum(lens) / len(lens):.0f}), same {MAX_TOKENS}-token "
              "budget for every layout. The trainer attends within each packed sequence (rl/algo/varlen.py: a batched "
              "causal SDPA call per distinct length, as flash-attn's varlen kernel does on GPU); stock SDPA on the same packed row "
              f"builds a dense block-diagonal mask, quadratic in the row's length ({sq / sd:.2f}x padded only).")]
    return Result("packing", "trainer tokens/s: packed vs padded micro-batches", figures, ratio=sq / sp,
                  target=1.5, columns=["layout", "seconds", "tokens computed", "real tokens", "real tokens/s"],
                  rows=rows, notes=notes)

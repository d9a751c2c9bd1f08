"""Streaming benchmark: steps/hour and engine occupancy of rollout.mode=stream vs batch, on answers
of heavy-tailed lengths.

`areal-kit train tiny` with a narrow, deep byte-level-BPE model (hidden 64, 16 layers: on this CPU
a decode step's cost is then mostly per step, as a GPU's is mostly the weights' read, so batching
more sequences into a step pays) whose random eos is rare, answers up to MAX_NEW tokens whose
lengths are drawn per answer from a Pareto law (bench/long_tail.py: the same
lengths on every side, seeded by the prompt's sampling seed), at max_head_offpolicyness K on both sides and
cpu_cores=split (one core for the trainer, one for the engine, as each has its own GPU on a
cluster). Three runs of STEPS steps: batch mode; stream mode with rollout.interrupt=keep (new
weights interrupt the generations in flight); stream mode with interrupt=wait (in-flight requests
finish on the old weights). Steps/hour come from the median steady step. Occupancy is running
requests over the engine's slots: measured by the engine in stream mode; in batch mode it follows
from the drawn lengths (a batch decodes until its longest answer ends, so the share of its
answers still decoding, averaged over its decode steps, is sum(len) / (answers x max len)).

    python bench/run.py streaming
"""

from __future__ import annotations

import collections
import os
import tempfile

from bench import engines
from bench.long_tail import lengths
from bench.report import Result

STEPS = 14
MAX_NEW = 1024
# Staleness both modes may train at. At 1 the capacity rule leaves a streaming engine one batch of
# groups to work on while the trainer trains, as a batch engine has: 0.98x measured; at 2 it has two.
K = 2
PROMPTS, GROUP = 16, 8
MODEL = "tiny://bpe?hidden=64&layers=16&max_positions=2048"
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
RUNS = (("batch", ["rollout.mode=batch"]),
        ("stream, interrupt", ["rollout.mode=stream", "rollout.interrupt=keep"]),
        ("stream, wait", ["rollout.mode=stream", "rollout.interrupt=wait"]))


def args(extra: list[str]) -> list[str]:
    flow = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_tail.py")
    return ["tiny", f"actor.path={MODEL}", f"exp_ctrl.total_train_steps={STEPS}", f"ppo.max_head_offpolicyness={K}",
            "cpu_cores=split", f"ppo.gen.max_new_tokens={MAX_NEW}", "dataset.max_prompt_len=16",
            "actor_train.mb_spec.max_tokens_per_mb=8192", "ref_inf.mb_spec.max_tokens_per_mb=8192",
            f"dataset.train_bs_n_seqs={PROMPTS}", f"ppo.group_size={GROUP}", f"ppo.workflow={flow}:long_tail",
            "ppo.reward_fns=[math]", "actor.lr=1e-4", "ppo.kl_ctl=0", *extra]


def batch_occupancy(seed: int, steps: int) -> float:
    """Batch mode's decode-slot occupancy, from the lengths the workload draws for each batch."""
    from areal_kit.rl.algo.batch import sample_seed

    shares = []
    for b in range(steps):
        lens = [n for i in range(PROMPTS) for n in lengths(sample_seed(seed, b, i), GROUP, MAX_NEW)]
        shares.append(sum(lens) / (len(lens) * max(lens)))
    return sum(shares) / len(shares)


def histogram(seed: int = 1, batches: int = 20) -> list[tuple[str, int]]:
    """How the drawn answer lengths fall (the workload, printed with the result)."""
    from areal_kit.rl.algo.batch import sample_seed

    lens = [n for b in range(batches) for i in range(PROMPTS) for n in lengths(sample_seed(seed, b, i), GROUP, MAX_NEW)]
    edges = [8, 16, 32, 64, 128, 256, MAX_NEW]
    counts = collections.Counter(next(f"<={e}" for e in edges if n <= e) for n in lens)
    return [(f"<={e}", counts.get(f"<={e}", 0)) for e in edges]


def run() -> Result:
    workdir = tempfile.mkdtemp(prefix="bench-streaming-")
    res = {}
    for label, extra in RUNS:
        out = engines.train_run(args(extra), workdir, label.replace(", ", "-").replace(" ", "-"), timeout=1800)
        rows = engines.steady(out["rows"], 2, tail=K)
        e2e = engines.median(r["e2e_time"] for r in rows)
        tokens = engines.median(r["n_tokens"] for r in rows)
        occ = (engines.mean(r["stream/occupancy"] for r in rows) if "stream/occupancy" in rows[0]
               else batch_occupancy(1, len(out["rows"])))
        res[label] = {"steps_per_hour": 3600 / e2e, "e2e": e2e, "occupancy": occ, "tokens_per_step": tokens,
                      "tokens_per_s": tokens / e2e,
                      "interrupted": engines.mean(r.get("stream/interrupted", 0) for r in rows),
                      "staleness_mean": engines.mean(r.get("stream/staleness_mean", r.get("staleness", 0)) for r in rows),
                      "wall": out["wall"], "task_reward": [round(r["task_reward"], 4) for r in out["rows"]]}
    base = res["batch"]["steps_per_hour"]
    hist = ", ".join(f"{k}: {v}" for k, v in histogram())
    figures = {"steps": STEPS, "max_new_tokens": MAX_NEW, "max_head_offpolicyness": K, "length_histogram": hist}
    rows = []
    for label, _ in RUNS:
        r, key = res[label], label.replace(", ", "_").replace(" ", "_")
        for f in ("steps_per_hour", "e2e", "tokens_per_step", "tokens_per_s", "occupancy", "interrupted",
                  "staleness_mean", "wall"):
            figures[f"{key}_{f}"] = r[f]
        rows.append([label, r["steps_per_hour"], r["e2e"], r["tokens_per_s"], r["occupancy"], r["interrupted"],
                     r["staleness_mean"],
                     f"{r['steps_per_hour'] / base:.2f}x", r["wall"]])
    best = max(res["stream, interrupt"]["steps_per_hour"], res["stream, wait"]["steps_per_hour"])
    notes = [f"Answer lengths drawn over 20 batches (tokens: answers): {hist}.",
             ("Ratio = stream mode with interrupts over batch mode, steps/hour (median steady step); trained "
             "tokens/s (the median step's tokens over its time) shows the steps are of like size.")]
    return Result("streaming", f"steps/hour on heavy-tailed answer lengths, max_head_offpolicyness {K}: stream "
                  "(interrupt, wait) vs batch mode",
                  figures, ratio=res["stream, interrupt"]["steps_per_hour"] / base, target=1.5,
                  checks={"stream at least as fast as batch": best >= base},
                  columns=["mode", "steps/hour", "s/step", "trained tokens/s", "engine occupancy", "interrupted samples/step",
                           "mean staleness", "vs batch", "wall incl. start-up s"], rows=rows, notes=notes)

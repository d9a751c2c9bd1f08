"""Streaming benchmark: steps/hour and engine occupancy of rollout.mode=stream vs batch, on answers
of heavy-tailed lengths.

`areal-kit train tiny` with a narrow, deep byte-level-BPE model (hidden 64, 16 layers: on this CPU
a decode step's cost is then mostly per step, as a GPU's is mostly the weights' read, so batching
more sequences into a step pays) whose random eos is rare, answers up to MAX_NEW tokens whose
lengths are drawn per answer from a Pareto law (bench/long_tail.py: the same
lengths on every side, seeded by the prompt's sampling seed), at the same max_head_offpolicyness
on both sides and cpu_cores=split (one core for the trainer, one for the engine, as each has its
own GPU on a cluster). At max_head_offpolicyness K, three runs of steps(K) steps: batch mode;
stream mode with rollout.interrupt=keep (new weights interrupt the generations in flight); stream
mode with interrupt=wait (in-flight requests finish on the old weights); at SECOND_K, batch and
stream with interrupts. Steps/hour come from the median steady step. Occupancy is running
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

MAX_NEW = 1024
# Staleness both modes train at. The headline is K: a long answer on this CPU decodes for several
# trainer steps, and at 2 the bound cuts the longest off (they are generated again) where at 4
# most make it. Batch mode is bound by its batches' longest answers whatever k is; both sides
# also run at SECOND_K, so the table shows what a tighter bound costs the stream.
K, SECOND_K = 4, 2
PROMPTS, GROUP = 16, 8
MODEL = "tiny://bpe?hidden=64&layers=16&max_positions=2048"
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")
MODES = {"batch": ["rollout.mode=batch"],
         "stream, interrupt": ["rollout.mode=stream", "rollout.interrupt=keep"],
         "stream, wait": ["rollout.mode=stream", "rollout.interrupt=wait"]}
RUNS = [(K, m) for m in MODES] + [(SECOND_K, "batch"), (SECOND_K, "stream, interrupt")]


def steps(k: int) -> int:
    """12 steady steps after 2 of warm-up, and the last k (nothing queued behind them) left out."""
    return 14 + k


def args(extra: list[str], k: int = K) -> list[str]:
    flow = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long_tail.py")
    return ["tiny", f"actor.path={MODEL}", f"exp_ctrl.total_train_steps={steps(k)}", f"ppo.max_head_offpolicyness={k}",
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


def measure(k: int, mode: str, workdir: str) -> dict:
    """One run's figures: steps/hour from the median steady step, and what bound the step."""
    name = f"{mode}-k{k}".replace(", ", "-").replace(" ", "-")
    out = engines.train_run(args(MODES[mode], k), workdir, name, timeout=1800)
    rows = engines.steady(out["rows"], 2, tail=k)
    e2e = engines.median(r["e2e_time"] for r in rows)
    tokens = engines.median(r["n_tokens"] for r in rows)
    occ = (engines.mean(r["stream/occupancy"] for r in rows) if "stream/occupancy" in rows[0]
           else batch_occupancy(1, len(out["rows"])))
    return {"steps_per_hour": 3600 / e2e, "e2e": e2e, "occupancy": occ, "tokens_per_step": tokens,
            "tokens_per_s": tokens / e2e,
            # the trainer's own time: a push that waits for a batch engine to finish its batch is not
            "trainer_s": engines.median(r["train_time"] - r.get("send_wait_time", 0.0) for r in rows),
            "wait_s": engines.median(r["wait_time"] for r in rows),
            "interrupted": engines.mean(r.get("stream/interrupted", 0) for r in rows),
            "restarted": engines.mean(r.get("stream/restarted", 0) for r in rows),
            "staleness_mean": engines.mean(r.get("stream/staleness_mean", r.get("staleness", 0)) for r in rows),
            "wall": out["wall"], "task_reward": [round(r["task_reward"], 4) for r in out["rows"]]}


COLUMNS = {"steps_per_hour": "steps/hour", "e2e": "s/step", "trainer_s": "trainer s/step",
           "wait_s": "wait for rollouts s/step", "tokens_per_s": "trained tokens/s", "occupancy": "engine occupancy",
           "interrupted": "interrupted samples/step", "restarted": "groups generated again/step",
           "staleness_mean": "mean staleness"}


def run() -> Result:
    workdir = tempfile.mkdtemp(prefix="bench-streaming-")
    res = {(k, mode): measure(k, mode, workdir) for k, mode in RUNS}
    hist = ", ".join(f"{k}: {v}" for k, v in histogram())
    figures = {"steps": steps(K), "max_new_tokens": MAX_NEW, "max_head_offpolicyness": K, "length_histogram": hist}
    rows = []
    for k, mode in RUNS:
        r, key = res[(k, mode)], f"k{k}_" + mode.replace(", ", "_").replace(" ", "_")
        for f in (*COLUMNS, "wall"):
            figures[f"{key}_{f}"] = r[f]
        vs = r["steps_per_hour"] / res[(k, "batch")]["steps_per_hour"]
        rows.append([k, mode, *(r[f] for f in COLUMNS), f"{vs:.2f}x", r["wall"]])
    base = res[(K, "batch")]["steps_per_hour"]
    best = max(res[(K, "stream, interrupt")]["steps_per_hour"], res[(K, "stream, wait")]["steps_per_hour"])
    notes = [f"Answer lengths drawn over 20 batches (tokens: answers): {hist}.",
             (f"Ratio = stream mode with interrupts over batch mode at max_head_offpolicyness {K}, steps/hour "
              "(median steady step). Trained tokens/s (the median step's tokens over its time) counts the "
              "work: a stream step trains fewer tokens than a batch step, as a group with a long answer that "
              "outlives the bound is generated again and trained at a later step (held after "
              "rollout.max_restarts). Trainer s/step is the trainer's own time (without waiting for a batch "
              "engine to take the weights): a mode whose s/step is near it is bound by the trainer.")]
    return Result("streaming", f"steps/hour on heavy-tailed answer lengths: stream (interrupt, wait) vs batch "
                  f"mode, at max_head_offpolicyness {K} and {SECOND_K}", figures,
                  ratio=res[(K, "stream, interrupt")]["steps_per_hour"] / base, target=1.5,
                  checks={"stream at least as fast as batch": best >= base},
                  columns=["k", "mode", *COLUMNS.values(), "vs batch", "wall incl. start-up s"], rows=rows,
                  notes=notes)

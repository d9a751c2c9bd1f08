"""Pipeline benchmark: steps per hour of the tiny preset, synchronous vs asynchronous.

`areal-kit train tiny` at ppo.max_head_offpolicyness 0 (on-policy: generate, then train, then
sync; with both CPU layouts, cores shared and split), 1 and 2 (generation of the next batches
already queued while the trainer trains), one run after another, 60 steps each. Steps/hour come
from the median steady step (after the first two, before the last k, which have no generation
queued behind them) of metrics.jsonl, with each step's time split into generation (on the
engine), waiting for generation (idle trainer), training, weight sync and the rest of the loop
(rewards, advantages, logging). Worker start-up (40-90 s) is not in steps/hour; the wall time is
shown.

    python bench/run.py pipeline
"""

from __future__ import annotations

import tempfile

from bench import engines
from bench.report import Result

STEPS = 60
# (label, max_head_offpolicyness, cpu_cores): each level with the core layout cpu_cores=auto
# gives it, plus synchronous with split cores, so the baseline is the faster of the two layouts.
RUNS = (("0", 0, "auto"), ("0 split", 0, "split"), ("1", 1, "auto"), ("2", 2, "auto"))
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def tiny_args(k: int, steps: int = STEPS, cores: str = "auto") -> list[str]:
    return ["tiny", f"exp_ctrl.total_train_steps={steps}", f"ppo.max_head_offpolicyness={k}", f"cpu_cores={cores}"]


def split(rows: list[dict], k: int) -> dict:
    """Median seconds per steady step, by where they went (medians: a step slowed by another
    tenant of the machine moves a mean, not a median)."""
    s = engines.steady(rows, 2, tail=k)
    m = lambda key: engines.median(r.get(key, 0.0) for r in s)
    e2e, wait, train, sync = m("e2e_time"), m("wait_time"), m("train_time"), m("sync_time")
    return {"e2e": e2e, "gen": m("gen_time"), "wait": wait, "train": train, "sync": sync, "load": m("load_time"),
            "reward": m("reward_time"), "other": max(e2e - wait - train - sync, 0.0),
            "steps_per_hour": 3600 / e2e if e2e else float("nan"), "steady_steps": len(s),
            "task_reward": [round(r.get("task_reward", float("nan")), 4) for r in rows]}


def run() -> Result:
    workdir = tempfile.mkdtemp(prefix="bench-pipeline-")
    res = {}
    for label, k, cores in RUNS:
        out = engines.train_run(tiny_args(k, cores=cores), workdir, f"offpolicy{k}-{cores}")
        res[label] = {**split(out["rows"], k), "wall": out["wall"], "k": k}
    sync_label = max((lb for lb, k, _ in RUNS if k == 0), key=lambda lb: res[lb]["steps_per_hour"])
    best = max((lb for lb, k, _ in RUNS if k > 0), key=lambda lb: res[lb]["steps_per_hour"])
    base = res[sync_label]["steps_per_hour"]
    figures = {"steps": STEPS}
    rows = []
    for label, _, _ in RUNS:
        r, key = res[label], label.replace(" ", "_")
        for f in ("steps_per_hour", "e2e", "gen", "wait", "train", "sync", "load", "other", "wall"):
            figures[f"k{key}_{f}"] = r[f]
        figures[f"k{key}_speedup"] = r["steps_per_hour"] / base
        rows.append([label, r["steps_per_hour"], r["e2e"], r["gen"], r["wait"], r["train"], r["sync"], r["load"], r["other"],
                     f"{r['steps_per_hour'] / base:.2f}x", r["wall"]])
    notes = [(f"Steady steps per run: {min(r['steady_steps'] for r in res.values())}-"
              f"{max(r['steady_steps'] for r in res.values())}. gen = generation time on the engine, which overlaps "
              "training when max_head_offpolicyness > 0; wait = trainer idle, waiting for generation (and, when "
              "synchronous, for the engine's weight load); sync = the trainer's side of the weight sync (staging "
              "the weights: the send runs on the trainer's second thread, and its next optimizer step waits for "
              "it, inside train); engine load = the engine's receive and load, between its generations."),
             ("cpu_cores=auto shares both cores between the roles when synchronous (they take turns) and splits "
              "them when asynchronous (they run at once, one core each, as each role has its own GPUs on a "
              f"cluster). Ratio = best async (max_head_offpolicyness {best}) over the faster synchronous layout "
              f"({sync_label}).")]
    return Result("pipeline", "steps/hour of the tiny preset: async (max_head_offpolicyness 1, 2) vs sync",
                  figures, ratio=res[best]["steps_per_hour"] / base, target=1.3,
                  columns=["max_head_offpolicyness", "steps/hour", "s/step", "gen s", "wait (idle) s",
                           "train s", "sync s", "engine load s", "other s", "vs sync", "wall incl. start-up s"],
                  rows=rows, notes=notes)

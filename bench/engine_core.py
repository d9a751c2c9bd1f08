"""Engine-core benchmark: the tiny preset with vLLM's engine core inside the engine's actor (inline,
CPU's default) and in a process of its own (process, every GPU run's topology), side by side.

`areal-kit train tiny` with actor.vllm.engine_core=inline and =process, in turns (inline, process,
inline, process: a host that speeds up or slows down mid-benchmark moves both alike), 200 steps
each at the preset's settings. Start-up is from the command's start to the first step's metrics
row; the step is the median steady step (the first two and the last one left out), with the
engine's generate and the trainer's step beside it. What decides actor.vllm.engine_core=auto on
CPU.

    python bench/run.py engine_core
"""

from __future__ import annotations

import tempfile

from bench import engines
from bench.report import Result

STEPS = 200
ROUNDS = 2
MODES = ("inline", "process")
ABOUT = __doc__.split("\n\n")[1].replace("\n", " ")


def one(mode: str, workdir: str, i: int) -> dict:
    out = engines.train_run(["tiny", f"exp_ctrl.total_train_steps={STEPS}", f"actor.vllm.engine_core={mode}"],
                            workdir, f"{mode}{i}", reuse=False)
    rows = out["rows"]
    steady = engines.steady(rows, 2, tail=1)
    return {"startup": rows[0]["time"] - out["start"], "step": engines.median(r["e2e_time"] for r in steady),
            "gen": engines.median(r.get("gen_time", 0.0) for r in steady),
            "train": engines.median(r.get("train_time", 0.0) for r in steady),
            "task_reward": engines.mean(r["task_reward"] for r in rows[-20:]), "wall": out["wall"]}


def run() -> Result:
    workdir = tempfile.mkdtemp(prefix="bench-engine-core-")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(ROUNDS):
        for mode in MODES:
            runs[mode].append(one(mode, workdir, i))
    med = {m: {k: engines.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    figures: dict = {"steps": STEPS, "rounds": ROUNDS}
    rows = []
    for m in MODES:
        for k, v in med[m].items():
            figures[f"{m}_{k}"] = v
        rows.append([m, med[m]["startup"], med[m]["step"], med[m]["gen"], med[m]["train"], med[m]["task_reward"],
                     ", ".join(f"{r['startup']:.1f} / {r['step']:.3f}" for r in runs[m])])
    ratio = med["inline"]["step"] / med["process"]["step"]
    notes = [(f"Medians of {ROUNDS} runs per mode, run in turns; the last column gives each run's start-up (s) and "
              "step (s). Ratio = inline's step over process's (above 1: the engine core's own process is faster)."),
             ("With process, vLLM's CPU engine core starts its worker in one more process: the actor, the engine "
              "core and the worker hand each step over, as on a GPU node (where the worker runs in the core's "
              "process).")]
    return Result("engine_core", "tiny preset: vLLM's engine core in its own process vs inside the engine's actor",
                  figures, ratio=ratio, target=None,
                  columns=["engine_core", "start-up s", "s/step", "gen s", "train s", "task_reward (last 20)",
                           "each run: start-up / step"],
                  rows=rows, notes=notes)

"""The tiny step's generation by vLLM alone: what the learning benchmark's own side cannot go below.

A run's steps each wait on one engine call (the engine's chain bounds the overlapped step), and
its start-up on the engine's start. This measures both with nothing else running: one
RolloutWorker of the tiny preset in a fresh process on one core (as a run gives its engine one),
no Ray, no trainer, no weight loads; its start (vLLM's import and the engine's build) and the
median of `calls` generate calls, each on the next batch of the preset's prompts with the
controller's seeds, the prefix cache reset before each as a weight update resets it. The floor of
our time to a target of `steps` steps is then start + steps x call: every other part at no cost.

    python -m bench.engine_floor MODEL_DIR WORKDIR [CALLS]    # one JSON line: start_s, call_s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench import engines

WARMUP = 10


def measure(model_path: str, workdir: str, calls: int) -> dict:
    from areal_kit.config.loader import load_config
    from areal_kit.rl.algo.batch import sample_seed
    from areal_kit.rl.driver.job import prepare

    cfg = load_config("tiny", [f"fileroot={workdir}", f"actor.path={model_path}"])
    loader = prepare(cfg).loader
    t0 = time.time()
    w = engines.rollout_worker(cfg)
    start = time.time() - t0
    times = []
    for step in range(WARMUP + calls):
        _, _, rows = loader.next_batch()
        rows = [{**r, "seed": sample_seed(cfg.seed, step, i)} for i, r in enumerate(rows)]
        w.llm.reset_prefix_cache()
        times.append(w.generate(rows).gen_time)
    engines.close_llm(w.llm)
    return {"start_s": start, "call_s": engines.median(times[WARMUP:]), "calls": calls}


def run(model_path: str, workdir: str, calls: int = 60) -> dict:
    """measure() in a fresh process on the machine's last core (a run's engine has one core)."""
    core = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-m", "bench.engine_floor", model_path, workdir, str(calls)],
                         cwd=engines.ROOT, capture_output=True, text=True, check=True, timeout=600,
                         preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    return json.loads(out.stdout.strip().splitlines()[-1])


def least(floor: dict, steps: int | None) -> float | None:
    """Our least possible time to a target reached in `steps` steps (None: never reached)."""
    return None if steps is None else floor["start_s"] + steps * floor["call_s"]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 60)))

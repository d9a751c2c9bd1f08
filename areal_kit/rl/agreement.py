"""Do the engines hold the trainer's weights? The largest gap between a rollout engine's and the
trainers' logprobs of the same sequences: after a weight sync it is rounding (1e-4 in fp32 on CPU,
a few 1e-3 in bf16 on GPUs); stale or garbled weights miss by far more. Used by the tests of every
weight-sync path and by `areal-kit doctor --rl-step`.

    gap = engine_vs_trainer(ctrl.workers, job.loader.rows)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

from areal_kit.rl.engine.worker import RolloutWorker
from areal_kit.rl.trainer.worker import TrainerWorker

if TYPE_CHECKING:
    from areal_kit.rl.driver.groups import Workers


def fixed_sequences(rows: list[dict], n: int = 6) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of the dataset with short fixed answers: an RL-shaped sequence, the same every call."""
    rows = rows[:n]
    return [r["prompt_ids"] for r in rows], [[5 + (i % 10), 1] for i in range(len(rows))]


def engine_vs_trainer(workers: Workers, rows: list[dict], engine: int = 0) -> float:
    """max |trainer logprob - engine logprob| over the answer tokens of fixed_sequences(rows), for
    the engine of that index."""
    prompts, answers = fixed_sequences(rows)
    # Every rank runs the forward: ZeRO-3 gathers each layer's parameters from all of them.
    trainer_lp = ray.get(workers.trainers.each(TrainerWorker.logprobs, prompts, answers))[0]
    engine_lp = ray.get(workers.engines.one(engine, RolloutWorker.prompt_logprobs,
                                            [p + a for p, a in zip(prompts, answers)]))
    diffs = []
    for p, t, e in zip(prompts, trainer_lp, engine_lp):
        tail = e[len(p) - 1:]  # the engine gives logprobs of tokens 1.., the answer starts at len(p)
        if len(tail) != len(t):
            raise RuntimeError(f"engine gave {len(tail)} answer logprobs, the trainer {len(t)}")
        diffs += [abs(x - y) for x, y in zip(t, tail)]
    return max(diffs)

"""In-training evaluation: every exp_ctrl.eval_every steps, greedy pass@1 on the held-out split,
and with exp_ctrl.eval_n_samples = k also avg@k and pass@k of k sampled answers per prompt.

The split is dataset.eval_path, or dataset.eval_size prompts held out of the training data
(data/sources.split_eval). The rollout engines answer each prompt once at temperature 0 with
the weights just trained (and k times at ppo.gen's temperature, seeded by the step), and each
answer is graded by the grader of `areal-kit eval` (reward/grading.grade_row) against the row's
reference (`answer`, or any of AReaL's `solutions`). On a small eval set greedy pass@1
moves in steps of 1/N; avg@k (the mean accuracy of the k samples) is the smoother curve, and
pass@k (the unbiased estimator of eval/passk.py) tells whether the right answer is within reach.
One log line a evaluation, and metrics keys eval/* in that step's row:

    Eval at global step 20: pass@1 0.4219 (27/64 prompts, greedy, 512 max tokens), avg@8 0.3994, pass@8 0.7031 in 3.1s.

    grep "Eval at" train.log
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from areal_kit.eval.passk import mean_pass_at_k
from areal_kit.rl.algo.batch import sample_seed
from areal_kit.rl.driver.schedule import Every

if TYPE_CHECKING:
    from areal_kit.config.schema import ExpCtrl, GenConfig
    from areal_kit.rl.driver.groups import EngineGroup
    from areal_kit.runlog import RunLogger


class Validator:
    """Greedy pass@1 (and avg@k, pass@k) on the held-out rows, on the rollout engines, when
    exp_ctrl.eval_every says."""

    def __init__(self, exp_ctrl: ExpCtrl, gen: GenConfig, seed: int, rows: list[dict], engines: EngineGroup,
                 log: RunLogger, total_steps: int) -> None:
        """exp_ctrl: its eval_* options; gen: the run's sampling (its answer length, unless
        exp_ctrl.eval_max_new_tokens); seed: the run's, from which each eval sample's derives."""
        self.rows, self.engines, self.log, self.total_steps = rows, engines, log, total_steps
        self.every = Every(steps=exp_ctrl.eval_every)
        self.max_tokens = exp_ctrl.eval_max_new_tokens or gen.max_new_tokens
        self.k, self.seed = exp_ctrl.eval_n_samples, seed

    def due(self, global_step: int) -> bool:
        return bool(self.rows) and bool(self.every.steps) and (
            self.every.due(global_step) or global_step == self.total_steps)

    def run(self, global_step: int) -> dict:
        """Evaluate on every engine (rows split evenly), log the line, return the eval/* metrics."""
        t0 = time.time()
        # The samples' seeds depend on the step (not the engine): a resumed run evaluates alike.
        rows = [{**r, "seed": sample_seed(self.seed, global_step, i)} for i, r in enumerate(self.rows)]
        res = self.engines.evaluate(rows, self.max_tokens, self.k)
        n = len(res)
        correct = sum(r["correct"] for r in res)
        out = {"eval/pass@1": correct / n, "eval/n_prompts": n,
               "eval/avg_len": sum(r["n_tokens"] for r in res) / n,
               "eval/no_eos_ratio": sum(r["no_eos"] for r in res) / n}
        sampled = ""
        if self.k:
            k = self.k
            out[f"eval/avg@{k}"] = sum(r["n_correct"] for r in res) / (n * k)
            out[f"eval/pass@{k}"] = mean_pass_at_k([(k, r["n_correct"]) for r in res], k)
            sampled = f", avg@{k} {out[f'eval/avg@{k}']:.4f}, pass@{k} {out[f'eval/pass@{k}']:.4f}"
        out["eval/time"] = time.time() - t0
        self.log.info(f"Eval at global step {global_step}: pass@1 {out['eval/pass@1']:.4f} ({correct}/{n} prompts, "
                      f"greedy, {self.max_tokens} max tokens){sampled} in {out['eval/time']:.1f}s.")
        return out

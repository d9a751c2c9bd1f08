"""The DAPO recipe and data mixing through the real engine: `areal-kit train tiny_dapo` on a mix of
two sources, stopped after step 3 and resumed to step 5, as a user runs it.

One run (two launches) checks every recipe piece against what the run itself recorded:
  - dynamic sampling: each step generated (1 + extra rounds) batches, trains on a full batch of
    informative groups unless it ran out of rounds, and the prompts of each step are exactly the
    loader's next batches, across the resume too (the recover checkpoint keeps the batches taken,
    not the steps: resuming at the step count would replay earlier prompts);
  - overlong shaping and filtering: their metrics, within their ranges;
  - the in-training eval's avg@k and pass@k beside greedy pass@1, in the metrics and the log;
  - dataset.mix: the rows of each source as weighed, the per-source task reward every step.

    .venv/bin/python -m pytest tests/integration/test_recipes_tiny.py -s
"""

import json
import os
import subprocess
import sys

from areal_kit import runlog
from areal_kit.config.loader import load_config
from areal_kit.data.toy_task import toy_rows
from areal_kit.rl.driver.job import prepare

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
BATCH, GROUP, ROUNDS, K = 16, 8, 3, 4


def write_sources(tmp_path):
    """Two jsonl sources of the toy sums: the one-digit sums and the two-digit ones."""
    rows = toy_rows(600, seed=5)
    for name, pick in (("small", lambda r: len(r["answer"]) == 1), ("big", lambda r: len(r["answer"]) > 1)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n"
                         for r in rows if pick(r))


def overrides(tmp_path, steps):
    mix = (f"[{{path: {tmp_path}/small.jsonl, type: jsonl, weight: 1}}, "
           f"{{path: {tmp_path}/big.jsonl, type: jsonl, weight: 0.5}}]")
    return [f"fileroot={tmp_path}", "trial_name=mix", "tensorboard=false", f"dataset.mix={mix}",
            f"dataset.train_bs_n_seqs={BATCH}", "dataset.eval_size=8", "exp_ctrl.eval_every=2",
            f"exp_ctrl.eval_n_samples={K}", f"ppo.dynamic_sampling_max_rounds={ROUNDS}",
            f"exp_ctrl.total_train_steps={steps}", "exp_ctrl.ckpt_freq_steps=1", "exp_ctrl.dump_samples_every=1",
            f"exp_ctrl.dump_samples_groups={BATCH}"]


def train(tmp_path, steps):
    proc = subprocess.run([EXE, "train", "tiny_dapo", *overrides(tmp_path, steps)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=900, check=False, env={**os.environ, "AREAL_USER": "ci"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_tiny_dapo_on_a_mix_resumes_at_the_exact_prompt(tmp_path, monkeypatch):
    write_sources(tmp_path)
    train(tmp_path, 3)
    train(tmp_path, 5)
    monkeypatch.setenv("AREAL_USER", "ci")
    job = prepare(load_config("tiny_dapo", overrides(tmp_path, 5)))
    paths = job.paths
    rows = runlog.read_metrics(paths.metrics_file)
    log = "\n".join(read_lines(paths.log_file))
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4, 5]
    assert "Will recover from: " in log and "resuming at global step 4 of 5" in log

    # dataset.mix: all the one-digit sums, half the two-digit ones (less the 8 held out for eval)
    n_small, n_big = (len(read_lines(tmp_path / f"{s}.jsonl")) for s in ("small", "big"))
    by_source = [sum(r["source"] == s for r in job.loader.rows) for s in ("small", "big")]
    assert n_small - 8 <= by_source[0] <= n_small and abs(by_source[1] - n_big / 2) <= 8, (by_source, n_small, n_big)

    # Dynamic sampling: every generated batch is in n_seqs; a short batch only when rounds ran out.
    taken = 0
    dumps = [json.loads(line) for line in read_lines(paths.samples_file)]
    for r in rows:
        batches = 1 + r["dynamic/rounds"]
        assert r["dynamic/rounds"] <= ROUNDS
        assert r["n_seqs"] == batches * BATCH * GROUP
        assert r["dynamic/kept_groups"] == BATCH or r["dynamic/rounds"] == ROUNDS, r
        assert r["dynamic/kept_groups"] + r["dynamic/dropped_groups"] >= BATCH * (batches - 1)
        # The step's prompts are the loader's next batches: the position survives the resume.
        job.loader.seek(taken)
        ids = {row["id"] for _ in range(batches) for row in job.loader.next_batch()[2]}
        step = [d for d in dumps if d["global_step"] == r["global_step"]]
        assert {d["id"] for d in step} <= ids, r["global_step"]
        assert len(step) == GROUP * (r["dynamic/kept_groups"] or BATCH)  # no informative group: the first batch
        # Trained groups are informative: their answers' task rewards differ (when the batch filled).
        if r["dynamic/kept_groups"]:
            for pid in {d["id"] for d in step}:
                assert len({d["task_reward"] for d in step if d["id"] == pid}) > 1, pid
        taken += batches
        # Overlong shaping (buffer 1 of 4 tokens: a 4-token answer loses 1) and filtering.
        assert -1.0 <= r["overlong_penalty"] <= 0.0 and 0.0 <= r["overlong_masked"] <= 1.0
        # Per-source task reward.
        assert {"task_reward/small", "task_reward/big"} <= set(r)
    state = json.loads("".join(read_lines(os.path.join(paths.recover_dir, "globalstep5", "state.json"))))
    assert state["batches"] == taken

    # The in-training eval: greedy pass@1, avg@4 and pass@4 every 2 steps and at the end of each launch.
    evals = {r["global_step"]: r for r in rows if "eval/pass@1" in r}
    assert sorted(evals) == [2, 3, 4, 5]
    for r in evals.values():
        assert 0.0 <= r[f"eval/avg@{K}"] <= r[f"eval/pass@{K}"] <= 1.0
        assert 0.0 <= r["eval/pass@1"] <= 1.0
    assert "Eval at global step 4: pass@1 " in log and f", avg@{K} " in log and f", pass@{K} " in log
    # areal-kit plot draws them (their panels are unit-tested; here: the command on the run's own files).
    png = tmp_path / "curve.png"
    plot = subprocess.run([EXE, "plot", "tiny_dapo/mix", "--fileroot", str(tmp_path), "--user", "ci", "-o", str(png)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert plot.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", plot.stdout + plot.stderr

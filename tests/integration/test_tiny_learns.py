"""The main job: `areal-kit train tiny` learns its multi-token task end to end on this CPU.

Runs the installed command as the README does (default seed) in a fresh directory: in CI over
14 of the preset's 25 epochs (seed 1's 10-step mean is 0.82 at step 1400 with AVX-512 kernels,
0.90 with AVX2 ones: past LAST10 with room, in 56% of the time), and whole, as the README writes
it, among the `long` tests. A learning test, not a timing test (wall time is printed, not
asserted): the mean task reward of the last 10 steps must pass LAST10, and the final saved model,
decoded greedily with its own tokenizer on all 100 questions, must get both one-digit sums ("7"
then eos) and two-digit sums ("1 7" then eos) right often enough. A change that breaks decoding, eos handling or
the credit of the second answer token fails here.

    .venv/bin/python -m pytest tests/integration/test_tiny_learns.py -s
"""

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_kit import runlog
from areal_kit.data.tokenizer import load_tokenizer
from areal_kit.data.toy_task import spell
from areal_kit.rl.algo import varlen

# A broken decode, eos or second-token credit stays near chance (task reward ~0.05-0.10, greedy
# accuracy ~1/19). Seeds 1-3 of the preset end at 0.87-0.92 (greedy 78-100% on either length) on
# the machine that chose it, and are at 0.80-0.88 at step 1400 (seed 1 with AVX2 kernels: 0.90,
# greedy 98% / 100% at step 1200 already); the bars leave room for another CPU, whose float
# kernels round differently (RL amplifies it: the preset before this one ended at 0.84 on one
# machine, 0.56 on another).
LAST10 = 0.7  # mean task reward of the last 10 steps
PER_LENGTH = 0.5  # greedy accuracy on the one-digit and on the two-digit sums, each: 9x chance


def greedy_accuracy(model_path: str) -> dict[int, float]:
    """Greedy accuracy of the saved model on every question, by the answer's number of digits."""
    tok, model = load_tokenizer(model_path), AutoModelForCausalLM.from_pretrained(model_path).eval()
    right: dict[int, list[bool]] = {1: [], 2: []}
    for a in range(10):
        for b in range(10):
            prompt = [tok.bos_token_id] + tok(f"{a} + {b} =", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(prompt):]
            ended = tok.eos_token_id in out.tolist()
            text = tok.decode(out, skip_special_tokens=True)
            right[len(str(a + b))].append(ended and text.split() == spell(a + b).split())
    return {n: sum(v) / len(v) for n, v in right.items()}


@pytest.mark.parametrize("epochs", [14, pytest.param(None, marks=pytest.mark.long, id="whole")],
                         ids=lambda e: f"{e}_epochs")
def test_tiny_preset_learns_multi_token_sums(tmp_path, epochs):
    exe = Path(sys.executable).with_name("areal-kit")
    budget = [f"exp_ctrl.total_train_epochs={epochs}"] if epochs else []
    t0 = time.time()
    proc = subprocess.run([str(exe), "train", "tiny", *budget], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "AREAL_USER": "ci"}, timeout=2400, check=False)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "areal_runs" / "logs" / "ci" / "tiny" / "run0"
    rows = runlog.read_metrics(str(run / "metrics.jsonl"))
    rewards = [r["task_reward"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    saves = sorted(glob.glob(str(tmp_path / "areal_runs" / "checkpoints" / "ci" / "tiny" / "run0" / "actor" / "*")))
    acc = greedy_accuracy(saves[-1])
    print(f"\ntiny: {len(rows)} steps, task_reward first 10 {first:.3f}, last 10 {last:.3f}; greedy accuracy "
          f"one-digit {acc[1]:.2f}, two-digit {acc[2]:.2f}; wall {wall:.0f}s")
    assert last >= LAST10, f"did not learn: first10={first:.3f} last10={last:.3f}"
    assert acc[1] >= PER_LENGTH, f"one-digit sums: greedy accuracy {acc[1]:.2f}"
    assert acc[2] >= PER_LENGTH, f"two-digit sums: greedy accuracy {acc[2]:.2f}"
    assert max(r["avg_seq_len"] for r in rows[-10:]) > 2.0  # two-digit answers are written, not only one-digit
    # The grep contract of the log file holds for every step.
    text = (run / "train.log").read_text()
    assert text.count(" finishes. Average #tokens per batch is ") == len(rows)
    assert text.count("RPC name actor_train returns {") == len(rows)
    assert f"attention {varlen.explain('cpu')}" in text  # the log says which attention trains
    # Samples for people to read: the last dump is of the last step (the step budget is a multiple of 10), as text.
    shown = subprocess.run([str(exe), "logs", str(run), "--samples", "--tail", "0"], capture_output=True, text=True,
                           check=False)
    assert shown.returncode == 0, shown.stderr
    assert f"samples of global step {len(rows)}" in shown.stdout
    table = [line for line in shown.stdout.splitlines() if line.startswith("| ") and " + " in line]
    assert len(table) == 2 * 8, "two groups of eight answers"
    assert all("=" in line for line in table), "prompts are shown as text"

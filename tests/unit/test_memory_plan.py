"""The dry run's memory plan per GPU (rl/memory.py, printed by rl/plan.py): known figures of the
presets' models, what each ZeRO stage partitions, vLLM's KV cache, every GPU preset fitting its
GPUs as shipped, and the one-line refusal, with the arithmetic, of a preset that cannot fit.
No GPU: AREAL_DEVICE=cuda plans for GPUs, and the GPUs' memory is the 80 GB default.

    .venv/bin/python -m pytest tests/unit/test_memory_plan.py -q
"""

import json

import pytest
from cli_run import assert_one_line_error, dry_run, run_cli

from areal_kit import hardware
from areal_kit.config.loader import load_config
from areal_kit.rl import memory, plan, shapes

pytestmark = pytest.mark.unit

R1_15B = shapes.KNOWN_MODELS["DeepSeek-R1-Distill-Qwen-1.5B"]
R1_7B = shapes.KNOWN_MODELS["DeepSeek-R1-Distill-Qwen-7B"]
GPU_PRESETS = ["1.5B_n1", "1.5B_n1_dapo", "1.5B_n4", "1.5B_n16", "7B_n4", "7B_n16", "7B_n1_lora"]


@pytest.fixture(autouse=True)
def _no_gpu_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AREAL_USER", "tester")
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    monkeypatch.setattr(hardware, "gpu_memory_bytes", lambda: None)  # a GPU here would set the capacity


def part(p: memory.GpuPlan, name: str) -> float:
    return next(x.nbytes for x in p.parts if x.name == name)


def test_the_presets_models_have_their_published_parameter_counts():
    assert R1_15B.params == pytest.approx(1.777e9, rel=1e-3)
    assert R1_7B.params == pytest.approx(7.616e9, rel=1e-3)


def test_1_5b_weights_in_bf16_are_3_55_gb_and_zero_2_splits_the_optimizer_over_the_ranks():
    t = memory.trainer_plan(R1_15B, zero_stage=2, ranks=8, tokens=19456, reference=True)
    assert part(t, "weights") == 2 * R1_15B.params == pytest.approx(3.55e9, rel=2e-3)
    assert part(t, "optimizer") == 12 * R1_15B.params / 8
    assert part(t, "gradients") == 4 * R1_15B.params / 8  # fp32 accumulation, partitioned
    assert part(t, "reference model") == 2 * R1_15B.params


@pytest.mark.parametrize("stage, weights, grads, optim", [
    (0, 2, 2 + 4, 12),   # nothing partitioned; bf16 gradients and the fp32 copy the optimizer steps on
    (1, 2, 4, 12 / 16),  # the optimizer partitioned, the fp32 gradients whole
    (2, 2, 4 / 16, 12 / 16),
    (3, 2 / 16, (4 + 2) / 16, 12 / 16),  # ZeRO-3 also keeps a bf16 partition beside the fp32 one
])
def test_each_zero_stage_partitions_what_it_says(stage, weights, grads, optim):
    t = memory.trainer_plan(R1_7B, zero_stage=stage, ranks=16, tokens=19456, reference=True)
    p = R1_7B.params
    assert (part(t, "weights"), part(t, "gradients"), part(t, "optimizer")) == pytest.approx(
        (weights * p, grads * p, optim * p))
    assert part(t, "reference model") == 2 * p  # loaded beside DeepSpeed: whole under every stage


def test_an_fp32_model_keeps_two_moments_and_no_master_copy():
    t = memory.trainer_plan(R1_15B, zero_stage=2, ranks=4, tokens=4096, reference=False, dtype_bytes=4)
    assert part(t, "optimizer") == 8 * R1_15B.params / 4
    assert "reference model" not in [x.name for x in t.parts]


def test_activations_with_checkpointing_are_each_layers_input_and_one_chunk_of_logits():
    t = memory.trainer_plan(R1_15B, zero_stage=2, ranks=16, tokens=19456, reference=False)
    assert part(t, "activations") == 1536 * 28 * 19456 * 2
    assert part(t, "logits chunk") == 3 * 1024 * 151936 * 4
    without = memory.trainer_plan(R1_15B, zero_stage=2, ranks=16, tokens=19456, reference=False, checkpointing=False)
    assert part(without, "activations") == 28 * part(t, "recomputed layer")


def test_the_kv_cache_a_token_takes_splits_kv_heads_over_tensor_parallel_and_keeps_one():
    assert memory.kv_bytes_per_token(R1_15B, tp=1) == 2 * 28 * 2 * 128 * 2
    assert memory.kv_bytes_per_token(R1_7B, tp=4) == 2 * 28 * 1 * 128 * 2
    assert memory.kv_bytes_per_token(R1_7B, tp=8) == memory.kv_bytes_per_token(R1_7B, tp=4)  # replicated


def test_vllm_gets_its_share_and_the_rest_after_the_weights_is_kv_cache():
    g, tokens = memory.generation_plan(R1_15B, tp=1, gpu_bytes=80e9, utilization=0.85, max_model_len=18432)
    assert g.total == pytest.approx(0.85 * 80e9)
    assert tokens == int((0.85 * 80e9 - 2 * R1_15B.params) // 28672)
    assert "121 sequences of 18432 tokens" in g.parts[1].how


def test_a_model_folders_config_json_wins_over_the_table(tmp_path):
    folder = tmp_path / "DeepSeek-R1-Distill-Qwen-1.5B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 1000, "tie_word_embeddings": True}))
    s = shapes.model_shape(str(folder))
    assert (s.hidden, s.layers, s.tied, s.source) == (1024, 4, True, str(folder / "config.json"))
    assert shapes.model_shape("/nowhere/DeepSeek-R1-Distill-Qwen-7B").hidden == 3584  # the fallback
    assert shapes.model_shape("/nowhere/some-other-model") is None


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_gpu_preset_fits_its_declared_gpus_as_shipped(preset):
    p = plan.memory_plan(load_config(preset))
    assert p.capacity == memory.CARD_80GB
    assert p.refusal() == ""
    assert p.trainer.total < 0.5 * p.capacity  # room left for what the plan does not count (allocator, CUDA)


def test_shared_gpus_fit_in_both_turns_as_shipped(capsys):
    """1.5B_1gpu and 1.5B_n1: vLLM's share of the card as CUDA reports it (an H100 80 GB: 85.0e9
    bytes) beside the trainer's resident states while generating (its cached training peak is
    returned before the engine wakes: rl/driver/turns.py), the trainer's peak beside a sleeping
    engine while training, its CUDA context in both; both under the GPU."""
    for preset, share in [("1.5B_1gpu", 0.45 * 85.0e9), ("1.5B_n1", 0.7 * 85.0e9)]:
        p = plan.memory_plan(load_config(preset))
        assert p.shared and p.refusal() == ""
        assert p.share == pytest.approx(share)
        gen, train = p.turn_sums()
        assert gen == pytest.approx(share + p.trainer.resident + memory.TRAINER_CONTEXT) and gen < p.capacity
        assert train == p.trainer.total + memory.TRAINER_CONTEXT + memory.SLEEP_RESIDUE < p.capacity
    out = dry_run(["train", "1.5B_1gpu", "--dry-run"], capsys)
    assert ("    while generating: vLLM's 38.2 GB + the trainer's resident states 36 GB (its cached peak returned "
            "before the engine wakes) + its CUDA context 1 GB = 75.3 GB of 85 GB") in out
    assert ("    while training: the trainer's peak 41.4 GB + its CUDA context 1 GB + a sleeping engine's 3 GB "
            "(released: its weights and KV cache) = 45.4 GB of 85 GB") in out


def test_the_plan_holds_an_80_gb_card_to_what_cuda_reports_of_it(capsys):
    """Where the config names no size and no GPU is here: 85.0e9 bytes (79.2 GiB), what torch
    reports of an H100 80 GB, not 80e9; vLLM's share is gpu_memory_utilization of all of it."""
    assert memory.CARD_80GB == 85.0e9
    p = plan.memory_plan(load_config("1.5B_1gpu"))
    assert p.capacity == 85.0e9 and p.share == pytest.approx(38.25e9)
    out = dry_run(["train", "1.5B_1gpu", "--dry-run"], capsys)
    assert "memory plan per GPU of 85 GB = 79.2 GiB (gpu_memory_gb unset and no GPU here" in out


def test_deepspeed_gets_the_buckets_and_overlap_the_plan_prints():
    """ZeRO 1-2 reduce with overlap_comm, in buckets of the plan's sizes, which the plan counts
    (two reduce buckets while one reduces and the next fills) and prints; ZeRO-0 keeps DeepSpeed's
    fixed all-reduce bucket, ZeRO-3 its default overlap."""
    import torch

    from areal_kit.rl.trainer.deepspeed_zero import deepspeed_config

    actor = load_config("1.5B_n1").actor
    assert deepspeed_config(actor, torch.bfloat16)["zero_optimization"] == {
        "stage": 2, "reduce_bucket_size": memory.REDUCE_BUCKET, "allgather_bucket_size": memory.ALLGATHER_BUCKET,
        "overlap_comm": True}
    assert memory.REDUCE_BUCKET == memory.ALLGATHER_BUCKET == 50_000_000
    p = plan.memory_plan(load_config("1.5B_n1"))
    buffers = next(x for x in p.trainer.parts if x.name == "DeepSpeed buffers")
    assert buffers.nbytes == memory.REDUCE_BUCKET * (2 + 4 + 2) + memory.ALLGATHER_BUCKET * 2
    assert "reduce bucket 0.05B elements" in buffers.how and "(overlap_comm)" in buffers.how
    assert "all-gather bucket 0.05B elements" in buffers.how
    z3 = load_config("7B_n4").actor
    assert "overlap_comm" not in deepspeed_config(z3, torch.bfloat16)["zero_optimization"]
    assert deepspeed_config(load_config("tiny").actor, torch.float32)["zero_optimization"] == {"stage": 0}
    z0 = memory.trainer_plan(shapes.KNOWN_MODELS["DeepSeek-R1-Distill-Qwen-1.5B"], 0, 1, 1024, False)
    assert part(z0, "DeepSpeed buffers") == memory.ZERO0_ALLREDUCE_BUCKET * 2


def test_a_shared_gpu_that_overflows_while_generating_is_refused(capsys):
    code, _, err = run_cli(["train", "1.5B_1gpu", "--dry-run", "actor.vllm.gpu_memory_utilization=0.6"], capsys)
    assert_one_line_error(code, err, "shared GPU while generating: vLLM's 51 GB + the trainer's resident states "
                          "36 GB + its CUDA context 1 GB = 88 GB, more than the 85 GB it has",
                          "try actor.vllm.gpu_memory_utilization=0.55 or less")


def test_the_dry_run_of_a_gpu_preset_prints_both_gpus(capsys):
    lines = dry_run(["train", "1.5B_n4", "--dry-run"], capsys).splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("memory plan per GPU of 85 GB = 79.2 GiB"))
    assert lines[head + 1].startswith("  trainer GPU (ZeRO-2 over 16 rank(s), bf16): ")
    assert any(ln.startswith("  generation GPU (vLLM, TP 1, gpu_memory_utilization 0.85): 72.2 GB of 85 GB")
               for ln in lines)
    assert lines[-1] == "dry run: configuration is valid"


def test_gpu_memory_gb_sets_the_cards_size(capsys):
    out = dry_run(["train", "7B_n4", "--dry-run", "gpu_memory_gb=141"], capsys)
    assert "memory plan per GPU of 141 GB = 131 GiB (gpu_memory_gb;" in out


def test_a_zero_0_7b_is_refused_with_the_arithmetic(capsys):
    code, out, err = run_cli(["train", "7B_n4", "--dry-run", "actor.zero_stage=0"], capsys)
    assert_one_line_error(code, err, "the memory plan does not fit: trainer GPU (ZeRO-0 over 16 rank(s), bf16) needs",
                          "weights 15.2 + gradients 45.7 + optimizer 91.4 + reference model 15.2",
                          "= 178 GB, more than the 85 GB it has", "try actor.zero_stage=3")
    assert "  trainer GPU (ZeRO-0 over 16 rank(s), bf16): 178 GB of 85 GB" in out  # the plan came first


def test_a_micro_batch_whose_activations_do_not_fit_is_refused(capsys):
    code, _, err = run_cli(["train", "1.5B_n4", "--dry-run", "actor_train.mb_spec.max_tokens_per_mb=500000"], capsys)
    assert_one_line_error(code, err, "activations 43 + recomputed layer 45.6",
                          "a smaller actor_train.mb_spec.max_tokens_per_mb (now 500000)")


def test_an_engine_without_room_for_one_sequence_is_refused(capsys):
    code, _, err = run_cli(["train", "7B_n4", "--dry-run", "allocation_mode=vllm.d16p1m1+d8p2m1",
                            "actor.vllm.gpu_memory_utilization=0.19"], capsys)
    assert_one_line_error(code, err, "generation GPU (vLLM, TP 1, gpu_memory_utilization 0.19): its share 16.1 GB - "
                          "weights 15.2 GB leaves KV cache for", "fewer than one sequence of 18432")


def test_on_cpu_there_is_no_memory_plan_and_an_unknown_model_is_said(capsys, monkeypatch):
    assert "memory plan: skipped: the shape of tiny://toy is unknown" in dry_run(["train", "tiny", "--dry-run"], capsys)
    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    assert "memory plan" not in dry_run(["train", "tiny", "--dry-run"], capsys)

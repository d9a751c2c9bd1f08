"""The GPU acceptance suite's parts that run without a GPU (tests/gpu/acceptance.py): which layouts
a node runs, their settings (each a valid config that the dry run accepts on GPUs), the table it
prints, the eval accuracy recomputed from the graded records, and the arithmetic its checks decide
with (logprob gaps, a sync seen to happen, sleep's freed memory, reserved memory against the plan);
and, on vLLM's own sampler, that the logprobs the engine returns are the trainer's at a temperature.

    .venv/bin/python -m pytest tests/unit/test_gpu_acceptance_helpers.py -q
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import acceptance

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.rl import memory, shapes, sharing
from areal_kit.rl.algo.functional import gather_logprobs
from areal_kit.rl.driver import placement
from areal_kit.rl.engine.worker import RolloutWorker, engine_kwargs

pytestmark = pytest.mark.unit
CUDA = hardware.Platform("cuda", "nccl", "vllm")


def test_one_gpu_runs_the_tiny_preset_and_the_small_model_taking_turns():
    names = [c.name for c in acceptance.cases_for(1)]
    assert names == ["tiny_1gpu", "shared_1gpu_zero2"]
    assert all(c.shared for c in acceptance.cases_for(1))
    eight = {c.name for c in acceptance.cases_for(8)}
    assert {"zero2", "zero3", "two_engines_zero2", "tp2_zero3", "shared_tp2_zero2"} <= eight


@pytest.mark.parametrize("case", acceptance.CASES, ids=[c.name for c in acceptance.CASES])
def test_every_case_is_a_layout_the_gpu_run_accepts(case):
    cfg = load_config("tiny", case.overrides("/models/small", 2))
    a = parse_allocation(cfg.allocation_mode)
    a.check(cfg.n_nodes, cfg.n_gpus_per_node)
    assert (a.gen.dp, a.gen.tp, a.kind != "decoupled") == (case.engines, case.tp, case.shared)
    sharing.check(cfg, CUDA)  # no setting a shared layout refuses
    assert case.used <= case.gpus
    layout = placement.on_nodes(a, CUDA, 1, case.used)
    assert layout.shared == case.shared
    assert cfg.actor.zero_stage == case.zero and cfg.exp_ctrl.total_train_steps == 2


def test_the_table_times_each_check_and_says_which_failed():
    t = acceptance.Table(header="node: 1 x H100")
    with t.check("a", "first") as info:
        info["detail"] = "gap 1e-3 | fine"
    with pytest.raises(AssertionError), t.check("a", "second"):
        raise AssertionError("gap 0.3\nmore lines")
    assert [(r.check, r.outcome, r.detail) for r in t.rows] == [("first", "ok", "gap 1e-3 | fine"),
                                                                 ("second", "FAILED", "gap 0.3")]
    lines = t.render().splitlines()
    assert lines[0] == "node: 1 x H100" and lines[1].startswith("| case | check | seconds |")
    assert lines[3].startswith("| a | first | 0.0 | ok | gap 1e-3 / fine |")


def test_the_eval_accuracy_comes_from_the_graded_greedy_records(tmp_path):
    recs = [{"mode": "greedy", "correct": c} for c in (True, False, False, True)]
    recs += [{"mode": "sample", "correct": True}] * 3
    f = tmp_path / "samples.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert acceptance.greedy_acc_from(f) == (50.0, 4)


def test_every_case_samples_at_the_gpu_presets_temperature_through_processed_logprobs():
    """The suite's logprob check is the PPO ratio's only if the engine returns each sampled token's
    logprob after temperature, at a temperature where that differs from before it."""
    assert acceptance.TEMPERATURE == load_config("1.5B_1gpu").ppo.gen.temperature != 1.0
    for case in acceptance.CASES:
        cfg = load_config("tiny", case.overrides("/models/small", 2))
        assert cfg.ppo.gen.temperature == acceptance.TEMPERATURE, case.name
    assert engine_kwargs(cfg, CUDA, "/models/small", 0, 1)["logprobs_mode"] == "processed_logprobs"
    worker = RolloutWorker.__new__(RolloutWorker)
    worker.cfg = cfg
    params = worker._params(seed=3, n=8)
    assert (params.logprobs, params.temperature, params.min_tokens) == (0, acceptance.TEMPERATURE, 0)


def _vllm_sampler(mode: str, logits, temperature: float):
    """vLLM's own sampler on CPU: (sampled tokens, the logprobs it returns for them)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    b = logits.shape[0]
    md = SamplingMetadata(temperature=torch.full((b,), temperature), all_greedy=False, all_random=True, top_p=None,
                          top_k=None, generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
                          frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
                          repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
                          allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    out = Sampler(logprobs_mode=mode)(logits.clone(), md)
    tokens = out.sampled_token_ids.view(-1).long()
    assert out.logprobs_tensors.logprob_token_ids[:, 0].long().tolist() == tokens.tolist()  # column 0: the sampled
    return tokens, out.logprobs_tensors.logprobs[:, 0]


def test_vllms_processed_logprobs_are_the_trainers_at_a_temperature_and_raw_ones_are_not():
    import torch

    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)) * 3
    tokens, processed = _vllm_sampler("processed_logprobs", logits, acceptance.TEMPERATURE)
    trainer, _ = gather_logprobs(logits, tokens, acceptance.TEMPERATURE)
    assert torch.allclose(processed, trainer, atol=1e-5)
    # Raw logprobs (and prompt logprobs, which are always raw) ignore the temperature.
    tokens, raw = _vllm_sampler("raw_logprobs", logits, acceptance.TEMPERATURE)
    trainer, _ = gather_logprobs(logits, tokens, acceptance.TEMPERATURE)
    assert (raw - trainer).abs().max() > 0.5


def test_the_logprob_gap_is_the_largest_over_every_token_of_matching_answers():
    assert acceptance.logprob_gap([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.25]]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="answer 1: the engine gave 1 logprobs, the trainer 2"):
        acceptance.logprob_gap([[-1.0], [-2.0]], [[-1.0], [-2.0, -3.0]])
    with pytest.raises(ValueError, match="0 engine answers against 0"):
        acceptance.logprob_gap([], [])


def test_a_sync_must_be_seen_to_change_the_engines():
    assert acceptance.sync_failures(before=2.0, after=0.01, tolerance=0.05) == []
    [never] = acceptance.sync_failures(before=0.01, after=0.01, tolerance=0.05)  # a sync that never happened
    assert never.startswith("before the sync the engines were already within 0.01")
    [stale] = acceptance.sync_failures(before=2.0, after=2.0, tolerance=0.05)  # one that did not land
    assert stale == "after the sync the engines miss the trainer by 2 (tolerance 0.05)"


def test_sleep_must_free_the_engines_share_and_wake_take_it_back():
    total, util = 85.0e9, 0.45  # an H100's reported capacity; vLLM's share 38.25 GB, less 3 GB kept asleep
    awake = 10e9
    assert acceptance.sleep_failures(awake, awake + 36e9, awake + 0.5e9, total, util) == []
    # A sleep that ran but released only the weights (the KV cache kept) fails, and so does a
    # wake that leaves the KV cache off the GPU.
    freed, _ = acceptance.sleep_failures(awake, awake + 3.5e9, awake, total, util)
    assert freed.startswith("sleep freed 3.5 GB, less than the engine's share 38.2 GB (0.45 x 85 GB) - 3 GB")
    [woke] = acceptance.sleep_failures(awake, awake + 36e9, awake + 33e9, total, util)
    assert woke.startswith("wake_up took back 3 GB, less than")
    assert acceptance.sleep_failures(awake, awake + 36e9, awake, total, util, allowance=1e9)  # a tighter allowance


def test_a_trainer_rank_is_held_to_the_plan_by_what_it_reserves():
    shape = shapes.KNOWN_MODELS["DeepSeek-R1-Distill-Qwen-1.5B"]
    plan = memory.trainer_plan(shape, zero_stage=2, ranks=1, tokens=19456, reference=True)
    assert acceptance.reserved_failures(plan.total, plan.resident, plan.total, plan.resident) == []
    # Its cache not returned: the training peak stays reserved through generation.
    [kept] = acceptance.reserved_failures(plan.total, plan.total, plan.total, plan.resident)
    assert kept.startswith(f"the trainer kept {memory.gb(plan.total)} reserved after returning its cache")
    # Allocated within the plan is not enough: the allocator's blocks beyond it count.
    [peak] = acceptance.reserved_failures(plan.total + 1e9, plan.resident, plan.total, plan.resident)
    assert peak.startswith("the trainer reserved")

"""The plain parts of streaming rollouts: per-token weight versions from vLLM's spans, a sample's
interrupted flag, which requests an update aborts as too stale, the loader's batch by index (what
a resumed stream regenerates), the rollout section's validation, and the pending prompts a recover
checkpoint carries."""

from types import SimpleNamespace

import pytest

from areal_kit.config.loader import load_config
from areal_kit.data.prompts import PromptLoader
from areal_kit.errors import UserError
from areal_kit.rl.driver import recover
from areal_kit.rl.engine.streaming_llm import stale_requests, token_versions
from areal_kit.rl.sample import Sample


def test_token_versions_follow_vllms_spans():
    spans = [SimpleNamespace(version="3", start=0, end=2), SimpleNamespace(version="4", start=2, end=5)]
    assert token_versions(spans, 5, default=9) == [3, 3, 4, 4, 4]
    assert token_versions(None, 3, default=7) == [7, 7, 7]  # no label reported: the engine's own version


def test_the_requests_aborted_at_an_update_are_those_begun_before_the_bound():
    running = [("r1", [("2", 0), ("4", 9)]),  # began at 2: interrupted twice, still too old at 4 - 1
               ("r2", [("3", 0)]),  # began at 3: trainable at version 4 under k = 1
               ("r3", []),  # queued, not sampled yet: its first token comes from the new weights
               ("r4", [("1", 0)]), ("r4", [("3", 0)])]  # two answers of one request: the older decides
    assert stale_requests(running, before=3) == ["r1", "r4"]
    assert stale_requests(running, before=1) == []
    assert stale_requests(running, before=10) == ["r1", "r2", "r4"]


def _sample(versions):
    return Sample(id="a", group=0, prompt_ids=[1], output_ids=[2] * len(versions or [0]), logprobs=[0.0],
                  no_eos=False, version=min(versions or [0]), task_reward=0.0, versions=versions)


def test_a_sample_is_interrupted_when_its_tokens_span_two_versions():
    assert _sample([1, 1, 2]).interrupted
    assert not _sample([2, 2]).interrupted
    assert not _sample(None).interrupted


def test_batch_at_gives_what_next_batch_gave_across_epochs():
    rows = [{"id": str(i)} for i in range(10)]
    loader = PromptLoader(rows, batch_size=3, seed=4)
    taken = [loader.next_batch() for _ in range(7)]  # 3 batches an epoch: across two epoch ends
    probe = PromptLoader(rows, batch_size=3, seed=4)
    assert [probe.batch_at(i) for i in range(7)] == taken
    assert probe.position == 0 and probe.epoch == 0  # it does not move the loader


def test_rollout_mode_and_interrupt_are_validated_in_one_line():
    cfg = load_config("tiny", ["rollout.mode=stream", "rollout.interrupt=wait"])
    assert (cfg.rollout.mode, cfg.rollout.interrupt) == ("stream", "wait")
    assert load_config("tiny").rollout.mode == "batch"
    with pytest.raises(UserError, match="rollout.mode"):
        load_config("tiny", ["rollout.mode=async"])
    assert load_config("tiny").rollout.max_restarts == 1
    with pytest.raises(UserError, match=r"rollout.max_restarts=-1; expected an integer >= 0"):
        load_config("tiny", ["rollout.max_restarts=-1"])


def test_a_checkpoints_pending_prompts_come_back_in_the_run_state():
    state = {"version": 4, "batches": 6, "loader": {}, "timer": {}, "pending": [[4, 1], [5, 0]]}
    ck = SimpleNamespace(state=state, global_step=4, path="/ck")
    assert recover.run_state(ck).pending == [[4, 1], [5, 0]]
    old = {k: v for k, v in state.items() if k != "pending"}  # written by batch mode
    assert recover.run_state(SimpleNamespace(state=old, global_step=4, path="/ck")).pending == []


def test_the_dry_run_says_how_the_engines_generate():
    from areal_kit.rl.plan import _rollout_line

    assert _rollout_line(load_config("tiny")).startswith("rollout: batch")
    line = _rollout_line(load_config("tiny", ["rollout.mode=stream", "ppo.max_head_offpolicyness=2"]))
    assert "at most 96 prompts in flight or untrained" in line and "pause and resume" in line
    assert "wait for" in _rollout_line(load_config("tiny", ["rollout.mode=stream", "rollout.interrupt=wait"]))

"""The workflow plug-in (rl/workflow.py) with a fake engine: generation calls of concurrent episodes
are batched per turn, results reach the right episode, bad workflows fail clearly; and the trainer's
loss mask."""

from __future__ import annotations

import asyncio

import pytest

from areal_kit import api
from areal_kit.config.schema import GenConfig
from areal_kit.errors import UserError
from areal_kit.rl import workflow
from areal_kit.rl.algo.packing import Answers
from areal_kit.rl.algo.ppo import loss_masks
from areal_kit.rl.sample import TrainerRow


class FakeTok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeLLM:
    """Answers prompt p with n completions [sum(p) % 50 + k] (k = 0..n-1); records each batch."""

    def __init__(self):
        self.batches = []

    def __call__(self, requests):
        self.batches.append([(list(r.prompt_ids), r.n, r.max_tokens) for r in requests])
        return [[api.Completion([sum(r.prompt_ids) % 50 + k], [-0.5], "length" if r.max_tokens == 1 else "stop")
                 for k in range(r.n)] for r in requests]


def _engine(group_size=2, max_len=64):
    llm = FakeLLM()
    gen = GenConfig(max_new_tokens=8, temperature=1.0)
    return llm, workflow.Engine(llm, FakeTok(), gen, group_size, max_len)


ROWS = [{"id": f"r{i}", "prompt_ids": [10 + i, 20], "seed": i} for i in range(3)]


def test_single_turn_is_one_batched_call():
    llm, eng = _engine()
    groups = workflow.run_episodes(workflow.single_turn, eng, ROWS)
    assert len(llm.batches) == 1
    assert [b[1] for b in llm.batches[0]] == [2, 2, 2]
    assert [[t.output_ids for t in g] for g in groups] == [[[30], [31]], [[31], [32]], [[32], [33]]]
    assert all(t.loss_mask is None and t.reward is None for g in groups for t in g)


async def two_turn(engine, row):
    first = await engine.generate(row["prompt_ids"], n=engine.group_size)
    hint = engine.encode("?")
    out = []
    for c in first:
        [second] = await engine.generate(row["prompt_ids"] + c.token_ids + hint, max_tokens=1)
        out.append(api.Trajectory(c.token_ids + hint + second.token_ids, c.logprobs + [0.0] + second.logprobs,
                                loss_mask=[1, 0, 1], no_eos=second.no_eos, reward=float(len(row["id"]))))
    return out


def test_two_turn_episodes_batch_each_turn_across_prompts():
    llm, eng = _engine()
    groups = workflow.run_episodes(two_turn, eng, ROWS)
    # turn 1: the 3 prompts together; turn 2: each episode's completions one at a time, but all
    # episodes' first follow-ups in one batch, then all second follow-ups
    assert [len(b) for b in llm.batches] == [3, 3, 3]
    t = groups[1][0]
    p2 = ROWS[1]["prompt_ids"] + [31] + [ord("?")]
    assert t.output_ids == [31, ord("?"), sum(p2) % 50]
    assert t.loss_mask == [1, 0, 1]
    assert t.no_eos
    assert t.logprobs == [-0.5, 0.0, -0.5]
    assert t.reward == 2.0


class ClassFlow:
    def __init__(self):
        self.calls = 0

    async def arun_episode(self, engine, row):
        self.calls += 1
        await asyncio.sleep(0.001)  # waiting on something else (a tool) is fine
        return await workflow.single_turn(engine, row)


def test_load_default_function_and_class(tmp_path):
    assert workflow.load("") is workflow.single_turn
    (tmp_path / "flows.py").write_text(
        "from areal_kit.rl.workflow import single_turn\n"
        "class Flow:\n    async def arun_episode(self, engine, row):\n        return await single_turn(engine, row)\n"
        "def sync_flow(engine, row):\n    return []\n")
    fn = workflow.load(f"{tmp_path}/flows.py:Flow")
    _, eng = _engine()
    assert len(workflow.run_episodes(fn, eng, ROWS[:1])[0]) == 2
    with pytest.raises(UserError, match="is not an async function"):
        workflow.load(f"{tmp_path}/flows.py:sync_flow")
    with pytest.raises(UserError, match="does not import"):
        workflow.load("no_such_pkg.flows:f")


def test_load_agent_takes_any_function_and_refuses_the_rest():
    from areal_kit.agents.calculator import openai_agent

    assert workflow.load_agent("areal_kit.agents.calculator:openai_agent") is openai_agent
    with pytest.raises(UserError, match="'areal_kit.agents.calculator:NAME' is a str, not a function"):
        workflow.load_agent("areal_kit.agents.calculator:NAME")
    with pytest.raises(UserError, match="does not import"):
        workflow.load_agent("no_such_pkg.agents:run")


def test_episodes_waiting_on_other_things_still_finish():
    flow = ClassFlow()
    _, eng = _engine()
    groups = workflow.run_episodes(flow.arun_episode, eng, ROWS)
    assert flow.calls == 3
    assert all(len(g) == 2 for g in groups)


@pytest.mark.parametrize("make, msg", [
    (lambda c: [api.Trajectory(c.token_ids, c.logprobs)], "expected a list of ppo.group_size=2"),
    (lambda c: [api.Trajectory(c.token_ids, [])] * 2, "but 0 logprobs"),
    (lambda c: [api.Trajectory(c.token_ids, c.logprobs, loss_mask=[0])] * 2, "loss_mask is all 0"),
    (lambda c: [api.Trajectory([], [])] * 2, "no output tokens"),
])
def test_bad_trajectories_fail_clearly(make, msg):
    async def flow(engine, row):
        [c] = await engine.generate(row["prompt_ids"])
        return make(c)

    with pytest.raises(ValueError, match=msg):
        workflow.run_episodes(flow, _engine()[1], ROWS[:1])


def test_prompt_too_long_for_the_engine():
    async def flow(engine, row):
        await engine.generate(list(range(64)))

    with pytest.raises(ValueError, match="leaves no room"):
        workflow.run_episodes(flow, _engine(max_len=64)[1], ROWS[:1])


def test_trainer_loss_masks_are_flat_over_the_shard():
    plain, masked = TrainerRow([1], [5, 6, 7]), TrainerRow([1], [8, 9, 10], loss_mask=[1, 0, 1])
    assert loss_masks([plain], Answers([3])).tolist() == [1.0, 1.0, 1.0]
    # A sample without a mask keeps all its tokens beside one with a mask.
    assert loss_masks([masked, plain], Answers([3, 3])).tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_a_batch_calls_sampling_seed_comes_from_its_requests_seeds_in_any_process():
    """workflow.call_seed: a batch-mode engine call samples from one seed mixed from its requests'
    seeds (None for a request without one). The same call gets the same seed in another process,
    whatever its hash randomization (a resumed run's engine is a new process); another call,
    the same seeds in another order included, gets another."""
    import os
    import subprocess
    import sys

    from areal_kit.rl.workflow import call_seed

    here = call_seed([11, None, 12])
    code = "from areal_kit.rl.workflow import call_seed; print(call_seed([11, None, 12]))"
    there = subprocess.check_output([sys.executable, "-c", code], text=True,
                                    env={**os.environ, "PYTHONHASHSEED": "7"})
    assert int(there) == here
    assert len({here, call_seed([12, None, 11]), call_seed([11, 0, 12]), call_seed([11, 12])}) == 4
    assert 0 <= here < 2**63 - 1

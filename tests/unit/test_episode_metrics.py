"""What a step's episodes did (episode/*), from hand-built trajectories through the rollout worker's
Sample to the step's metrics; the calls a workflow's engine and the chat endpoint count as refused
or failed; the endpoint naming a LoRA adapter by the version it records; and the plot's panel of
the share of episodes that call a tool.

    .venv/bin/python -m pytest tests/unit/test_episode_metrics.py -q
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from areal_kit.api import Completion, Trajectory, Turn
from areal_kit.config.schema import GenConfig
from areal_kit.curves import extra_panels, write_png
from areal_kit.rl import workflow
from areal_kit.rl.algo.batch import episode_stats
from areal_kit.rl.engine.worker import _sample

pytestmark = pytest.mark.unit

ROW = {"id": "q", "prompt_ids": [1, 2, 3]}


def model(*ids):
    return Turn.model(Completion(list(ids), [-0.5] * len(ids), "stop"))


def env(*ids):
    return Turn.env(list(ids))


def test_an_episode_without_a_call_and_one_with_two_make_the_step_s_means():
    answer = Trajectory.from_turns([model(7, 8, 9)])  # answered straight away
    # call, result, call, result, answer: the model wrote 2 + 2 + 1 tokens, the tools 3 + 1
    two = Trajectory.from_turns([model(4, 5), env(6, 6, 6), model(4, 5), env(6), model(9)])
    assert (answer.n_turns, answer.n_tool_calls, answer.n_env_tokens) == (1, 0, 0)
    assert (two.n_turns, two.n_tool_calls, two.n_env_tokens, two.n_model_tokens) == (3, 2, 4, 5)
    samples = [_sample(ROW, 0, t, 0, 0.0, None) for t in (answer, two)]
    assert [(s.turns, s.tool_calls) for s in samples] == [(1, 0), (3, 2)]
    assert episode_stats(samples, failed_calls=3) == {
        "episode/turns": 2.0, "episode/tool_calls": 1.0, "episode/tool_call_share": 0.5,
        "episode/segments": 1.0, "episode/failed_calls": 3, "episode/env_tokens": 2.0, "episode/model_tokens": 4.0}


def test_what_counts_as_a_tool_call():
    # A call nothing answered (the episode ends on it) is not one; a single-turn answer has none.
    assert Trajectory.from_turns([model(4), env(6), model(4)]).n_tool_calls == 1
    assert Trajectory.from_turns([model(4)]).n_tool_calls == 0
    plain = Trajectory([7, 8, 9], [-0.5] * 3)
    assert (plain.n_turns, plain.n_tool_calls, plain.n_env_tokens) == (1, 0, 0)
    # A workflow that sets the loss mask by hand: its masked tokens are the environment's.
    masked = Trajectory([7, 8, 9, 10], [-0.5, 0.0, 0.0, -0.5], loss_mask=[1, 0, 0, 1])
    s = _sample(ROW, 0, masked, 0, 0.0, None)
    assert episode_stats([s], 0)["episode/env_tokens"] == 2.0
    assert episode_stats([s], 0)["episode/model_tokens"] == 2.0


def test_the_workflow_engine_counts_the_calls_it_refused_or_that_failed():
    def broken(requests):
        raise RuntimeError("engine gone")

    class Tok:
        pass

    engine = workflow.Engine(broken, Tok(), GenConfig(max_new_tokens=4), 2, max_model_len=8)

    async def episode(eng, row):
        for prompt in ([1] * 8, [1, 2]):  # no room left; then vLLM fails
            try:
                await eng.generate(prompt)
            except (ValueError, RuntimeError):
                pass
        return [Trajectory([5], [-0.1]), Trajectory([5], [-0.1])]

    workflow.run_episodes(episode, engine, [ROW, {**ROW, "id": "r"}])
    assert engine.failed_calls == 2 + 2


@pytest.mark.slow  # vLLM's imports: its error response and LoRARequest
def test_the_endpoint_counts_error_answers_and_names_the_version_s_adapter():
    from areal_kit.rl import lora
    from areal_kit.rl.engine.endpoint import ChatEndpoint

    ep = ChatEndpoint(SimpleNamespace(version=0), "/m", "policy", adapter=lora.request)
    key = ep.open_episode()

    async def app(scope, receive, send):  # vLLM's routes: a 400 for one path, a 200 for the other
        status = 400 if scope["path"] == "/bad" else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(path, bearer):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": path, "method": "POST", "headers": [(b"authorization", bearer)]}
        await ep._auth(app)(scope, receive, send)
        return sent[0]["status"]

    statuses = [asyncio.run(call(p, b)) for p, b in (("/ok", f"Bearer {key}".encode()), ("/bad", f"Bearer {key}".encode()),
                                                     ("/ok", b"Bearer nosuchkey"))]
    assert statuses == [200, 400, 401]
    assert ep.take_failed_calls() == 2 and ep.take_failed_calls() == 0

    # LoRA: version 0 is the base (the fresh adapter is zero); a later version names the adapter
    # under a name vLLM's models serve, the name vLLM resolves the call's adapter by.
    ep._models = SimpleNamespace(lora_requests={})
    request = SimpleNamespace(model="policy")
    ep._serve_adapter(request, 0)
    assert request.model == "policy" and ep._models.lora_requests == {}
    ep._serve_adapter(request, 3)
    served = ep._models.lora_requests[request.model]
    assert served.lora_int_id == lora.SERVED_ID and request.model == served.lora_name != "policy"
    # Without an adapter (a full-weight run, or actor.lora.sync=merged) the base's name stays.
    full = ChatEndpoint(SimpleNamespace(version=0), "/m", "policy")
    request = SimpleNamespace(model="policy")
    full._serve_adapter(request, 3)
    assert request.model == "policy"


def test_plot_draws_the_tool_call_share_when_the_run_logged_it(tmp_path):
    rows = [{"global_step": i, "task_reward": 0.1 * i, "episode/tool_call_share": 0.15 * i} for i in range(1, 7)]
    assert extra_panels(rows) == [("episodes that call a tool (episode/tool_call_share)", "share of episodes",
                                   ["episode/tool_call_share"])]
    out = tmp_path / "m.png"
    write_png(rows, str(out))
    assert out.stat().st_size > 10_000
    assert extra_panels([{"global_step": 1, "task_reward": 0.0}]) == []

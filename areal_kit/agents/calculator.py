"""The calculator task's tool-using episode: a two-digit sum, a calculator the model may call, and
an answer graded at the end (the tiny_tool preset, train_scripts/tiny_tool.yaml).

The model (tiny://tool: it knows how a call and its use are written, not when to call) answers
"4 7 + 3 8 =" either straight away, or with a call, "<tool_call> 4 7 + 3 8 </tool_call>" then eos;
the calculator's reply, "<tool_response> 8 5 </tool_response>", enters the context (not trained
on), and the model writes its answer. The calc reward grades the model's last turn, so a call pays
only when the model copies the question into it and the reply into its answer.

The same episode as an agent written against the `openai` client (openai_agent): the chat
endpoint renders the chat with the model's template to the same tokens, and the calc tool parser
hands the call back as tool_calls.

    areal-kit train tiny_tool                                  # learns to call the calculator
    areal-kit train tiny_tool ppo.workflow=""                  # the same task without the tool
    areal-kit train tiny_tool ppo.workflow= agent.fn=areal_kit.agents.calculator:openai_agent agent.tool_parser=calc
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import TYPE_CHECKING, cast

from openai import AsyncOpenAI

from areal_kit.agent_client import http_client
from areal_kit.api import Completion, EpisodeEngine, Trajectory, Turn
from areal_kit.data.toy_task import CALL, END_CALL, calculate, tool_response

if TYPE_CHECKING:
    from openai.types.chat import (
        ChatCompletionAssistantMessageParam,
        ChatCompletionFunctionToolParam,
        ChatCompletionMessageParam,
    )

NAME = "calculator"
TOOL: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": NAME, "description": "Adds or subtracts two numbers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "a + b"}},
                   "required": ["expression"]}}}


def called(text: str) -> str | None:
    """The expression of a model turn that is a call and nothing else, "<tool_call> 4 7 + 3 8
    </tool_call>"; None for any other turn (an answer, or a call with text around it, which the
    calculator does not run: the format is part of what the model must get right)."""
    text = text.strip()
    if not (text.startswith(CALL) and text.endswith(END_CALL)):
        return None
    expression = text[len(CALL):-len(END_CALL)]
    return None if CALL in expression or END_CALL in expression else expression.strip()


async def calculator(engine: EpisodeEngine, row: dict) -> list[Trajectory]:
    """group_size episodes of one prompt: answer, or call the calculator and then answer."""
    first = await engine.generate(row["prompt_ids"], n=engine.group_size, seed=row["seed"])

    async def finish(i: int, c: Completion) -> Trajectory:
        expression = None if c.no_eos else called(engine.decode(c.token_ids))
        if expression is None:
            return Trajectory.from_turns([Turn.model(c)], no_eos=c.no_eos)
        reply = engine.encode(tool_response(calculate(expression)))
        [answer] = await engine.generate(row["prompt_ids"] + c.token_ids + reply, seed=row["seed"] + 1 + i)
        return Trajectory.from_turns([Turn.model(c), Turn.env(reply), Turn.model(answer)], no_eos=answer.no_eos)

    return list(await asyncio.gather(*(finish(i, c) for i, c in enumerate(first))))


async def openai_agent(base_url: str, api_key: str, row: dict) -> None:
    """The calculator episode as any OpenAI-client agent is written: ask; where the reply calls the
    tool, run it and ask again with its result. The reward is left to ppo.reward_fns (calc)."""
    client = _client(base_url, api_key)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": row["question"]}]
    reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])).choices[0]
    if reply.message.tool_calls and reply.finish_reason != "length":
        # The reply as the next request's assistant message: the same fields, as a plain dict.
        messages.append(cast("ChatCompletionAssistantMessageParam", reply.message.model_dump(exclude_none=True)))
        for call in reply.message.tool_calls:
            assert call.type == "function", "the request offers one tool, a function"
            result = calculate(json.loads(call.function.arguments).get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL])


_local = threading.local()


def _client(base_url: str, api_key: str) -> AsyncOpenAI:
    """An AsyncOpenAI client with the episode's key, one per thread and event loop: building a
    client builds its pool and an SSL context, ~25 ms, many times an episode's cost here
    (with_options shares the pool). Beside the engine (agent.fn), its calls go in process to the
    endpoint's app (agent_client: no sockets, no pool to scan); elsewhere, over HTTP."""
    loop = asyncio.get_running_loop()
    if getattr(_local, "loop", None) is not loop or _local.url != base_url:
        _local.loop, _local.url = loop, base_url
        _local.client = AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, http_client=http_client(base_url))
    return _local.client.with_options(api_key=api_key)

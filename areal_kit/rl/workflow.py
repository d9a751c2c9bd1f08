"""The rollout workflow's runtime on the rollout worker: the engine a workflow awaits, batching the
calls of every episode waiting at once into one vLLM call, and the default single-turn workflow.
The contract a user writes against (Trajectory, Completion, the engine's calls) is areal_kit/api.py.

    python -m pytest tests/unit/test_workflow.py
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from areal_kit.api import AgentReward, Completion, EpisodeEngine, Trajectory, Workflow
from areal_kit.errors import UserError
from areal_kit.reward.plugins import load_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from areal_kit.config.schema import GenConfig

# What agent.fn names: api.Agent, or its synchronous form.
AgentFn = Callable[[str, str, dict], Awaitable[AgentReward] | AgentReward]


@dataclass
class Request:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    seed: int | None
    temperature: float
    future: asyncio.Future


class Engine:
    """What a workflow sees: batched generation on the rollout worker's vLLM engine.

    `generate_batch(requests) -> list[list[Completion]]` does the real work (one vLLM call);
    requests pile up while workflows await them and are flushed together by run_episodes.
    `failed_calls` counts the calls it refused (a prompt with no room left) or that failed in vLLM,
    which a workflow may catch and go on from (the step's episode/failed_calls).
    """

    def __init__(self, generate_batch: Callable[[list[Request]], list[list[Completion]]],
                 tokenizer: PreTrainedTokenizerBase, gen: GenConfig, group_size: int, max_model_len: int) -> None:
        self._generate_batch = generate_batch
        self.tokenizer, self.gen, self.group_size = tokenizer, gen, group_size
        self.max_model_len = max_model_len
        self.pending: list[Request] = []
        self.failed_calls = 0

    async def generate(self, prompt_ids: list[int], n: int = 1, max_tokens: int | None = None,
                       seed: int | None = None, temperature: float | None = None) -> list[Completion]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            self.failed_calls += 1
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens leaves no room in the engine's "
                             f"{self.max_model_len} positions (dataset.max_prompt_len + ppo.gen.max_new_tokens)")
        max_tokens = min(max_tokens or self.gen.max_new_tokens, room)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(Request(list(prompt_ids), n, max_tokens, seed,
                                    self.gen.temperature if temperature is None else temperature, fut))
        return await fut

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        # One sequence of ids decodes to one text (transformers types any decode's as str | list[str]).
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

    def flush(self) -> None:
        batch, self.pending = self.pending, []
        try:
            results = self._generate_batch(batch)
        except Exception as e:  # noqa: BLE001 - fails the waiting workflows, not the loop
            self.failed_calls += len(batch)
            for r in batch:
                r.future.set_exception(e)
            return
        for r, res in zip(batch, results):
            r.future.set_result(res)


def call_seed(seeds: list[int | None]) -> int:
    """One sampling seed for a call's requests, from theirs (None for a request without one)."""
    digest = hashlib.blake2b(repr(seeds).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63 - 1)


async def single_turn(engine: EpisodeEngine, row: dict) -> list[Trajectory]:
    """The default workflow: group_size samples of one prompt; reward_fns score them."""
    outs = await engine.generate(row["prompt_ids"], n=engine.group_size, seed=row.get("seed"))
    return [Trajectory(o.token_ids, o.logprobs, no_eos=o.no_eos, versions=o.versions) for o in outs]


def load(spec: str) -> Workflow:
    """The episode coroutine function of a ppo.workflow spec ("" = single_turn)."""
    if not spec:
        return single_turn

    obj = load_object(spec, "workflow")
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise UserError(f"workflow {spec!r}: the class could not be created without arguments "
                            f"({type(e).__name__}: {e})") from None
    fn = getattr(obj, "arun_episode", obj)
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"workflow {spec!r} is not an async function (engine, row) or a class with "
                        "`async def arun_episode(self, engine, row)`")
    return fn


def load_agent(spec: str) -> AgentFn:
    """The function of an agent.fn spec: (base_url, api_key, row) -> reward or None, async or not."""
    fn = load_object(spec, "agent")
    if not callable(fn):
        raise UserError(f"agent {spec!r} is a {type(fn).__name__}, not a function; expected "
                        "(base_url, api_key, row) -> reward or None")
    return fn


async def _settle(engine: Engine, tasks: list[asyncio.Task]) -> None:
    """Yield until every episode waits on the engine, is done, or waits on something else."""
    last = None
    for _ in range(100):
        await asyncio.sleep(0)
        now = (len(engine.pending), sum(t.done() for t in tasks))
        if now == last:
            return
        last = now


def run_episodes(episode: Workflow, engine: Engine, rows: list[dict]) -> list[list[Trajectory]]:
    """Run the episode of every row concurrently, batching their generation calls."""

    async def main() -> list[list[Trajectory]]:
        tasks = [asyncio.ensure_future(episode(engine, row)) for row in rows]
        while not all(t.done() for t in tasks):
            await _settle(engine, tasks)
            if engine.pending:
                engine.flush()
            elif not all(t.done() for t in tasks):
                # Episodes wait on something other than the engine (a tool call): let it run.
                await asyncio.wait([t for t in tasks if not t.done()], timeout=0.01,
                                   return_when=asyncio.FIRST_COMPLETED)
        return [t.result() for t in tasks]

    groups = asyncio.run(main())
    for row, group in zip(rows, groups):
        if not isinstance(group, list) or len(group) != engine.group_size \
                or not all(isinstance(t, Trajectory) for t in group):
            raise ValueError(f"the workflow returned {type(group).__name__} of "
                             f"{len(group) if isinstance(group, list) else '?'} for prompt {row['id']!r}; "
                             f"expected a list of ppo.group_size={engine.group_size} Trajectory")
        for t in group:
            t.check()
    return groups

"""An agent written against an OpenAI-style client, run as the workflow of its episodes (agent.fn).

Each of a prompt's ppo.group_size episodes gets a key of its own on the engine's chat endpoint
(endpoint.py); the agent runs with the endpoint's base URL and that key, and the calls it made,
recorded token-exact, are joined into the episode's trajectory (segments.py: the model's tokens
trained on, the chat template's and the tools' tokens context only; a call that does not extend
the chat so far starts a segment of its own). An agent that raises, overruns agent.timeout_s of
its own time (its calls' time in the endpoint, queued or generating, does not count), or returns
what is no reward (a list of another length than its answered calls) is run again with a new key
and seed, up to agent.attempts times, so the step still fills; each drop is counted by kind and
reaches the step's metrics (agent/dropped).

    episode = AgentEpisodes(load_object(cfg.agent.fn, "agent"), endpoint, base_url, cfg.agent)
    groups = workflow.run_episodes(episode, engine, rows)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from areal_kit.api import EpisodeEngine, Trajectory
from areal_kit.rl.engine.endpoint import ChatEndpoint
from areal_kit.rl.engine.segments import episode_of
from areal_kit.rl.workflow import AgentFn, call_seed

if TYPE_CHECKING:
    from areal_kit.config.agent import AgentConfig


class AgentFailed(RuntimeError):
    """Every try of one episode failed: the rollout cannot fill its step."""


class AgentEpisodes:
    def __init__(self, fn: AgentFn, endpoint: ChatEndpoint, base_url: str, agent: AgentConfig) -> None:
        self.fn, self.endpoint, self.base_url = fn, endpoint, base_url
        self.spec, self.timeout_s, self.attempts = agent.fn, agent.timeout_s, agent.attempts
        self.failures: dict[str, tuple[int, str]] = {}  # {kind: (count, first message)} since the last take

    async def __call__(self, engine: EpisodeEngine, row: dict) -> list[Trajectory]:
        return list(await asyncio.gather(*(self._episode(row, i) for i in range(engine.group_size))))

    async def _episode(self, row: dict, index: int) -> Trajectory:
        agent_row = {k: v for k, v in row.items() if k != "prompt_ids"}
        first = ""
        for attempt in range(self.attempts):
            key = self.endpoint.open_episode(seed=call_seed([row.get("seed"), index, attempt]))
            error: BaseException | None = None
            try:
                reward = await self._within_own_time(key, self._run(key, agent_row))
            except Exception as e:  # noqa: BLE001 - the agent's: its episode is dropped, not the step
                error = e
            finally:
                calls = self.endpoint.close_episode(key)
            if error is None:
                try:
                    return episode_of(calls, reward)
                except (ValueError, TypeError) as e:
                    error = e
            first = first or self._drop(error)
        raise AgentFailed(f"agent {self.spec} failed all {self.attempts} tries (agent.attempts) of an episode "
                          f"of prompt {row.get('id')!r}; the first: {first}")

    async def _within_own_time(self, key: str, run: Coroutine[Any, Any, Any]) -> Any:
        """What run returns, unless the agent's own time passes agent.timeout_s first (TimeoutError):
        its time waiting on the endpoint (queued behind the other episodes' calls, generating) is
        the engine's and does not count: a loaded engine stretches the bound instead of dropping episodes."""
        task = asyncio.ensure_future(run)
        t0 = time.monotonic()
        try:
            while (left := self.timeout_s - (time.monotonic() - t0 - self.endpoint.serving_seconds(key))) > 0:
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
            raise TimeoutError
        finally:
            task.cancel()  # past the bound, or the episode itself cancelled (as wait_for did); no-op once done

    async def _run(self, key: str, row: dict) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(self.base_url, key, row)
        # A synchronous agent runs on a thread; past the timeout it is no longer waited for, and its
        # key, closed, refuses its further calls.
        return await asyncio.to_thread(self.fn, self.base_url, key, row)

    def _drop(self, error: BaseException) -> str:
        kind = type(error).__name__
        text = f"ran past agent.timeout_s={self.timeout_s:g}" if isinstance(error, TimeoutError) else str(error)
        message = f"{kind}: {text}"[:500]
        count, first = self.failures.get(kind, (0, message))
        self.failures[kind] = (count + 1, first)
        return message

    def take_failures(self) -> dict[str, tuple[int, str]]:
        out, self.failures = self.failures, {}
        return out

"""agent.timeout_s counts the agent's own time: an episode's time in the endpoint (its calls queued
behind the other episodes', generating) does not count, so a loaded engine drops no episode; an
agent that spends its own time past the bound is still dropped, and says so.

The endpoint's clock of each episode (`_Episode`: the union of its calls' spans) is the real one;
the endpoint around it is a stand-in that reports those seconds, as no engine runs here.

    .venv/bin/python -m pytest tests/unit/test_agent_timeout.py -q
"""

import asyncio
import time
from types import SimpleNamespace

import pytest

from areal_kit.rl.engine.agent import AgentEpisodes
from areal_kit.rl.engine.endpoint import _Episode

pytestmark = pytest.mark.unit


def test_an_episodes_serving_time_is_the_union_of_its_calls():
    e = _Episode(seed=None)
    e.begin(10.0)
    e.begin(11.0)  # a second call while the first is served: the span is counted once
    e.end(12.0)
    assert e.serving_seconds(12.5) == pytest.approx(2.5)  # one call still in flight
    e.end(13.0)
    e.begin(20.0)
    e.end(21.5)
    assert e.serving_seconds(30.0) == pytest.approx(4.5)


class Endpoint:
    """An endpoint that reports a fixed share of the time since it was made as the episode's."""

    def __init__(self, share: float):
        self.share, self.t0 = share, time.monotonic()

    def serving_seconds(self, key: str) -> float:
        return (time.monotonic() - self.t0) * self.share


def episodes(share: float, timeout_s: float) -> AgentEpisodes:
    agent = SimpleNamespace(fn="agents:slow", timeout_s=timeout_s, attempts=1)
    return AgentEpisodes(lambda *a: None, Endpoint(share), "http://x", agent)


def test_time_waiting_on_the_engine_does_not_count():
    """0.6 s of which nine tenths were the engine's: 0.06 s of its own, within a 0.2 s bound."""
    got = asyncio.run(episodes(0.9, 0.2)._within_own_time("k", asyncio.sleep(0.6, result="done")))
    assert got == "done"


def test_an_agent_past_its_own_bound_is_stopped_at_the_bound():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        asyncio.run(episodes(0.0, 0.2)._within_own_time("k", asyncio.sleep(5)))
    assert 0.2 <= time.monotonic() - t0 < 1.0


def test_an_episode_cancelled_cancels_its_agent():
    """As asyncio.wait_for did: the episode's cancellation reaches the agent's run."""
    async def main():
        started, ran = asyncio.Event(), []

        async def agent():
            started.set()
            try:
                await asyncio.sleep(5)
            finally:
                ran.append("cancelled")

        outer = asyncio.ensure_future(episodes(0.0, 10)._within_own_time("k", agent()))
        await started.wait()
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)
        return ran

    assert asyncio.run(main()) == ["cancelled"]

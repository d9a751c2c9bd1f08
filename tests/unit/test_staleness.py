"""The staleness policy (ppo.max_head_offpolicyness = k) and the places that ask it agreeing: a
sample is trained at version v only when begun at v - k or later, the stream's last chance is the
step before it turns too stale, and a streaming engine aborts, at an update, exactly the requests
the policy calls too stale."""

import pytest

from areal_kit.config.loader import load_config
from areal_kit.rl.engine.streaming_llm import stale_requests
from areal_kit.rl.engine.weight_receive import WeightReceiver
from areal_kit.rl.staleness import Staleness


@pytest.mark.parametrize("k", [0, 1, 3])
def test_too_stale_and_last_chance_follow_the_bound(k):
    policy = Staleness(k)
    assert policy.batches_in_flight == k + 1
    for at in range(6):
        assert policy.oldest(at) == at - k
        for version in range(at + 1):
            assert policy.too_stale(version, at) == (at - version > k)
            if not policy.too_stale(version, at):  # its last chance: too stale after the next update
                assert policy.last_chance(version, at) == policy.too_stale(version, at + 1)


def test_the_policy_comes_from_max_head_offpolicyness():
    assert Staleness.of(load_config("tiny", ["ppo.max_head_offpolicyness=2"]).ppo) == Staleness(2)
    assert Staleness.of(load_config("tiny").ppo).k == load_config("tiny").ppo.max_head_offpolicyness


class _LLM:
    """Stands in for a streaming engine's StreamingLLM: records what a weight load asks of it."""

    def __init__(self):
        self.stale_before = None

    def pause(self, how):
        pass

    def collective_rpc(self, method, args=()):
        return [{"wire": 0.1}]

    def reset_prefix_cache(self):
        pass

    def resume(self, version, stale_before=None):
        self.stale_before = stale_before
        return 0


class _Engine(WeightReceiver):
    def __init__(self, cfg):
        self.cfg, self.llm, self.streaming = cfg, _LLM(), True


@pytest.mark.parametrize("k", [0, 1, 2])
def test_an_engine_aborts_at_an_update_what_the_policy_calls_too_stale(k):
    cfg = load_config("tiny", ["rollout.mode=stream", f"ppo.max_head_offpolicyness={k}"])
    engine, policy = _Engine(cfg), Staleness(k)
    running = [(f"r{v}", [(str(v), 0)]) for v in range(6)]  # a request begun at each version
    for at in range(1, 6):
        engine.load_from_disk("/unused", at)
        assert engine.version == at
        aborted = stale_requests(running, before=engine.llm.stale_before)
        assert aborted == [f"r{v}" for v in range(6) if policy.too_stale(v, at)]

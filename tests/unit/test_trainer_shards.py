"""Each trainer rank receives its own shard of a step's batch, one Ray object each, never the whole
batch: a rank used to unpickle every sample and keep a 1/world of them.

    .venv/bin/python -m pytest tests/unit/test_trainer_shards.py
"""

import random

from areal_kit.rl.driver import groups
from areal_kit.rl.hallway import TokenTrace, TrainReply
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
        return args  # the "object ref" _Dog.wait answers from


class _Actor:
    def __init__(self):
        self.calls: list = []
        self.train_step = _Method(self.calls)


class _Dog:
    def label(self, refs, names):
        return refs

    def wait(self, call, refs):
        """Each rank's reply as TrainerWorker.train_step makes it: the trace of each of its shard's
        rows asked for, by the row's place in the shard; here a trace names its row's prompt ([i])."""
        return [TrainReply({"rank": float(n)}, {j: TokenTrace([float(shard[j].prompt_ids[0])], [])
                                                for j in (mine or [])})
                for n, (shard, mine) in enumerate(refs)]


def test_train_step_sends_each_rank_its_shard_alone():
    actors = [_Actor() for _ in range(3)]
    samples = _batch(10)
    groups.TrainerGroup(actors, _Dog()).train_step(samples)
    shards = groups.shard_batch(samples, 3)
    for rank, actor in enumerate(actors):  # one argument per rank (one object in Ray's store), its samples only
        assert actor.calls == [(shards[rank], None)]


def test_traces_come_back_by_the_batch_index_from_the_rank_that_trained_each_sample():
    actors = [_Actor() for _ in range(3)]
    samples = _batch(10, seed=3)
    reply = groups.TrainerGroup(actors, _Dog()).train_step(samples, [9, 0, 4, 5])
    assert reply.stats == {"rank": 0.0}  # rank 0's stats: every rank's are the same sums
    assert {i: t.logprobs for i, t in reply.traces.items()} == {i: [float(i)] for i in (0, 4, 5, 9)}
    asked = [actor.calls[0][1] or [] for actor in actors]
    assert sum(len(a) for a in asked) == 4  # each sample asked of its own rank alone

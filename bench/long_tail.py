"""The streaming benchmark's workflow: answers whose lengths follow a heavy-tailed law.

Each answer of a group is its own request, its length drawn from a Pareto law (scale
SCALE tokens, shape ALPHA) capped at ppo.gen.max_new_tokens, seeded by the row's sampling seed,
so batch and stream mode get the same lengths. The bench model's eos is rare enough that answers
run to their drawn length. Named in config as ppo.workflow=bench/long_tail.py:long_tail.
"""

from __future__ import annotations

import asyncio
import random

from areal_kit.api import Trajectory

SCALE = 8
ALPHA = 1.1


def lengths(seed: int, n: int, cap: int) -> list[int]:
    """n answer lengths for the row with this sampling seed."""
    rng = random.Random(seed)
    return [min(cap, int(SCALE / (1.0 - rng.random()) ** (1.0 / ALPHA))) for _ in range(n)]


async def long_tail(engine, row):
    want = lengths(row["seed"], engine.group_size, engine.gen.max_new_tokens)
    outs = await asyncio.gather(*(engine.generate(row["prompt_ids"], n=1, max_tokens=n, seed=row["seed"] + i)
                                  for i, n in enumerate(want)))
    return [Trajectory(o.token_ids, o.logprobs, no_eos=o.no_eos, versions=o.versions) for [o] in outs]

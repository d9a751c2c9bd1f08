"""Plug-ins for the integration tests, named in config by file path.

two_turn: the toy task in two model turns with the environment's token between them, as a tool's
result or a user reply would be: the first digit, then "=" (Turn.env: loss mask 0), then a
second digit. The toy reward reads the first word of the model's text, so the task and its
signal are unchanged.
flaky: a reward plug-in that raises for some answers (counted failures, reward 0) and returns
a dict with an extra number otherwise.
broken: a reward plug-in that always raises, so a run cannot learn.
stuck_once: single-turn, except that once per run (a marker file) the episode after
AREAL_TEST_HANG_AFTER episodes blocks its engine for an hour, as a call stuck in C code would.
stuck_once_reward: a reward plug-in whose first call never returns (once per run, a marker file).
"""

import os
import time
from pathlib import Path

from areal_kit.api import Trajectory, Turn
from areal_kit.rl.workflow import single_turn

INSERTED = "="


async def two_turn(engine, row):
    first = await engine.generate(row["prompt_ids"], n=engine.group_size, max_tokens=1, seed=row["seed"])
    hint = engine.encode(INSERTED)
    out = []
    for i, c in enumerate(first):
        [second] = await engine.generate(row["prompt_ids"] + c.token_ids + hint, n=1, max_tokens=1,
                                         seed=row["seed"] + i)
        out.append(Trajectory.from_turns([Turn.model(c), Turn.env(hint), Turn.model(second)], no_eos=second.no_eos))
    return out


def flaky(prompt, completion, sample):
    if completion.strip().endswith("3"):
        raise ValueError("answers ending in 3 are not scored")
    return {"reward": 0.0, "len": float(len(completion))}


def broken(prompt, completion, sample):
    raise ValueError("the grading service is down")


_episodes = 0


async def stuck_once(engine, row):
    global _episodes
    _episodes += 1
    marker = os.environ.get("AREAL_TEST_HANG_MARKER")
    if marker and _episodes > int(os.environ["AREAL_TEST_HANG_AFTER"]) and not os.path.exists(marker):
        Path(marker).touch()
        time.sleep(3600)  # noqa: ASYNC251 - the point: the engine's event loop blocks, generate never returns
    return await single_turn(engine, row)


def stuck_once_reward(prompt, completion, sample):
    """A reward that never returns, once per run (the marker AREAL_TEST_REWARD_MARKER); 0 otherwise."""
    marker = os.environ.get("AREAL_TEST_REWARD_MARKER")
    if marker and not os.path.exists(marker):
        Path(marker).touch()
        time.sleep(3600)
    return 0.0

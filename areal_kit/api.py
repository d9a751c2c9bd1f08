"""What a user writes against: the rollout workflow (what happens to one prompt) and the reward function.

The default is single-turn: sample ppo.group_size answers, then the configured rewards score
them. A multi-turn or tool-using workflow is an async function (or a class with an
`arun_episode` method) named in config, ppo.workflow=my_pkg.flows:two_turn:

    from areal_kit.api import Trajectory

    async def two_turn(engine, row):
        first = await engine.generate(row["prompt_ids"], n=engine.group_size, seed=row["seed"])
        out = []
        for c in first:
            hint = engine.encode(" check again:")           # inserted, not generated
            prompt2 = row["prompt_ids"] + c.token_ids + hint
            [second] = await engine.generate(prompt2, n=1, seed=row["seed"])
            out.append(Trajectory(
                output_ids=c.token_ids + hint + second.token_ids,
                logprobs=c.logprobs + [0.0] * len(hint) + second.logprobs,
                loss_mask=[1] * len(c.token_ids) + [0] * len(hint) + [1] * len(second.token_ids),
                no_eos=second.no_eos))                       # reward=None: reward_fns score it
        return out

The interface:
  engine.generate(prompt_ids, n=1, max_tokens=None, seed=None, temperature=None)
      -> list[Completion] (token_ids, logprobs, finish_reason, no_eos, versions: the weight version
      of each token under rollout.mode=stream, else None). `await` it: the calls
      of every prompt of the batch that are waiting at the same time go to vLLM as one batch.
  engine.group_size, engine.gen (ppo.gen settings), engine.encode(text), engine.decode(ids).
  row: the dataset row: id, prompt_ids, prompt_text, seed (the per-prompt sampling seed),
      answer / solutions and the row's other fields.
  Return exactly group_size Trajectory objects: output_ids (every token after the prompt),
      logprobs (the sampling logprob of each, 0.0 for inserted tokens), loss_mask (1 = trained
      on; None = all), reward (None = scored by ppo.reward_fns on `text`, or on the decoded
      output when text is None), no_eos, versions (optional: each output token's weight version,
      from the Completions; an inserted token takes the version of the token before it).

A reward function, named in ppo.reward_fns (or ppo.reward_plugins), is a RewardFn:
  (prompt: str, completion: str, sample: dict) -> float | dict (a dict: "reward" plus extra
  metrics logged as reward/<key>); sample is the dataset row.

The runtime behind the engine is rl/workers/workflow.py; the built-in rewards are reward/registry.py.

    python -m pytest tests/unit/test_workflow.py
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Completion:
    """One answer of the engine."""

    token_ids: list[int]
    logprobs: list[float]  # sampling logprob of each token (after temperature)
    finish_reason: str  # "stop" (eos or a stop token) | "length" (truncated)
    versions: list[int] | None = None  # streaming engines: the weight version that sampled each token

    @property
    def no_eos(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Trajectory:
    """One answer of a group, as a workflow returns it; the rollout worker scores it and makes it a
    Sample (rl/sample.py), which carries it to the trainer."""

    output_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int] | None = None
    reward: float | None = None
    text: str | None = None
    no_eos: bool = False
    versions: list[int] | None = None  # the weight version of each output token (a Completion's); None = unknown
    info: dict = field(default_factory=dict)  # free-form; not sent to the trainer

    def check(self) -> None:
        n = len(self.output_ids)
        if n == 0:
            raise ValueError("a trajectory has no output tokens")
        if len(self.logprobs) != n:
            raise ValueError(f"a trajectory has {n} output tokens but {len(self.logprobs)} logprobs")
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(f"a trajectory has {n} output tokens but a loss_mask of {len(self.loss_mask)}")
            if not any(self.loss_mask):
                raise ValueError("a trajectory's loss_mask is all 0: nothing to train on")
        if self.versions is not None and len(self.versions) != n:
            raise ValueError(f"a trajectory has {n} output tokens but {len(self.versions)} versions")


class EpisodeEngine(Protocol):
    """The engine a workflow is handed (rl/workers/workflow.py's Engine)."""

    group_size: int
    gen: Any  # ppo.gen: max_new_tokens, temperature, top_p, ...

    async def generate(self, prompt_ids: list[int], n: int = 1, max_tokens: int | None = None,
                       seed: int | None = None, temperature: float | None = None) -> list[Completion]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# ppo.workflow names one of these (or a class whose arun_episode is one): a prompt's episode.
Workflow = Callable[[EpisodeEngine, dict], Awaitable[list[Trajectory]]]

# ppo.reward_fns / ppo.reward_plugins name these: (prompt, completion, dataset row) -> reward.
RewardFn = Callable[[str, str, dict], float]

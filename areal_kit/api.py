"""What a user writes against: the rollout workflow (what happens to one prompt), the agent (an
episode written against an OpenAI-style client) and the reward function.

The default is single-turn: sample ppo.group_size answers, then the configured rewards score
them. A multi-turn or tool-using workflow is an async function (or a class with an
`arun_episode` method) named in config, ppo.workflow=my_pkg.flows:two_turn:

    from areal_kit.api import Trajectory, Turn

    async def two_turn(engine, row):
        first = await engine.generate(row["prompt_ids"], n=engine.group_size, seed=row["seed"])
        out = []
        for c in first:
            hint = engine.encode(" check again:")           # the environment's: context, not trained on
            prompt2 = row["prompt_ids"] + c.token_ids + hint
            [second] = await engine.generate(prompt2, n=1, seed=row["seed"])
            out.append(Trajectory.from_turns([Turn.model(c), Turn.env(hint), Turn.model(second)],
                                             no_eos=second.no_eos))  # reward_fns score it
        return out

The interface:
  engine.generate(prompt_ids, n=1, max_tokens=None, seed=None, temperature=None)
      -> list[Completion] (token_ids, logprobs, finish_reason, no_eos, versions: the weight version
      of each token under rollout.mode=stream, else None). `await` it: the calls
      of every prompt of the batch that are waiting at the same time go to vLLM as one batch.
  engine.group_size, engine.gen (ppo.gen settings), engine.encode(text), engine.decode(ids).
  row: the dataset row: id, prompt_ids, prompt_text, seed (the per-prompt sampling seed),
      answer / solutions and the row's other fields.
  Return exactly group_size Trajectory objects. Trajectory.from_turns(turns) makes one of an
      episode's turns (Turn.model(completion), Turn.env(token_ids): a tool's result, a user's
      message): the environment's tokens are in the context, out of the loss, the KL term, the
      length metrics and the overlong penalty; rewards grade the model's turns' text and get
      every turn (sample["turns"]: role and text) and the environment's text (sample["env_text"]).
      Or set the fields by hand: output_ids (every token after the prompt), logprobs (the
      sampling logprob of each, 0.0 for inserted tokens), loss_mask (1 = trained on; None = all),
      reward (None = scored by ppo.reward_fns on `text`, or on the decoded output when text is
      None), no_eos, versions (optional: each output token's weight version, from the
      Completions; an inserted token takes the version of the token before it).

An agent, named in agent.fn (instead of ppo.workflow), is an Agent: a function, async or not,
(base_url, api_key, row) -> AgentReward, run ppo.group_size times per prompt:

    async def agent(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": row["question"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ...                                   # run the tools it calls, ask again, ...
        return None                           # ppo.reward_fns grade the episode (or a float,
                                              # or a list: one per call, per-turn rewards)

  base_url is the rollout engine's chat endpoint (vLLM's OpenAI server, /v1/chat/completions:
  messages, tools, tool_choice, n, max_tokens, stop, stream; any model name), api_key the
  episode's own. Every call made with it is recorded as the engine sampled it (token ids and
  logprobs, never re-tokenized text) and the episode's calls are joined into one Trajectory: the
  model's replies trained on, the chat template's and the tools' tokens context only. A call whose
  prompt does not extend the chat so far (a template that drops earlier reasoning) starts a
  segment of its own (Trajectory.of_segments): each segment trains as its own sequence.
  Sampling is the run's (ppo.gen: another temperature, top_p or top_k is refused), max_tokens at
  most ppo.gen.max_new_tokens per call. Tool calls come back parsed (agent.tool_parser: vLLM's
  hermes, ...). The reward: a float shared by the whole episode, None for ppo.reward_fns to grade
  it, or a list of one float per call the endpoint answered (in order), each segment taking its
  last call's. An agent that raises, overruns agent.timeout_s, or returns a list of another length
  is run again (agent/dropped).

A reward function, named in ppo.reward_fns (or ppo.reward_plugins), is a RewardFn:
  (prompt: str, completion: str, sample: dict) -> float | dict (a dict: "reward" plus extra
  metrics logged as reward/<key>); sample is the dataset row.

The runtime behind the engine is rl/workflow.py, behind an agent rl/engine/agent.py and the
chat endpoint rl/engine/endpoint.py; a shipped tool-using task is agents/calculator.py; the
built-in rewards are reward/registry.py.

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


MODEL, ENV = "model", "env"


@dataclass
class Turn:
    """One turn of an episode: the model's tokens (role "model": sampled, trained on) or the
    environment's (role "env": a tool's result, a user's message; context only, never trained on)."""

    role: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # model turns: the sampling logprob of each token
    versions: list[int] | None = None  # model turns, streaming: the weight version of each token
    text: str | None = None  # the turn's text, where the workflow has it (else it is decoded)

    @classmethod
    def model(cls, c: Completion) -> Turn:
        return cls(MODEL, list(c.token_ids), list(c.logprobs), None if c.versions is None else list(c.versions))

    @classmethod
    def env(cls, token_ids: list[int], text: str | None = None) -> Turn:
        return cls(ENV, list(token_ids), text=text)


@dataclass
class Trajectory:
    """One answer of a group, as a workflow returns it; the rollout worker scores it and makes it a
    Sample (rl/sample.py), which carries it to the trainer. A multi-turn episode is best built with
    Trajectory.from_turns, which sets the tokens, logprobs, loss mask and versions from its turns
    and keeps the turns, so rewards see the model's text apart from the environment's."""

    output_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int] | None = None
    reward: float | None = None
    text: str | None = None
    no_eos: bool = False
    versions: list[int] | None = None  # the weight version of each output token (a Completion's); None = unknown
    info: dict = field(default_factory=dict)  # free-form; not sent to the trainer
    turns: list[Turn] | None = None  # the episode's turns (from_turns); None: one model turn
    prompt_ids: list[int] | None = None  # the episode's prompt where it is not the row's (an agent's first call's)
    # An episode of several sequences (of_segments): each trains on its own, and the fields above
    # but reward, text, no_eos (its last segment's) and info are unused.
    segments: list[Trajectory] | None = None

    @classmethod
    def from_turns(cls, turns: list[Turn], *, no_eos: bool = False, reward: float | None = None,
                   info: dict | None = None) -> Trajectory:
        """The trajectory of an episode's turns after the prompt, the first the model's: the
        environment's tokens are in the context with logprob 0.0 and loss mask 0, and take the
        weight version of the model token before them."""
        if not turns or turns[0].role != MODEL:
            raise ValueError("an episode's first turn after the prompt is the model's (Turn.model)")
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] | None = [] if any(t.versions is not None for t in turns if t.role == MODEL) else None
        for t in turns:
            if t.role not in (MODEL, ENV):
                raise ValueError(f"a turn's role is {t.role!r}; expected {MODEL!r} or {ENV!r}")
            n = len(t.token_ids)
            model = t.role == MODEL
            if model and (t.logprobs is None or len(t.logprobs) != n):
                raise ValueError(f"a model turn of {n} tokens has {len(t.logprobs or [])} logprobs")
            ids += t.token_ids
            logprobs += list(t.logprobs) if model and t.logprobs is not None else [0.0] * n
            mask += [int(model)] * n
            if versions is not None:
                last = versions[-1] if versions else 0
                versions += list(t.versions) if model and t.versions is not None else [last] * n
        return cls(ids, logprobs, loss_mask=mask, reward=reward, no_eos=no_eos, versions=versions,
                   info=dict(info or {}), turns=list(turns))

    @classmethod
    def of_segments(cls, segments: list[Trajectory], *, reward: float | None = None,
                    info: dict | None = None) -> Trajectory:
        """One episode made of several sequences, each with its own prompt_ids (None: the row's):
        calls whose prompts do not extend what came before (a chat template that re-renders earlier
        turns differently). Each trains as a sequence of its own, its loss over its own model
        tokens; a segment's reward is its own where set, else the episode's (`reward`, or
        ppo.reward_fns on the model's text of every segment). GRPO's group baseline counts the
        episode once, with the reward of its last segment."""
        if not segments:
            raise ValueError("an episode of segments has at least one")
        if any(s.segments is not None for s in segments):
            raise ValueError("a segment is one sequence: segments do not nest")
        return cls([], [], reward=reward, no_eos=segments[-1].no_eos, info=dict(info or {}), segments=list(segments))

    @property
    def sequences(self) -> list[Trajectory]:
        """What trains: its segments, or itself."""
        return [self] if self.segments is None else self.segments

    @property
    def n_model_tokens(self) -> int:
        """The tokens the model sampled: its turns', else those the loss mask keeps, else all."""
        if self.segments is not None:
            return sum(s.n_model_tokens for s in self.segments)
        if self.turns is not None:
            return sum(len(t.token_ids) for t in self.turns if t.role == MODEL)
        return len(self.output_ids) if self.loss_mask is None else sum(1 for x in self.loss_mask if x)

    @property
    def n_turns(self) -> int:
        """The model's turns: the engine calls the episode is made of (1 without turns)."""
        if self.segments is not None:
            return sum(s.n_turns for s in self.segments)
        return 1 if self.turns is None else sum(1 for t in self.turns if t.role == MODEL)

    @property
    def n_tool_calls(self) -> int:
        """The model's turns that the environment answered before the model went on: a model turn
        followed by an environment turn. One definition for a workflow's turns and an agent's joined
        calls (whose tool results and template tokens between two calls are an environment turn),
        with no parser to trust: a call the model wrote but nothing answered (an episode that ends
        on it, a malformed call the tool ignored) is not counted. A segment followed by another
        ends on a model turn the episode went on from: answered."""
        if self.segments is not None:
            return sum(s.n_tool_calls for s in self.segments) + len(self.segments) - 1
        if self.turns is None:
            return 0
        return sum(1 for a, b in zip(self.turns, self.turns[1:]) if a.role == MODEL and b.role == ENV)

    @property
    def n_env_tokens(self) -> int:
        """The environment's tokens after the prompt (loss mask 0: tool results, template tokens)."""
        return sum(len(s.output_ids) for s in self.sequences) - self.n_model_tokens

    def check(self) -> None:
        if self.segments is not None:
            for s in self.segments:
                s.check()
            return
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
    """The engine a workflow is handed (rl/workflow.py's Engine)."""

    group_size: int
    gen: Any  # ppo.gen: max_new_tokens, temperature, top_p, ...

    async def generate(self, prompt_ids: list[int], n: int = 1, max_tokens: int | None = None,
                       seed: int | None = None, temperature: float | None = None) -> list[Completion]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# ppo.workflow names one of these (or a class whose arun_episode is one): a prompt's episode.
Workflow = Callable[[EpisodeEngine, dict], Awaitable[list[Trajectory]]]

# What an agent returns: the episode's reward; or one reward per call the endpoint answered, in
# the order made (each of the episode's sequences takes its last call's); or None (ppo.reward_fns).
AgentReward = float | list[float] | None

# agent.fn names one of these (or its synchronous form): (base_url, api_key, dataset row) -> reward.
Agent = Callable[[str, str, dict], Awaitable[AgentReward]]

# ppo.reward_fns / ppo.reward_plugins name these: (prompt, completion, dataset row) -> reward.
RewardFn = Callable[[str, str, dict], float]

"""An agent's recorded calls (endpoint.py's Call) made into the Trajectory its episode trains on.

A call whose prompt extends everything before it (the prompts and the sampled tokens) joins the
sequence so far: what its prompt adds is the environment's turn (tool results, the template's role
tokens), context only. A call whose prompt does not (a chat template that re-renders an earlier
turn differently: Qwen3's drops earlier reasoning; a special token the text cannot show) starts a
new segment, a sequence of its own with its own prompt. An episode of one segment is a plain
Trajectory; of several, Trajectory.of_segments. Every model token keeps its call's logprob and
weight version, so each segment's loss covers exactly what the engine sampled.

    trajectory = episode_of(endpoint.close_episode(key), reward)

    .venv/bin/python -m pytest tests/unit/test_segments.py tests/integration/test_endpoint.py
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_kit.api import AgentReward, Completion, Trajectory, Turn

if TYPE_CHECKING:
    from areal_kit.rl.engine.endpoint import Call


def split(calls: list[Call]) -> list[list[Call]]:
    """The calls in runs that join: each call of a run extends the run's prompt and tokens so far."""
    runs: list[list[Call]] = []
    context: list[int] = []
    for c in calls:
        if runs and c.prompt_ids[:len(context)] == context:
            runs[-1].append(c)
        else:
            runs.append([c])
            context = []
        context = list(c.prompt_ids) + list(c.token_ids)
    return runs


def _joined(run: list[Call]) -> Trajectory:
    """One run of joining calls as one sequence: its first call's prompt, then each call's tokens
    (the model's) and what the next call's prompt adds (the environment's)."""
    turns: list[Turn] = []
    end = len(run[0].prompt_ids)
    for i, c in enumerate(run):
        if i and len(c.prompt_ids) > end:
            turns.append(Turn.env(list(c.prompt_ids[end:])))
        turns.append(Turn.model(Completion(list(c.token_ids), list(c.logprobs), c.finish_reason,
                                           [c.version] * len(c.token_ids))))
        end = len(c.prompt_ids) + len(c.token_ids)
    t = Trajectory.from_turns(turns, no_eos=run[-1].finish_reason == "length")
    t.prompt_ids = list(run[0].prompt_ids)
    return t


def episode_of(calls: list[Call], reward: AgentReward = None) -> Trajectory:
    """The episode of an agent's calls (in the order made) and what the agent returned: a float
    (the episode's reward, every segment's), a list of one float per call (each segment takes the
    reward of its last call), or None (ppo.reward_fns grade the episode)."""
    if not calls:
        raise ValueError("an episode without calls has no trajectory")
    if any(c.choice for c in calls) or len({c.call for c in calls}) != len(calls):
        raise ValueError("an episode whose calls asked for n > 1 choices has no single trajectory; "
                         "join one chain of n = 1 calls")
    per_call: list[float] | None = None
    shared: float | None = None
    if isinstance(reward, list):
        if len(reward) != len(calls):
            raise ValueError(f"the agent returned {len(reward)} rewards for the {len(calls)} calls the endpoint "
                             "answered; expected one per answered call, in order (or one float for the episode)")
        per_call = [float(r) for r in reward]
        shared = per_call[-1]
    elif reward is not None:
        shared = float(reward)
    runs = split(calls)
    segments = [_joined(run) for run in runs]
    if per_call is not None:
        at = 0
        for run, s in zip(runs, segments):
            at += len(run)
            s.reward = per_call[at - 1]
    if len(segments) == 1:
        segments[0].reward = shared
        return segments[0]
    return Trajectory.of_segments(segments, reward=shared)

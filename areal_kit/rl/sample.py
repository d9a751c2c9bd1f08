"""One answer on its way from a rollout engine to the trainer, and who writes each part of it.

    rollout engine  (rl/engine/worker.py, generate)    Sample: the tokens, behaviour logprobs,
                    weight version, loss_mask (a workflow's), task_reward and format_reward
    controller      (rl/driver/rollout.py, gather)       fresh `group` numbers for the groups it
                                                         keeps (dynamic sampling, streaming)
    reward shaping  (rl/algo/batch.py, shape_rewards)    final_reward and seq_reward; an all-zero
                    loss_mask for a truncated answer under ppo.overlong_filter
    trainer         (rl/trainer/worker.py, train_step)  reads trainer_rows(samples)

A Sample is frozen: each stage returns new ones (dataclasses.replace) and never changes one it was
given, so what a stage received is still what the stage before it made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    id: str  # the dataset row's id
    group: int  # its prompt's index in the engine's batch; the samples of one prompt share it
    prompt_ids: list[int]
    output_ids: list[int]  # every token after the prompt, a workflow's inserted ones included
    logprobs: list[float]  # the behaviour logprob of each output token (0.0 for inserted ones)
    no_eos: bool  # truncated at max_new_tokens
    version: int  # the weight version that generated it (streaming: that of its first token)
    task_reward: float  # the verifier's: the workflow's own, or ppo.reward_fns' sum
    format_reward: float | None = None  # ppo.format_reward when the text matches format_pattern; None when off
    source: str | None = None  # the dataset.mix source of its prompt
    loss_mask: list[int] | None = None  # 1 = trained on; None = every output token
    final_reward: float | None = None  # the shaped reward (scaled, biased), before group normalization
    seq_reward: float | None = None  # the reward the trainer credits to the last token (group-normalized for GRPO)
    versions: list[int] | None = None  # streaming: the weight version of each output token (None: all `version`)
    n_model_tokens: int | None = None  # the tokens the model sampled (None: all output_ids; a workflow's
    # inserted ones, a tool's result, are not: length metrics and the overlong penalty count these)
    turns: int = 1  # the model's turns in its sequence (api.Trajectory.n_turns)
    tool_calls: int = 0  # its model turns the environment answered (api.Trajectory.n_tool_calls)
    # An episode of several sequences (api.Trajectory.of_segments: calls that do not extend each
    # other) is one Sample per segment, in order, each naming the episode's index in its group:
    # reward shaping and the episode metrics count the episode once (batch.episodes).
    episode: int | None = None  # None: a sequence that is its episode's only one

    @property
    def model_len(self) -> int:
        return len(self.output_ids) if self.n_model_tokens is None else self.n_model_tokens

    @property
    def interrupted(self) -> bool:
        """New weights arrived while it was generated (streaming, rollout.interrupt=keep)."""
        if not self.versions:
            return False
        return min(self.versions) != max(self.versions)


@dataclass
class Generated:
    """One engine's reply to a batch of prompts (RolloutWorker.generate)."""

    samples: list[Sample]
    gen_time: float
    reward_time: float
    version: int  # the weight version the engine held
    engine: int  # the engine's index
    reward_failures: dict = field(default_factory=dict)  # {kind: (count, first message)}
    reward_extras: dict = field(default_factory=dict)  # {"reward/<key>": mean} of the dict rewards' extras
    agent_drops: dict = field(default_factory=dict)  # {kind: (count, first message)}: episodes the agent lost
    failed_calls: int = 0  # engine calls refused or failed (a workflow's, or an agent's through the endpoint)
    # Wall-clock time the engine made the reply (its rewards done): its generation ran from
    # done - reward_time - gen_time to done - reward_time (`areal-kit view`'s time lanes).
    done: float = 0.0

    def __post_init__(self) -> None:
        if not self.done:
            self.done = time.time()


@dataclass(frozen=True)
class TrainerRow:
    """What a trainer rank reads of one sample (rl/algo/ppo.py): the tokens, the behaviour logprobs,
    the reward credited to the last token and the loss mask where a stage set one."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # empty where only logprobs are asked for
    seq_reward: float = 0.0
    loss_mask: list[int] | None = None  # None: every output token is trained on


def trainer_rows(samples: list[Sample]) -> list[TrainerRow]:
    """The trainer's rows of the step's shaped samples (seq_reward set by reward shaping)."""
    return [TrainerRow(s.prompt_ids, s.output_ids, s.logprobs, float(s.seq_reward or 0.0), s.loss_mask)
            for s in samples]


@dataclass
class Gathered:
    """What one step trains on, and what it took to get it (a rollout's gather, rl/driver/rollout.py)."""

    epoch: int  # the step's place in the data: the batch that names it (0-based)
    epoch_step: int
    outs: list[Generated]  # the engines' replies, every round
    loads: list[dict]  # the weight loads the step waited for
    # Every sample generated for the step, as the engines replied: their task_reward is the policy's accuracy.
    samples: list[Sample]
    stale: int
    wait_time: float
    gen_time: float
    rounds: int = 0  # extra generation rounds (dynamic sampling)
    dropped: int = 0  # groups dropped for equal task rewards (dynamic sampling)
    kept: int = 0  # informative groups trained on (dynamic sampling)
    picked: list[Sample] | None = None  # what dynamic sampling trains on, when not every sample generated
    metrics: dict = field(default_factory=dict)  # the rollout's own step metrics (streaming: stream/*)

    @property
    def train(self) -> list[Sample]:
        return self.samples if self.picked is None else self.picked

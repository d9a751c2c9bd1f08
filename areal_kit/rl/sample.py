"""One answer on its way from a rollout engine to the trainer, and who writes each part of it.

    rollout engine  (rl/workers/rollout.py, generate)    Sample: the tokens, behaviour logprobs,
                    weight version, loss_mask (a workflow's), task_reward and format_reward
    controller      (rl/driver/controller.py, _gather;          fresh `group` numbers for the groups it
                     rl/driver/stream.py, Stream.gather)         keeps (dynamic sampling, streaming)
    reward shaping  (rl/algo/batch.py, shape_rewards)    final_reward and seq_reward; an all-zero
                    loss_mask for a truncated answer under ppo.overlong_filter
    trainer         (rl/workers/trainer.py, train_step)  reads trainer_rows(samples)

A Sample is frozen: each stage returns new ones (dataclasses.replace) and never changes one it was
given, so what a stage received is still what the stage before it made.
"""

from __future__ import annotations

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

    @property
    def interrupted(self) -> bool:
        """New weights arrived while it was generated (streaming, rollout.interrupt=keep)."""
        return bool(self.versions) and min(self.versions) != max(self.versions)


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


def trainer_rows(samples: list[Sample]) -> list[dict]:
    """What the trainer reads of each sample, as the dicts it takes: the tokens, the behaviour
    logprobs, seq_reward, and loss_mask where a stage set one (a batch without any trains on every
    token)."""
    rows = []
    for s in samples:
        row = {"prompt_ids": s.prompt_ids, "output_ids": s.output_ids, "logprobs": s.logprobs,
               "seq_reward": s.seq_reward}
        if s.loss_mask is not None:
            row["loss_mask"] = s.loss_mask
        rows.append(row)
    return rows


@dataclass
class Batch:
    """One batch of prompts' generation, queued on the engines."""

    epoch: int
    epoch_step: int
    handles: list  # the engines' generate calls
    loads: list  # the weight loads queued before them: a failed load must never feed training


@dataclass
class Gathered:
    """What one step trains on, and what it took to get it."""

    batch: Batch  # the first batch taken (its epoch and step name the step)
    outs: list[Generated]  # the engines' replies, every round
    loads: list[dict]
    # Every sample generated for the step, as the engines replied: their task_reward is the policy's accuracy.
    samples: list[Sample]
    stale: int
    wait_time: float
    gen_time: float
    rounds: int = 0  # extra generation rounds (dynamic sampling)
    dropped: int = 0  # groups dropped for equal task rewards (dynamic sampling)
    kept: int = 0  # informative groups trained on (dynamic sampling)
    picked: list[Sample] | None = None  # what dynamic sampling trains on, when not every sample generated
    stream: dict = field(default_factory=dict)  # streaming: its metrics (rl/driver/stream.py)

    @property
    def train(self) -> list[Sample]:
        return self.samples if self.picked is None else self.picked

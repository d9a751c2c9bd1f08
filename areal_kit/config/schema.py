"""The training configuration: dataclasses with documented fields, validated in __post_init__.

Names follow the AReaL v0.1 guide where it has one (experiment_name, allocation_mode,
ppo.gen.max_new_tokens, actor_train.mb_spec.max_tokens_per_mb, exp_ctrl.*). Each field's
help is the comment on the line above it; `areal-kit train PRESET --show-args` prints them.
Presets (train_scripts/*.yaml) and `key=value` overrides are merged by config/loader.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from areal_kit.errors import UserError


class ConfigError(UserError):
    """A config value is invalid: names the field, the value and what is expected."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choice(name: str, value, choices) -> None:
    check(value in choices, f"{name}={value!r} is not valid; expected one of {', '.join(map(str, choices))}")


def check_positive(name: str, value, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    check(ok, f"{name}={value} is not valid; expected a number {'>= 0' if allow_zero else '> 0'}")


@dataclass
class GenConfig:
    # Most tokens generated per answer.
    max_new_tokens: int = 16384
    # Fewest tokens generated per answer (eos is suppressed before this).
    min_new_tokens: int = 0
    # Sampling temperature; the trainer divides logits by the same value.
    temperature: float = 0.6
    # Nucleus sampling mass (1.0 = off).
    top_p: float = 1.0
    # Top-k sampling (-1 = off).
    top_k: int = -1

    def __post_init__(self):
        check_positive("ppo.gen.max_new_tokens", self.max_new_tokens)
        check(0 <= self.min_new_tokens <= self.max_new_tokens,
              f"ppo.gen.min_new_tokens={self.min_new_tokens} is not valid; expected 0..max_new_tokens ({self.max_new_tokens})")
        check(self.temperature > 0, f"ppo.gen.temperature={self.temperature} is not valid; expected > 0 "
              "(RL needs sampling; greedy belongs to eval)")
        check(0 < self.top_p <= 1, f"ppo.gen.top_p={self.top_p} is not valid; expected 0 < top_p <= 1")
        check(self.top_k == -1 or self.top_k > 0, f"ppo.gen.top_k={self.top_k} is not valid; expected -1 or > 0")


# ppo.loss_agg's choices (rl/algo/functional.py says what each computes).
LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class PPOConfig:
    # Answers sampled per prompt.
    group_size: int = 8
    # PPO clip range of the probability ratio.
    eps_clip: float = 0.2
    # KL coefficient to the frozen reference model (0 = no reference model is loaded).
    kl_ctl: float = 0.0
    # KL estimator: k1 (log-ratio), k2 (squared log-ratio / 2), k3 (Schulman's unbiased, >= 0).
    kl_estimator: str = "k1"
    # Where the KL goes: "reward" (penalty per token, the guide's kl_reward) or "loss" (a loss term).
    kl_mode: str = "reward"
    # Optimizer steps per batch: the batch is split into this many minibatches.
    ppo_n_minibatches: int = 1
    # How token losses become the batch loss: token-mean (every token of the global batch alike;
    # long answers weigh more), seq-mean-token-mean (every answer alike, the GRPO paper's), or
    # seq-mean-token-sum-norm (token sums over max_new_tokens, averaged over answers: Dr. GRPO's).
    loss_agg: str = "token-mean"
    # Multiply the verifier's reward by this (the guide uses 5).
    reward_output_scaling: float = 1.0
    # Added to the reward after scaling (the guide's ppo-math uses -0.5 with scaling 1; 0 = none).
    reward_output_bias: float = 0.0
    # Normalize advantages over the whole batch (AReaL ppo-math).
    adv_norm: bool = True
    # Normalize rewards within each prompt's group (GRPO). Needs group_size >= 2.
    group_adv_norm: bool = False
    # Drop groups whose rewards are all equal (they carry no signal; counted as perc_zero_adv).
    skip_zero_adv_groups: bool = False
    # Discount factor for returns over tokens.
    discount: float = 1.0
    # GAE lambda (no critic: with 1.0 every token gets the sequence reward).
    gae_lambda: float = 1.0
    # Max weight-version lag of a sample when trained on (0 = synchronous, strictly on-policy).
    max_head_offpolicyness: int = 0
    # Decoupled PPO: proximal logprobs recomputed by the trainer, behaviour weight capped.
    use_decoupled_loss: bool = False
    # Cap of the behaviour importance weight exp(proximal - behaviour) under decoupled loss.
    behav_imp_weight_cap: float = 5.0
    # Reward functions, by registry name, summed (math, gsm8k, toy, a name of reward_plugins, or a
    # dotted path pkg.mod:fn / file.py:fn). A function is (prompt, completion, sample) -> float, or
    # a dict with "reward" (other numeric keys are logged as reward/<key>).
    reward_fns: list[str] = field(default_factory=lambda: ["math"])
    # Named reward plug-ins, name -> dotted path: {mine: my_pkg.rewards:score} makes "mine" usable
    # in reward_fns. The module must be importable on every node (installed or on PYTHONPATH).
    reward_plugins: dict[str, str] = field(default_factory=dict)
    # Seconds one reward call may take; past it (or if it raises) the sample's reward is 0 and
    # the failure is counted (reward_failures) and logged once per kind.
    reward_timeout_s: float = 15.0
    # Reward processes per rollout engine (calls run there, so a bad reward cannot hang or crash
    # the engine).
    reward_workers: int = 2
    # Added to the task reward when the completion matches format_pattern (0 = off).
    format_reward: float = 0.0
    # Regex (Python re, searched with DOTALL) a well-formatted completion matches: by default
    # a closed think block followed by a boxed answer.
    format_pattern: str = "</think>.*\\\\boxed\\{"
    # Truncated answers (no eos within max_new_tokens) get non_stop_penalty_value as their task
    # reward instead of the verifier's (open-instruct's non-stop penalty).
    non_stop_penalty: bool = False
    # The task reward of a truncated answer when non_stop_penalty is on.
    non_stop_penalty_value: float = 0.0
    # Rollout workflow of one prompt: "" = single-turn generate + verify, or a dotted path
    # pkg.mod:obj / file.py:obj to an async function (engine, row) or a class with
    # `async arun_episode(engine, row)` (see areal_kit/rl/workers/workflow.py).
    workflow: str = ""
    # Generation settings.
    gen: GenConfig = field(default_factory=GenConfig)

    def __post_init__(self):
        check(self.group_size >= 1, f"ppo.group_size={self.group_size} is not valid; expected >= 1")
        check(not (self.group_adv_norm and self.group_size < 2),
              f"ppo.group_size={self.group_size} with ppo.group_adv_norm=true (GRPO) is not valid: "
              "a group of 1 has no baseline; set ppo.group_size >= 2 or ppo.group_adv_norm=false")
        check(0 < self.eps_clip < 1, f"ppo.eps_clip={self.eps_clip} is not valid; expected 0 < eps_clip < 1")
        check_positive("ppo.kl_ctl", self.kl_ctl, allow_zero=True)
        check_choice("ppo.kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        check_choice("ppo.kl_mode", self.kl_mode, ("reward", "loss"))
        check_positive("ppo.ppo_n_minibatches", self.ppo_n_minibatches)
        check_choice("ppo.loss_agg", self.loss_agg, LOSS_AGG)
        check(0 < self.discount <= 1, f"ppo.discount={self.discount} is not valid; expected 0 < discount <= 1")
        check(0 <= self.gae_lambda <= 1, f"ppo.gae_lambda={self.gae_lambda} is not valid; expected 0..1")
        check_positive("ppo.max_head_offpolicyness", self.max_head_offpolicyness, allow_zero=True)
        check(self.behav_imp_weight_cap > 1,
              f"ppo.behav_imp_weight_cap={self.behav_imp_weight_cap} is not valid; expected > 1")
        check(len(self.reward_fns) > 0, "ppo.reward_fns is empty; expected at least one reward, e.g. [math]")
        check(self.reward_timeout_s > 0, f"ppo.reward_timeout_s={self.reward_timeout_s} is not valid; expected > 0")
        check_positive("ppo.reward_workers", self.reward_workers)
        try:
            re.compile(self.format_pattern)
        except re.error as e:
            raise ConfigError(f"ppo.format_pattern={self.format_pattern!r} is not a valid regex ({e}); "
                              "expected a Python regular expression") from None
        for name, path in self.reward_plugins.items():
            check(bool(name) and ":" in str(path), f"ppo.reward_plugins.{name}={path!r} is not valid; "
                  "expected name: pkg.module:function")
        # Paths to .py files are made absolute here, where they were written: workers run elsewhere.
        self.reward_fns = [_abs_file_spec(x) for x in self.reward_fns]
        self.reward_plugins = {k: _abs_file_spec(v) for k, v in self.reward_plugins.items()}
        self.workflow = _abs_file_spec(self.workflow)


def _abs_file_spec(spec: str) -> str:
    """"rewards.py:score" -> "/abs/rewards.py:score"; names and dotted module paths unchanged."""
    path, sep, attr = str(spec).rpartition(":")
    if sep and path.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(path))}:{attr}"
    return spec


@dataclass
class ModelConfig:
    # Hugging Face model folder, or tiny://toy | tiny://bpe for a locally built tiny model.
    path: str = ""
    # Learning rate (constant after warmup).
    lr: float = 1e-6
    # Optimizer: adamw (torch AdamW passed to DeepSpeed; its config AdamW JIT-builds FusedAdam).
    optimizer: str = "adamw"
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW betas.
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # Fraction of total steps used for linear warmup.
    warmup_steps_proportion: float = 0.0
    # LR schedule after warmup: constant | cosine | linear.
    lr_scheduler: str = "constant"
    # Gradient norm clip (0 = off).
    gradient_clipping: float = 1.0
    # DeepSpeed ZeRO stage 0..3.
    zero_stage: int = 2
    # Recompute activations in backward to save memory.
    gradient_checkpointing: bool = False
    # Training dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32.
    dtype: str = "auto"

    def __post_init__(self):
        check(self.lr > 0, f"actor.lr={self.lr} is not valid; expected > 0")
        check_choice("actor.optimizer", self.optimizer, ("adamw",))
        check_choice("actor.lr_scheduler", self.lr_scheduler, ("constant", "cosine", "linear"))
        check_choice("actor.zero_stage", self.zero_stage, (0, 1, 2, 3))
        check_choice("actor.dtype", self.dtype, ("auto", "bf16", "fp32"))
        check(0 <= self.warmup_steps_proportion < 1,
              f"actor.warmup_steps_proportion={self.warmup_steps_proportion} is not valid; expected 0..1")
        check(len(self.adam_betas) == 2, f"actor.adam_betas={self.adam_betas} is not valid; expected two numbers")


@dataclass
class RefConfig:
    # Reference model folder ("" = same as actor.path). Loaded only when ppo.kl_ctl > 0.
    path: str = ""


@dataclass
class MBSpec:
    # Most tokens in one packed micro-batch (prompt + answer tokens, no padding).
    max_tokens_per_mb: int = 19456

    def __post_init__(self):
        check_positive("mb_spec.max_tokens_per_mb", self.max_tokens_per_mb)


@dataclass
class MFCConfig:
    # Micro-batch spec of this model function call.
    mb_spec: MBSpec = field(default_factory=MBSpec)


@dataclass
class DatasetConfig:
    # Dataset: a jsonl file, a HF datasets folder, or "" for the built-in toy task.
    path: str = ""
    # Format: toy | areal (prompt + query_id, with id2info.json) | jsonl | hf.
    type: str = "toy"
    # areal format: id2info.json ("" = next to path).
    id2info_path: str = ""
    # jsonl/hf: field holding the question.
    question_field: str = "question"
    # jsonl/hf: field holding the reference answer.
    answer_field: str = "answer"
    # Prompts per training step (the batch is train_bs_n_seqs x ppo.group_size sequences).
    train_bs_n_seqs: int = 1024
    # Prompts longer than this (tokens) are dropped and counted, never truncated.
    max_prompt_len: int = 2048
    # Apply the tokenizer's chat template to prompts.
    apply_chat_template: bool = False
    # Toy task only: number of generated prompts.
    toy_size: int = 4096
    # Shuffle the prompt order each epoch (seeded).
    shuffle: bool = True
    # In-training eval split: a file/folder of the same type and fields ("" = hold out
    # eval_size prompts of the training data instead; they are then never trained on).
    eval_path: str = ""
    # Prompts in the eval split: the first N of eval_path (0 = all), or N held out of the
    # training data when eval_path is "".
    eval_size: int = 0

    def __post_init__(self):
        check_choice("dataset.type", self.type, ("toy", "areal", "jsonl", "hf"))
        check(self.type == "toy" or bool(self.path),
              f"dataset.path is empty for dataset.type={self.type}; expected a file or folder")
        check_positive("dataset.train_bs_n_seqs", self.train_bs_n_seqs)
        check_positive("dataset.max_prompt_len", self.max_prompt_len)
        check_positive("dataset.toy_size", self.toy_size)
        check_positive("dataset.eval_size", self.eval_size, allow_zero=True)


@dataclass
class ExpCtrl:
    # Epochs over the dataset.
    total_train_epochs: int = 10
    # Stop after this many global steps (0 = run all epochs).
    total_train_steps: int = 0
    # Persistent HF saves every N epochs / steps / seconds (0 = off); a final save always happens.
    save_freq_epochs: int = 1
    save_freq_steps: int = 0
    save_freq_secs: int = 0
    # Keep only the last N persistent saves (0 = keep all).
    keep_last_n: int = 0
    # Recover checkpoints every N epochs / steps / seconds (0 = off); also after global step 2.
    ckpt_freq_epochs: int = 0
    ckpt_freq_steps: int = 0
    ckpt_freq_secs: int = 600
    # In-training evaluation on the held-out split every N steps (0 = off): greedy, pass@1 by the
    # grader of `areal-kit eval`; the split is dataset.eval_path or dataset.eval_size.
    eval_every: int = 0
    # Answer budget of the in-training eval (0 = ppo.gen.max_new_tokens).
    eval_max_new_tokens: int = 0
    # SIGTERM (a scheduler's stop, `kill`) during training. checkpoint: finish the
    # step, write its recover checkpoint, stop (a second SIGTERM stops at once); give it the grace
    # of a step plus a checkpoint (Slurm: --signal=B:TERM@SECONDS). stop: stop at once; a re-run
    # resumes from the last periodic checkpoint.
    on_sigterm: str = "checkpoint"

    def __post_init__(self):
        for name in ("total_train_epochs",):
            check_positive(f"exp_ctrl.{name}", getattr(self, name))
        for name in ("total_train_steps", "save_freq_epochs", "save_freq_steps", "save_freq_secs",
                     "keep_last_n", "ckpt_freq_epochs", "ckpt_freq_steps", "ckpt_freq_secs", "eval_every",
                     "eval_max_new_tokens"):
            check_positive(f"exp_ctrl.{name}", getattr(self, name), allow_zero=True)
        check_choice("exp_ctrl.on_sigterm", self.on_sigterm, ("checkpoint", "stop"))


@dataclass
class TrainConfig:
    # Experiment name (a folder level under fileroot).
    experiment_name: str = "areal"
    # Trial name (a folder level under the experiment).
    trial_name: str = "run0"
    # Where the job runs: ray (a local or existing Ray cluster).
    mode: str = "ray"
    # Nodes in the cluster.
    n_nodes: int = 1
    # GPUs per node (on CPU: worker slots per node, one per trainer rank or rollout engine).
    n_gpus_per_node: int = 8
    # Device allocation: d{DP}m{TP}p{PP}, actor_gen:...,*:..., or vllm.GEN+TRAIN (see config/alloc.py).
    allocation_mode: str = "vllm.d1p1m1+d1p1m1"
    # Cluster spec file (JSON, the guide's format); gives fileroot and n_gpus_per_node on clusters.
    cluster: str = ""
    # Root of logs, recover files and checkpoints ("" = ./areal_runs, or the cluster spec's).
    fileroot: str = ""
    # Shared storage root that presets' model and data paths live under.
    storage_root: str = "/storage"
    # Ray cluster to join ("" = start a local one; "auto" or host:port = existing).
    ray_address: str = ""
    # Place trainer and rollout actors on different nodes (multi-node clusters).
    spread_roles: bool = False
    # CPU only: cores per worker. split = each trainer rank and each engine gets its own cores (as
    # each gets its own GPU), so overlapped generation and training do not fight over them;
    # shared = every worker uses every core; auto = split when generation and training overlap
    # (ppo.max_head_offpolicyness > 0) on a local Ray with a core per worker, else shared.
    cpu_cores: str = "auto"
    # Weight sync after each update, in memory or through storage. broadcast: rank 0 of the
    # trainer sends the tensors over a NCCL (GPU) or gloo (CPU) group. auto: the same, except
    # that on CPU, when every engine is on the trainer's node, it writes them straight into the
    # engines' parameters (shared memory). disk: save a checkpoint, engines reload it.
    weight_sync: str = "auto"
    # Seconds the weight-sync group waits at its rendezvous and in any one broadcast before it
    # fails (on GPUs, NCCL's watchdog timeout): a sync stuck on a dead peer becomes an error.
    weight_sync_timeout_s: float = 600.0
    # Seed for data order, sampling and initialization.
    seed: int = 1
    # recover_mode: auto (resume a matching checkpoint) | resume (must resume) | fault (only
    # relaunch after failures) | disabled.
    recover_mode: str = "auto"
    # Relaunches from the last recover checkpoint after a worker failure.
    recover_retries: int = 1
    # Write tensorboard event files next to metrics.jsonl.
    tensorboard: bool = True
    # Weights & Biases project ("" = off). The API key comes from WANDB_API_KEY, never from config.
    wandb_project: str = ""
    actor: ModelConfig = field(default_factory=ModelConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    actor_train: MFCConfig = field(default_factory=MFCConfig)
    ref_inf: MFCConfig = field(default_factory=MFCConfig)
    exp_ctrl: ExpCtrl = field(default_factory=ExpCtrl)

    def __post_init__(self):
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            check(bool(value) and "/" not in value and not value.startswith("."),
                  f"{name}={value!r} is not valid; expected a non-empty name without '/'")
        check_choice("mode", self.mode, ("ray",))
        check_positive("n_nodes", self.n_nodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_choice("weight_sync", self.weight_sync, ("auto", "broadcast", "disk"))
        check(self.weight_sync_timeout_s > 0,
              f"weight_sync_timeout_s={self.weight_sync_timeout_s} is not valid; expected > 0 seconds")
        check_choice("cpu_cores", self.cpu_cores, ("auto", "split", "shared"))
        check_choice("recover_mode", self.recover_mode, ("auto", "resume", "fault", "disabled"))
        check_positive("recover_retries", self.recover_retries, allow_zero=True)
        check(bool(self.actor.path), "actor.path is empty; expected a model folder or tiny://toy")
        check(not self.exp_ctrl.eval_every or bool(self.dataset.eval_path) or self.dataset.eval_size > 0,
              f"exp_ctrl.eval_every={self.exp_ctrl.eval_every} needs an eval split; set dataset.eval_size "
              "(prompts held out of training) or dataset.eval_path")
        check(self.exp_ctrl.eval_max_new_tokens <= self.ppo.gen.max_new_tokens,
              f"exp_ctrl.eval_max_new_tokens={self.exp_ctrl.eval_max_new_tokens} is not valid; expected "
              f"<= ppo.gen.max_new_tokens ({self.ppo.gen.max_new_tokens}), the engines' length budget")
        seq = self.dataset.max_prompt_len + self.ppo.gen.max_new_tokens
        for role in ("actor_train", "ref_inf"):
            mb = getattr(self, role).mb_spec.max_tokens_per_mb
            check(mb >= seq, f"{role}.mb_spec.max_tokens_per_mb={mb} is smaller than one sequence "
                  f"(dataset.max_prompt_len + ppo.gen.max_new_tokens = {seq}); expected >= {seq}")
        from areal_kit.config.alloc import parse_allocation

        parse_allocation(self.allocation_mode).check(self.n_nodes, self.n_gpus_per_node)

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.n_gpus_per_node

"""The training configuration: dataclasses with documented fields, validated in __post_init__.

Names follow the AReaL v0.1 guide where it has one (experiment_name, allocation_mode,
ppo.gen.max_new_tokens, actor_train.mb_spec.max_tokens_per_mb, exp_ctrl.*). Each field is
declared with `opt(default, help)` (or `section(Class, help)` for a group of options, both in
config/fields.py): its help, and its choices where the value is one of a fixed set, live in the
field's metadata, where `areal-kit train PRESET --show-args [--json]` and the validation below
read them. Sections with a module of their own: dataset.* (config/dataset.py), actor.vllm
(config/vllm_args.py) and actor.lora (config/lora.py); config/assets.py checks the assets entries.
Presets (train_scripts/*.yaml) and `key=value` overrides are merged by config/loader.py.

    from dataclasses import fields
    {f.name: f.metadata["help"] for f in fields(GenConfig)}
"""

# opt() and section() return dataclasses.field(...), with a fresh default per instance where it is
# mutable; ruff's RUF009 knows only field() itself by name.
# ruff: noqa: RUF009

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from areal_kit.config.agent import AgentConfig
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.assets import asset
from areal_kit.config.dataset import DatasetConfig
from areal_kit.config.fields import check, check_choices, check_positive, opt, section
from areal_kit.config.lora import LoRAConfig
from areal_kit.config.rollout import RolloutConfig
from areal_kit.config.vllm_args import VLLMConfig
from areal_kit.errors import ConfigError


@dataclass
class GenConfig:
    max_new_tokens: int = opt(16384, "Most tokens generated per answer.")
    min_new_tokens: int = opt(0, "Fewest tokens generated per answer (eos is suppressed before this).")
    temperature: float = opt(0.6, "Sampling temperature; the trainer divides logits by the same value.")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(-1, "Top-k sampling (-1 = off).")

    def __post_init__(self) -> None:
        check_positive("ppo.gen.max_new_tokens", self.max_new_tokens)
        check(0 <= self.min_new_tokens <= self.max_new_tokens,
              f"ppo.gen.min_new_tokens={self.min_new_tokens} is not valid; expected 0..max_new_tokens ({self.max_new_tokens})")
        check(self.temperature > 0, f"ppo.gen.temperature={self.temperature} is not valid; expected > 0 "
              "(RL needs sampling; greedy belongs to eval)")
        check(0 < self.top_p <= 1, f"ppo.gen.top_p={self.top_p} is not valid; expected 0 < top_p <= 1")
        check(self.top_k == -1 or self.top_k > 0, f"ppo.gen.top_k={self.top_k} is not valid; expected -1 or > 0")


@dataclass
class PPOConfig:
    group_size: int = opt(8, "Answers sampled per prompt.")
    eps_clip: float = opt(0.2, "PPO clip range of the probability ratio.")
    eps_clip_high: float = opt(0.0,
        "Upper clip range when it differs from eps_clip: DAPO's clip-higher (0.28 with eps_clip 0.2) "
        "lets unlikely tokens with a positive advantage grow, against entropy collapse (0 = eps_clip).")
    kl_ctl: float = opt(0.0, "KL coefficient to the frozen reference model (0 = no reference model is loaded).")
    kl_estimator: str = opt("k1",
        "KL estimator: k1 (log-ratio), k2 (squared log-ratio / 2), k3 (Schulman's unbiased, >= 0).",
        choices=("k1", "k2", "k3"))
    kl_mode: str = opt("reward",
        "Where the KL goes: \"reward\" (penalty per token, the guide's kl_reward) or \"loss\" (a loss term).",
        choices=("reward", "loss"))
    ppo_n_minibatches: int = opt(1, "Optimizer steps per batch: the batch is split into this many minibatches.")
    loss_agg: str = opt("token-mean",
        "How token losses become the batch loss: token-mean (every token of the global batch alike; "
        "long answers weigh more), seq-mean-token-mean (every answer alike, the GRPO paper's), or "
        "seq-mean-token-sum-norm (token sums over max_new_tokens, averaged over answers: Dr. GRPO's; under "
        "a multi-turn ppo.workflow or agent.fn, over dataset.max_prompt_len + max_new_tokens, the most an "
        "episode's model turns can hold).",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    reward_output_scaling: float = opt(1.0, "Multiply the verifier's reward by this (the guide uses 5).")
    reward_output_bias: float = opt(0.0,
        "Added to the reward after scaling (the guide's ppo-math uses -0.5 with scaling 1; 0 = none).")
    adv_norm: bool = opt(True, "Normalize advantages over the whole batch (AReaL ppo-math).")
    group_adv_norm: bool = opt(False, "Normalize rewards within each prompt's group (GRPO). Needs group_size >= 2.")
    skip_zero_adv_groups: bool = opt(False,
        "Drop groups whose rewards are all equal (they carry no signal; counted as perc_zero_adv).")
    discount: float = opt(1.0, "Discount factor for returns over tokens.")
    max_head_offpolicyness: int = opt(0,
        "Max weight-version lag of a sample when trained on (0 = synchronous, strictly on-policy).")
    use_decoupled_loss: bool = opt(False,
        "Decoupled PPO: proximal logprobs recomputed by the trainer, behaviour weight capped.")
    behav_imp_weight_cap: float = opt(5.0,
        "Cap of the behaviour importance weight exp(proximal - behaviour) under decoupled loss.")
    reward_fns: list[str] = opt(["math"],
        "Reward functions, by registry name, summed (math, gsm8k, toy, a name of reward_plugins, or a "
        "dotted path pkg.mod:fn / file.py:fn). A function is (prompt, completion, sample) -> float, or "
        'a dict with "reward" (other numeric keys are logged as reward/<key>).')
    reward_plugins: dict[str, str] = opt({},
        'Named reward plug-ins, name -> dotted path: {mine: my_pkg.rewards:score} makes "mine" usable '
        "in reward_fns. The module must be importable on every node (installed or on PYTHONPATH).")
    reward_timeout_s: float = opt(15.0,
        "Seconds one reward call may take; past it (or if it raises) the sample's reward is 0 and "
        "the failure is counted (reward_failures) and logged once per kind.")
    reward_workers: int = opt(2,
        "Reward processes per rollout engine (calls run there, so a bad reward cannot hang or crash "
        "the engine).")
    format_reward: float = opt(0.0, "Added to the task reward when the completion matches format_pattern (0 = off).")
    format_pattern: str = opt("</think>.*\\\\boxed\\{",
        "Regex (Python re, searched with DOTALL) a well-formatted completion matches: by default "
        "a closed think block followed by a boxed answer.")
    non_stop_penalty: bool = opt(False,
        "Truncated answers (no eos within max_new_tokens) get non_stop_penalty_value as their task "
        "reward instead of the verifier's (open-instruct's non-stop penalty).")
    non_stop_penalty_value: float = opt(0.0, "The task reward of a truncated answer when non_stop_penalty is on.")
    dynamic_sampling: bool = opt(False,
        "DAPO's dynamic sampling: drop the groups whose task rewards (the verifier's, before any "
        "shaping) are all equal, and generate more prompts until the step holds "
        "dataset.train_bs_n_seqs informative groups (the surplus of the last round is discarded). "
        "Each step's extra rounds and dropped groups are in its metrics (dynamic/*).")
    dynamic_sampling_max_rounds: int = opt(4,
        "Extra generation rounds a step may take to fill its batch under dynamic_sampling; past them "
        "it trains on the informative groups it has (logged once).")
    overlong_buffer: int = opt(0,
        "DAPO's overlong reward shaping: an answer longer than ppo.gen.max_new_tokens - "
        "overlong_buffer tokens loses overlong_penalty_factor x (excess / overlong_buffer) of reward, "
        "a linear ramp down to -overlong_penalty_factor at max_new_tokens (0 = off).")
    overlong_penalty_factor: float = opt(1.0, "The overlong penalty of an answer of max_new_tokens tokens.")
    overlong_filter: bool = opt(False,
        "DAPO's overlong filtering: truncated answers (no eos within max_new_tokens) stay in their "
        "group's baseline but are masked out of the loss.")
    workflow: str = opt("",
        'Rollout workflow of one prompt: "" = single-turn generate + verify, or a dotted path '
        "pkg.mod:obj / file.py:obj to an async function (engine, row) or a class with "
        "`async arun_episode(engine, row)` (the contract: areal_kit/api.py).")
    gen: GenConfig = section(GenConfig, "Generation settings.")

    def __post_init__(self) -> None:
        check(self.group_size >= 1, f"ppo.group_size={self.group_size} is not valid; expected >= 1")
        check(not (self.group_adv_norm and self.group_size < 2),
              f"ppo.group_size={self.group_size} with ppo.group_adv_norm=true (GRPO) is not valid: "
              "a group of 1 has no baseline; set ppo.group_size >= 2 or ppo.group_adv_norm=false")
        check(0 < self.eps_clip < 1, f"ppo.eps_clip={self.eps_clip} is not valid; expected 0 < eps_clip < 1")
        check(self.eps_clip_high == 0 or self.eps_clip <= self.eps_clip_high < 1,
              f"ppo.eps_clip_high={self.eps_clip_high} is not valid; expected 0 (= eps_clip) or eps_clip "
              f"({self.eps_clip}) up to 1")
        check_positive("ppo.kl_ctl", self.kl_ctl, allow_zero=True)
        check_choices(self, "ppo.")
        check_positive("ppo.ppo_n_minibatches", self.ppo_n_minibatches)
        check(0 < self.discount <= 1, f"ppo.discount={self.discount} is not valid; expected 0 < discount <= 1")
        check_positive("ppo.max_head_offpolicyness", self.max_head_offpolicyness, allow_zero=True)
        check(self.behav_imp_weight_cap > 1,
              f"ppo.behav_imp_weight_cap={self.behav_imp_weight_cap} is not valid; expected > 1")
        check(len(self.reward_fns) > 0, "ppo.reward_fns is empty; expected at least one reward, e.g. [math]")
        check(self.reward_timeout_s > 0, f"ppo.reward_timeout_s={self.reward_timeout_s} is not valid; expected > 0")
        check_positive("ppo.reward_workers", self.reward_workers)
        check_positive("ppo.dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, allow_zero=True)
        check(not (self.dynamic_sampling and self.group_size < 2),
              f"ppo.dynamic_sampling=true with ppo.group_size={self.group_size} is not valid: a group of "
              "1 always has equal rewards; set ppo.group_size >= 2")
        check(0 <= self.overlong_buffer < self.gen.max_new_tokens,
              f"ppo.overlong_buffer={self.overlong_buffer} is not valid; expected 0 (off) up to "
              f"ppo.gen.max_new_tokens - 1 ({self.gen.max_new_tokens - 1})")
        check_positive("ppo.overlong_penalty_factor", self.overlong_penalty_factor, allow_zero=True)
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
    path: str = opt("", "Hugging Face model folder, or tiny://toy | tiny://bpe for a locally built tiny model "
        "(its shape by query: tiny://toy?hidden=128&layers=4).")
    lr: float = opt(1e-6, "Learning rate (constant after warmup).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    adam_betas: list[float] = opt([0.9, 0.999], "AdamW betas.")
    warmup_steps_proportion: float = opt(0.0, "Fraction of total steps used for linear warmup.")
    lr_scheduler: str = opt("constant", "LR schedule after warmup: constant | cosine | linear.",
        choices=("constant", "cosine", "linear"))
    gradient_clipping: float = opt(1.0, "Gradient norm clip (0 = off).")
    zero_stage: int = opt(2, "DeepSpeed ZeRO stage 0..3.", choices=(0, 1, 2, 3))
    gradient_checkpointing: bool = opt(False, "Recompute activations in backward to save memory.")
    dtype: str = opt("auto", "Training dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32.",
        choices=("auto", "bf16", "fp32"))
    vllm: VLLMConfig = section(VLLMConfig, "The rollout engines' vLLM arguments (the guide's actor.vllm).")
    lora: LoRAConfig = section(LoRAConfig, "Train a LoRA adapter instead of the whole model (rank 0 = off).")

    def __post_init__(self) -> None:
        check(self.lr > 0, f"actor.lr={self.lr} is not valid; expected > 0")
        check_choices(self, "actor.")
        check(0 <= self.warmup_steps_proportion < 1,
              f"actor.warmup_steps_proportion={self.warmup_steps_proportion} is not valid; expected 0..1")
        check(len(self.adam_betas) == 2, f"actor.adam_betas={self.adam_betas} is not valid; expected two numbers")


@dataclass
class RefConfig:
    path: str = opt("", 'Reference model folder ("" = same as actor.path). Loaded only when ppo.kl_ctl > 0.')


@dataclass
class MBSpec:
    max_tokens_per_mb: int = opt(19456, "Most tokens in one packed micro-batch (prompt + answer tokens, no padding).")

    def __post_init__(self) -> None:
        check_positive("mb_spec.max_tokens_per_mb", self.max_tokens_per_mb)


@dataclass
class MFCConfig:
    mb_spec: MBSpec = section(MBSpec, "Micro-batch spec of this model function call.")


# exp_ctrl's two schedules, persistent saves and recover checkpoints: an option per unit, each a
# trigger of its own; their help is one sentence naming the unit.
_FREQ_UNITS = {"epochs": "epochs", "steps": "steps", "secs": "seconds"}
_FREQ_KINDS = {"save": ("Persistent HF saves", "a final save always happens"),
               "ckpt": ("Recover checkpoints", "also after global step 2")}
FREQS = tuple(f"{kind}_freq_{unit}" for kind in _FREQ_KINDS for unit in _FREQ_UNITS)


def _freq(default: int, kind: str, unit: str) -> int | None:
    """The option `<kind>_freq_<unit>`: N units between two saves of the kind."""
    what, also = _FREQ_KINDS[kind]
    return opt(default, f"{what} every N {_FREQ_UNITS[unit]} (0 or null = off); {also}.")


@dataclass
class ExpCtrl:
    total_train_epochs: int = opt(10, "Epochs over the dataset.")
    total_train_steps: int = opt(0, "Stop after this many global steps (0 = run all epochs).")
    save_freq_epochs: int | None = _freq(1, "save", "epochs")
    save_freq_steps: int | None = _freq(0, "save", "steps")
    save_freq_secs: int | None = _freq(0, "save", "secs")
    keep_last_n: int = opt(0, "Keep only the last N persistent saves (0 = keep all).")
    ckpt_freq_epochs: int | None = _freq(0, "ckpt", "epochs")
    ckpt_freq_steps: int | None = _freq(0, "ckpt", "steps")
    ckpt_freq_secs: int | None = _freq(600, "ckpt", "secs")
    eval_every: int = opt(0,
        "In-training evaluation on the held-out split every N steps (0 = off): greedy, pass@1 by the "
        "grader of `areal-kit eval`; the split is dataset.eval_path or dataset.eval_size.")
    eval_max_new_tokens: int = opt(0, "Answer budget of the in-training eval (0 = ppo.gen.max_new_tokens).")
    eval_n_samples: int = opt(0,
        "In-training eval: also sample this many answers per question (ppo.gen's temperature and "
        "top_p) and report avg@k (mean accuracy of the samples) and the unbiased pass@k beside greedy "
        "pass@1: less noise on a small eval set (0 = greedy only).")
    dump_samples_every: int = opt(10,
        "Every N steps, write the prompts, answers, rewards and advantages of dump_samples_groups "
        "groups to samples.jsonl in the log folder (`areal-kit logs RUN --samples`; 0 = off).")
    dump_samples_groups: int = opt(2, "Groups written each time samples are dumped.")
    dump_sample_tokens: bool = opt(True,
        "Dumped samples carry per-token fields (each token's text, sampling logprob, loss mask and weight "
        "version, and the trainer's logprob, ratio, reference KL and entropy) for `areal-kit view`'s token "
        "view; false writes the answer's text only, ~50 bytes a token less (docs/view.md), and the page "
        "shows the text without colours.")
    stop_after_failed_reward_steps: int = opt(3,
        "Stop the run (exit 1, naming the first error) when every sample's reward failed in this many "
        "steps in a row: it cannot learn. No checkpoint is written during such a streak, so the last "
        "recover checkpoint is from before it (0 = never stop).")
    hang_factor: float = opt(10.0,
        "Watchdog: a worker call (a generation, a train step, a weight sync, a save) running longer "
        "than this many times the median of its kind is a hang: every worker's Python stacks go to "
        "<log dir>/stacks/, the workers stop, and the run relaunches from the last recover checkpoint "
        "(a retry). 0 = off.")
    hang_floor_s: float = opt(300.0, "Watchdog: a call is never a hang before this many seconds.")
    hang_first_s: float = opt(1800.0,
        "Watchdog: the bound of the first hang_warmup calls of each kind (compilation, caches), and "
        "the timeout of the trainers' collectives.")
    hang_warmup: int = opt(3, "Watchdog: calls of a kind before its median sets the bound.")
    hang_ceiling_s: float = opt(0.0,
        "Watchdog: no call after the warm-up may run longer than this, whatever the median of its "
        "kind (0 = no ceiling: generations that grow with the answers keep a fair bound).")
    on_sigterm: str = opt("checkpoint",
        "SIGTERM (a scheduler's stop, `kill`) during training. checkpoint: finish the "
        "step, write its recover checkpoint, stop (a second SIGTERM stops at once); give it the grace "
        "of a step plus a checkpoint (Slurm: --signal=B:TERM@SECONDS). stop: stop at once; a re-run "
        "resumes from the last periodic checkpoint.", choices=("checkpoint", "stop"))

    def __post_init__(self) -> None:
        for name in FREQS:  # null (the guide's save_freq_steps=null) is off, as 0 is
            setattr(self, name, getattr(self, name) or 0)
        for name in ("total_train_epochs",):
            check_positive(f"exp_ctrl.{name}", getattr(self, name))
        for name in ("total_train_steps", *FREQS, "keep_last_n", "eval_every",
                     "eval_max_new_tokens", "eval_n_samples", "stop_after_failed_reward_steps", "dump_samples_every",
                     "dump_samples_groups", "hang_factor", "hang_warmup", "hang_ceiling_s"):
            check_positive(f"exp_ctrl.{name}", getattr(self, name), allow_zero=True)
        for name in ("hang_floor_s", "hang_first_s"):
            check_positive(f"exp_ctrl.{name}", getattr(self, name))
        check_choices(self, "exp_ctrl.")


@dataclass
class TrainConfig:
    experiment_name: str = opt("areal", "Experiment name (a folder level under fileroot).")
    trial_name: str = opt("run0", "Trial name (a folder level under the experiment).")
    n_nodes: int = opt(1, "Nodes in the cluster.")
    n_gpus_per_node: int = opt(8,
        "GPUs per node (on CPU: worker slots per node, one per trainer rank or rollout engine).")
    gpu_memory_gb: float = opt(0.0,
        "Memory of each GPU in GB (1e9 bytes), for the dry run's memory plan, which refuses a preset that "
        "cannot fit (0 = this machine's first GPU when it has one, else 85, what CUDA reports of an 80 GB card).")
    allocation_mode: str = opt("vllm.d1p1m1+d1p1m1",
        "Device allocation: d{DP}m{TP}p{PP}, actor_gen:...,*:..., or vllm.GEN+TRAIN (see config/alloc.py).")
    cluster: str = opt("",
        "Cluster spec file (JSON, the guide's format); gives fileroot and n_gpus_per_node on clusters.")
    fileroot: str = opt("", "Root of logs, recover files and checkpoints (\"\" = the cluster spec's, else "
                            "$AREAL_KIT_FILEROOT, which setup's runtime sets, else ./areal_runs).")
    storage_root: str = opt("/storage", "Shared storage root that presets' model and data paths live under "
                            "($AREAL_KIT_STORAGE_ROOT, which setup's runtime sets, replaces the default).")
    assets: dict[str, dict] = opt({},
        "What the run reads from shared storage and where it comes from, name -> {uri, dest, sha256}: "
        "`areal-kit setup --train_param PRESET` fetches each uri to dest once, verified (sha256 optional), "
        "with the eval sets. dest names the path the preset reads (${actor.path}, ${dataset.path}); uri \"\" "
        "leaves the path to you. uri: hf://ORG/NAME, hf://datasets/ORG/NAME, https://.../FILE, "
        "https://.../FOLDER/ (with its .areal-kit-manifest.json), file:///PATH, tiny://toy?seed=N, "
        "toy://sums/FILE?n=N&seed=S.")
    ray_address: str = opt("", 'Ray cluster to join ("" = start a local one; "auto" or host:port = existing; '
                           '$AREAL_KIT_RAY_ADDRESS, which setup\'s runtime sets to "auto", replaces the default).')
    spread_roles: bool = opt(False, "Place trainer and rollout actors on different nodes (multi-node clusters).")
    cpu_cores: str = opt("auto",
        "CPU only: cores per worker. split = each trainer rank and each engine gets its own cores (as "
        "each gets its own GPU), so overlapped generation and training do not fight over them; "
        "shared = every worker uses every core; auto = split when generation and training overlap "
        "(ppo.max_head_offpolicyness > 0) on a local Ray with a core per worker, else shared. "
        "Under split, once the workers are up, the driver and Ray's daemons run on the trainer's cores.",
        choices=("auto", "split", "shared"))
    weight_sync: str = opt("auto",
        "Weight sync after each update, in memory or through storage. broadcast: rank 0 of the "
        "trainer sends the tensors over a NCCL (GPU) or gloo (CPU) group. auto: the same, except "
        "that on CPU, when every engine is on the trainer's node, it writes them straight into the "
        "engines' parameters (shared memory), and on GPUs that generation and training share it is "
        "ipc. ipc: each trainer rank hands the engine worker on its device a buffer of the new "
        "weights, a chunk at a time (CUDA IPC on GPUs, shared memory on CPU); shared layouts only. "
        "disk: save a checkpoint, engines reload it.",
        choices=("auto", "broadcast", "ipc", "disk"))
    weight_sync_timeout_s: float = opt(600.0,
        "Seconds the weight-sync group waits at its rendezvous and in any one broadcast before it "
        "fails (on GPUs, NCCL's watchdog timeout): a sync stuck on a dead peer becomes an error.")
    seed: int = opt(1, "Seed for data order, sampling and initialization.")
    recover_mode: str = opt("auto",
        "recover_mode: auto (resume a matching checkpoint) | resume (must resume) | fault (only "
        "relaunch after failures) | disabled.", choices=("auto", "resume", "fault", "disabled"))
    recover_retries: int = opt(1, "Relaunches from the last recover checkpoint after a worker failure.")
    tensorboard: bool = opt(True, "Write tensorboard event files next to metrics.jsonl.")
    wandb_project: str = opt("",
        'Weights & Biases project ("" = off). The API key comes from WANDB_API_KEY, never from config.')
    actor: ModelConfig = section(ModelConfig, "The policy model: its weights, optimizer and training dtype.")
    ref: RefConfig = section(RefConfig, "The frozen reference model of the KL term.")
    ppo: PPOConfig = section(PPOConfig, "The RL algorithm: sampling, rewards, advantages and the PPO loss.")
    rollout: RolloutConfig = section(RolloutConfig, "How the engines generate: batch by batch or streaming.")
    agent: AgentConfig = section(AgentConfig, "An agent written against an OpenAI-style client, trained through "
                                 "the engines' chat endpoint.")
    dataset: DatasetConfig = section(DatasetConfig, "The prompts: where they come from, batch size and eval split.")
    actor_train: MFCConfig = section(MFCConfig, "Training pass of the actor (micro-batching).")
    ref_inf: MFCConfig = section(MFCConfig, "Inference pass of the reference model (micro-batching).")
    exp_ctrl: ExpCtrl = section(ExpCtrl, "Run length, saves, recover checkpoints, in-training eval, SIGTERM.")

    def __post_init__(self) -> None:
        for name in ("experiment_name", "trial_name"):
            value = getattr(self, name)
            check(bool(value) and "/" not in value and not value.startswith("."),
                  f"{name}={value!r} is not valid; expected a non-empty name without '/'")
        check_choices(self, "")
        check_positive("n_nodes", self.n_nodes)
        check_positive("n_gpus_per_node", self.n_gpus_per_node)
        check_positive("gpu_memory_gb", self.gpu_memory_gb, allow_zero=True)
        check(self.weight_sync_timeout_s > 0,
              f"weight_sync_timeout_s={self.weight_sync_timeout_s} is not valid; expected > 0 seconds")
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

        check(not (self.agent.fn and self.ppo.workflow),
              f"agent.fn={self.agent.fn!r} and ppo.workflow={self.ppo.workflow!r} are both set; expected one: "
              "an agent runs as the workflow of its episodes")
        self.agent.fn = _abs_file_spec(self.agent.fn)

        parse_allocation(self.allocation_mode).check(self.n_nodes, self.n_gpus_per_node)
        self.assets = {name: asset(name, a) for name, a in self.assets.items()}

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.n_gpus_per_node

"""The training configuration: dataclasses with documented fields, validated in __post_init__.

Names follow the AReaL v0.1 guide where it has one (experiment_name, allocation_mode,
ppo.gen.max_new_tokens, actor_train.mb_spec.max_tokens_per_mb, exp_ctrl.*). Each field is
declared with `opt(default, help)` (or `section(Class, help)` for a group of options): its
help, and its choices where the value is one of a fixed set, live in the field's metadata,
where `areal-kit train PRESET --show-args [--json]` and the validation below read them.
Presets (train_scripts/*.yaml) and `key=value` overrides are merged by config/loader.py.

    from dataclasses import fields
    {f.name: f.metadata["help"] for f in fields(GenConfig)}
"""

# opt() and section() return dataclasses.field(...), with a fresh default per instance where it is
# mutable; ruff's RUF009 knows only field() itself by name.
# ruff: noqa: RUF009

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from areal_kit.config.alloc import parse_allocation
from areal_kit.errors import ConfigError


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choice(name: str, value, choices) -> None:
    check(value in choices, f"{name}={value!r} is not valid; expected one of {', '.join(map(str, choices))}")


def check_positive(name: str, value, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    check(ok, f"{name}={value} is not valid; expected a number {'>= 0' if allow_zero else '> 0'}")


def opt(default, help_text: str, *, choices: tuple = ()):
    """A config option: its default, its help and, if its value is one of a fixed set, the choices."""
    meta = {"help": help_text, **({"choices": tuple(choices)} if choices else {})}
    if isinstance(default, (list, dict)):  # each config gets its own copy of a mutable default
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help_text: str):
    """A group of options (a nested dataclass, e.g. ppo.gen) with its help."""
    return field(default_factory=cls, metadata={"help": help_text})


def check_choices(obj, prefix: str) -> None:
    """Every field of obj declared with choices holds one of them; prefix names obj's section."""
    for f in dataclasses.fields(obj):
        if "choices" in f.metadata:
            check_choice(prefix + f.name, getattr(obj, f.name), f.metadata["choices"])


@dataclass
class GenConfig:
    max_new_tokens: int = opt(16384, "Most tokens generated per answer.")
    min_new_tokens: int = opt(0, "Fewest tokens generated per answer (eos is suppressed before this).")
    temperature: float = opt(0.6, "Sampling temperature; the trainer divides logits by the same value.")
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).")
    top_k: int = opt(-1, "Top-k sampling (-1 = off).")

    def __post_init__(self):
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
        "seq-mean-token-sum-norm (token sums over max_new_tokens, averaged over answers: Dr. GRPO's).",
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
        "`async arun_episode(engine, row)` (see areal_kit/rl/workers/workflow.py).")
    gen: GenConfig = section(GenConfig, "Generation settings.")

    def __post_init__(self):
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


# vllm.LLM arguments areal-kit sets itself -> where their value comes from (additional_engine_args
# may not set them: a second source of the same setting).
VLLM_RESERVED = {
    "model": "actor.path", "seed": "seed", "max_model_len": "dataset.max_prompt_len + ppo.gen.max_new_tokens",
    "tensor_parallel_size": "allocation_mode", "distributed_executor_backend": "allocation_mode",
    "dtype": "the device", "worker_extension_cls": "the weight sync", "logprobs_mode": "the PPO loss",
    **{k: f"actor.vllm.{k}" for k in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                                      "enforce_eager", "swap_space", "max_seq_len_to_capture")},
}


@dataclass
class VLLMConfig:
    """The guide's actor.vllm: arguments of the rollout engines' vllm.LLM (vLLM 0.32 names)."""
    gpu_memory_utilization: float = opt(0.85,
        "Share of each generation GPU vLLM may take (weights, activations, KV cache); lower it when "
        "vLLM runs out of GPU memory. GPU only: on CPU the KV cache is sized from the model "
        "(VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it).")
    max_num_seqs: int = opt(0,
        "Most sequences one engine decodes at once (0 = vLLM's default: 1024 on H100-class GPUs, else 256). "
        "Higher: more throughput while the KV cache holds them; lower: less memory, fewer preemptions.")
    max_num_batched_tokens: int = opt(0,
        "Most tokens one engine step processes, prefill chunks included (0 = vLLM's default); on CPU "
        "at least dataset.max_prompt_len + ppo.gen.max_new_tokens, as prompts are prefilled whole there.")
    enforce_eager: bool = opt(False,
        "Run the model eagerly, without CUDA graphs: less memory and a faster start, slower decoding "
        "(CPU engines always run eagerly).")
    swap_space: float = opt(0.0,
        "GiB of CPU swap per GPU in the guide's vLLM. Accepted for the guide's commands, with no effect: "
        "vLLM 0.32 (its V1 engine) has no CPU swap and recomputes a sequence it preempts; for vLLM out of "
        "memory lower gpu_memory_utilization or max_num_seqs (0 = unset).")
    max_seq_len_to_capture: int = opt(0,
        "Longest sequence run with CUDA graphs in the guide's vLLM. Accepted for the guide's commands, with "
        "no effect: vLLM 0.32 captures graphs per batch size; enforce_eager turns them off (0 = unset).")
    hybrid_train: bool = opt(False,
        "The guide's switch for generation and training sharing GPUs. Accepted, with no effect: "
        "allocation_mode decides (vllm.GEN+TRAIN keeps them apart, the other forms share).")
    additional_engine_args: dict[str, Any] = opt({},
        "Any other vllm.LLM argument by its vLLM 0.32 name, e.g. {cpu_offload_gb: 4, kv_cache_dtype: fp8}; "
        "those areal-kit sets itself are refused.")

    def __post_init__(self):
        check(0 < self.gpu_memory_utilization <= 1, f"actor.vllm.gpu_memory_utilization="
              f"{self.gpu_memory_utilization} is not valid; expected a fraction 0 < x <= 1, e.g. 0.85")
        for name in ("max_num_seqs", "max_num_batched_tokens", "swap_space", "max_seq_len_to_capture"):
            check_positive(f"actor.vllm.{name}", getattr(self, name), allow_zero=True)
        check(not self.max_num_batched_tokens or self.max_num_batched_tokens >= self.max_num_seqs,
              f"actor.vllm.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
              f"actor.vllm.max_num_seqs={self.max_num_seqs}; expected >= max_num_seqs (vLLM refuses less)")
        for key in self.additional_engine_args:
            check(str(key).isidentifier(), f"actor.vllm.additional_engine_args has key {key!r}; expected "
                  "vllm.LLM argument names, e.g. cpu_offload_gb")
            check(key not in VLLM_RESERVED, f"actor.vllm.additional_engine_args.{key} is not valid: areal-kit "
                  f"sets it from {VLLM_RESERVED.get(key)}; expected other vllm.LLM arguments")


@dataclass
class ModelConfig:
    path: str = opt("", "Hugging Face model folder, or tiny://toy | tiny://bpe for a locally built tiny model "
        "(its shape by query: tiny://toy?hidden=128&layers=4).")
    lr: float = opt(1e-6, "Learning rate (constant after warmup).")
    optimizer: str = opt("adamw",
        "Optimizer: adamw (torch AdamW passed to DeepSpeed; its config AdamW JIT-builds FusedAdam).",
        choices=("adamw",))
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

    def __post_init__(self):
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

    def __post_init__(self):
        check_positive("mb_spec.max_tokens_per_mb", self.max_tokens_per_mb)


@dataclass
class MFCConfig:
    mb_spec: MBSpec = section(MBSpec, "Micro-batch spec of this model function call.")


@dataclass
class DatasetConfig:
    path: str = opt("", 'Dataset: a jsonl file, a HF datasets folder, or "" for the built-in toy task.')
    type: str = opt("toy", "Format: toy | areal (prompt + query_id, with id2info.json) | jsonl | hf.",
        choices=("toy", "areal", "jsonl", "hf"))
    id2info_path: str = opt("", 'areal format: id2info.json ("" = next to path).')
    question_field: str = opt("question", "jsonl/hf: field holding the question.")
    answer_field: str = opt("answer", "jsonl/hf: field holding the reference answer.")
    mix: list[dict] = opt([],
        "Several training sources instead of path/type: [{path, type, weight, name}, ...] (other keys: "
        "id2info_path, question_field, answer_field; unset ones come from dataset.*). Training takes "
        "weight x a source's rows (0.5: a seeded half of them, 2: every row twice), shuffled together by seed; "
        "rows keep their source's name, and each source's task reward is logged (task_reward/NAME).")
    train_bs_n_seqs: int = opt(1024,
        "Prompts per training step (the batch is train_bs_n_seqs x ppo.group_size sequences).")
    max_prompt_len: int = opt(2048, "Prompts longer than this (tokens) are dropped and counted, never truncated.")
    apply_chat_template: bool = opt(False, "Apply the tokenizer's chat template to prompts.")
    toy_size: int = opt(4096, "Toy task only: number of generated prompts.")
    shuffle: bool = opt(True, "Shuffle the prompt order each epoch (seeded).")
    eval_path: str = opt("",
        'In-training eval split: a file/folder of the same type and fields ("" = hold out '
        "eval_size prompts of the training data instead; they are then never trained on).")
    eval_size: int = opt(0,
        "Prompts in the eval split: the first N of eval_path (0 = all), or N held out of the "
        'training data when eval_path is "".')

    def __post_init__(self):
        check_choices(self, "dataset.")
        check(not (self.mix and self.path), f"dataset.path={self.path!r} and dataset.mix are both set; expected "
              "one of them (put the path in the mix)")
        self.mix = [_mix_source(i, m, self) for i, m in enumerate(self.mix)]
        names = [m["name"] for m in self.mix]
        check(len(set(names)) == len(names), f"dataset.mix names {names} are not unique; expected a distinct "
              "name per source (give each a name:)")
        check(self.type == "toy" or bool(self.path) or bool(self.mix),
              f"dataset.path is empty for dataset.type={self.type}; expected a file or folder")
        check_positive("dataset.train_bs_n_seqs", self.train_bs_n_seqs)
        check_positive("dataset.max_prompt_len", self.max_prompt_len)
        check_positive("dataset.toy_size", self.toy_size)
        check_positive("dataset.eval_size", self.eval_size, allow_zero=True)


ASSET_KEYS = ("uri", "dest", "sha256")


def _asset(name: str, a) -> dict:
    """One assets entry, checked: {uri, dest, sha256} with sha256 "" when not given."""
    where = f"assets.{name}"
    check(bool(re.fullmatch(r"[\w.-]+", str(name))), f"{where} is not a valid name; expected letters, digits, _ . -")
    check(isinstance(a, dict), f"{where}={a!r} is not valid; expected {{uri, dest, sha256}}")
    extra = sorted(set(a) - set(ASSET_KEYS))
    check(not extra, f"{where} has unknown key(s) {', '.join(extra)}; expected some of {', '.join(ASSET_KEYS)}")
    out = {"uri": str(a.get("uri") or ""), "dest": str(a.get("dest") or ""), "sha256": str(a.get("sha256") or "")}
    check("://" in out["uri"] or not out["uri"], f"{where}.uri={out['uri']!r} is not valid; expected a URI such "
          "as hf://ORG/NAME, or \"\" for a path you fill yourself")
    check(out["dest"].startswith("/"), f"{where}.dest={out['dest']!r} is not valid; expected an absolute path "
          "(the path the preset reads, e.g. ${actor.path})")
    check(not out["sha256"] or bool(re.fullmatch(r"[0-9a-f]{64}", out["sha256"])),
          f"{where}.sha256={out['sha256']!r} is not valid; expected 64 lowercase hex digits")
    return out


MIX_KEYS = ("path", "type", "weight", "name", "id2info_path", "question_field", "answer_field")


def _mix_source(i: int, m, d: DatasetConfig) -> dict:
    """One dataset.mix entry, checked, with what it leaves unset taken from dataset.*."""
    where = f"dataset.mix[{i}]"
    check(isinstance(m, dict), f"{where}={m!r} is not valid; expected {{path, type, weight, name}}")
    extra = sorted(set(m) - set(MIX_KEYS))
    check(not extra, f"{where} has unknown key(s) {', '.join(extra)}; expected some of {', '.join(MIX_KEYS)}")
    out = {k: m.get(k, getattr(d, k, None)) for k in MIX_KEYS if k not in ("weight", "name")}
    types = next(f for f in dataclasses.fields(DatasetConfig) if f.name == "type").metadata["choices"]
    check_choice(f"{where}.type", out["type"], types)
    check(out["type"] == "toy" or bool(out["path"]), f"{where} has no path for type {out['type']}; expected a file "
          "or folder")
    w = m.get("weight", 1.0)
    check(isinstance(w, (int, float)) and w > 0, f"{where}.weight={w!r} is not valid; expected a number > 0")
    stem = os.path.splitext(os.path.basename(str(out["path"]).rstrip("/")))[0]
    name = str(m.get("name") or stem or out["type"])
    check(bool(re.fullmatch(r"[\w.-]+", name)), f"{where}.name={name!r} is not valid; expected letters, digits, _ . -")
    return {**out, "weight": float(w), "name": name}


@dataclass
class ExpCtrl:
    total_train_epochs: int = opt(10, "Epochs over the dataset.")
    total_train_steps: int = opt(0, "Stop after this many global steps (0 = run all epochs).")
    save_freq_epochs: int = opt(1,
        "Persistent HF saves every N epochs / steps / seconds (0 = off); a final save always happens.")
    save_freq_steps: int = opt(0,
        "Persistent HF saves every N epochs / steps / seconds (0 = off); a final save always happens.")
    save_freq_secs: int = opt(0,
        "Persistent HF saves every N epochs / steps / seconds (0 = off); a final save always happens.")
    keep_last_n: int = opt(0, "Keep only the last N persistent saves (0 = keep all).")
    ckpt_freq_epochs: int = opt(0,
        "Recover checkpoints every N epochs / steps / seconds (0 = off); also after global step 2.")
    ckpt_freq_steps: int = opt(0,
        "Recover checkpoints every N epochs / steps / seconds (0 = off); also after global step 2.")
    ckpt_freq_secs: int = opt(600,
        "Recover checkpoints every N epochs / steps / seconds (0 = off); also after global step 2.")
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

    def __post_init__(self):
        for name in ("total_train_epochs",):
            check_positive(f"exp_ctrl.{name}", getattr(self, name))
        for name in ("total_train_steps", "save_freq_epochs", "save_freq_steps", "save_freq_secs",
                     "keep_last_n", "ckpt_freq_epochs", "ckpt_freq_steps", "ckpt_freq_secs", "eval_every",
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
    mode: str = opt("ray", "Where the job runs: ray (a local or existing Ray cluster).", choices=("ray",))
    n_nodes: int = opt(1, "Nodes in the cluster.")
    n_gpus_per_node: int = opt(8,
        "GPUs per node (on CPU: worker slots per node, one per trainer rank or rollout engine).")
    gpu_memory_gb: float = opt(0.0,
        "Memory of each GPU in GB (1e9 bytes), for the dry run's memory plan, which refuses a preset that "
        "cannot fit (0 = this machine's first GPU when it has one, else 80).")
    allocation_mode: str = opt("vllm.d1p1m1+d1p1m1",
        "Device allocation: d{DP}m{TP}p{PP}, actor_gen:...,*:..., or vllm.GEN+TRAIN (see config/alloc.py).")
    cluster: str = opt("",
        "Cluster spec file (JSON, the guide's format); gives fileroot and n_gpus_per_node on clusters.")
    fileroot: str = opt("", "Root of logs, recover files and checkpoints (\"\" = ./areal_runs, or the cluster spec's).")
    storage_root: str = opt("/storage", "Shared storage root that presets' model and data paths live under.")
    assets: dict[str, dict] = opt({},
        "What the run reads from shared storage and where it comes from, name -> {uri, dest, sha256}: "
        "`areal-kit setup --train_param PRESET` fetches each uri to dest once, verified (sha256 optional), "
        "with the eval sets. dest names the path the preset reads (${actor.path}, ${dataset.path}); uri \"\" "
        "leaves the path to you. uri: hf://ORG/NAME, hf://datasets/ORG/NAME, https://.../FILE, "
        "https://.../FOLDER/ (with its .areal-kit-manifest.json), file:///PATH, tiny://toy?seed=N, "
        "toy://sums/FILE?n=N&seed=S.")
    ray_address: str = opt("", 'Ray cluster to join ("" = start a local one; "auto" or host:port = existing).')
    spread_roles: bool = opt(False, "Place trainer and rollout actors on different nodes (multi-node clusters).")
    cpu_cores: str = opt("auto",
        "CPU only: cores per worker. split = each trainer rank and each engine gets its own cores (as "
        "each gets its own GPU), so overlapped generation and training do not fight over them; "
        "shared = every worker uses every core; auto = split when generation and training overlap "
        "(ppo.max_head_offpolicyness > 0) on a local Ray with a core per worker, else shared.",
        choices=("auto", "split", "shared"))
    weight_sync: str = opt("auto",
        "Weight sync after each update, in memory or through storage. broadcast: rank 0 of the "
        "trainer sends the tensors over a NCCL (GPU) or gloo (CPU) group. auto: the same, except "
        "that on CPU, when every engine is on the trainer's node, it writes them straight into the "
        "engines' parameters (shared memory). disk: save a checkpoint, engines reload it.",
        choices=("auto", "broadcast", "disk"))
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
    dataset: DatasetConfig = section(DatasetConfig, "The prompts: where they come from, batch size and eval split.")
    actor_train: MFCConfig = section(MFCConfig, "Training pass of the actor (micro-batching).")
    ref_inf: MFCConfig = section(MFCConfig, "Inference pass of the reference model (micro-batching).")
    exp_ctrl: ExpCtrl = section(ExpCtrl, "Run length, saves, recover checkpoints, in-training eval, SIGTERM.")

    def __post_init__(self):
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

        parse_allocation(self.allocation_mode).check(self.n_nodes, self.n_gpus_per_node)
        self.assets = {name: _asset(name, a) for name, a in self.assets.items()}

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.n_gpus_per_node

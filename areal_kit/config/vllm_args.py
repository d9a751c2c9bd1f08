"""The guide's actor.vllm: the rollout engines' vllm.LLM arguments, and those areal-kit sets
itself (which additional_engine_args may not set)."""

# opt() returns dataclasses.field(...), with a fresh default per instance where it is mutable;
# ruff's RUF009 knows only field() itself by name.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_kit.config.fields import check, check_choices, check_positive, opt

# vllm.LLM arguments areal-kit sets itself -> where their value comes from (additional_engine_args
# may not set them: a second source of the same setting).
VLLM_RESERVED = {
    "model": "actor.path", "seed": "seed", "max_model_len": "dataset.max_prompt_len + ppo.gen.max_new_tokens",
    "tensor_parallel_size": "allocation_mode", "distributed_executor_backend": "allocation_mode",
    "dtype": "the device", "worker_extension_cls": "the weight sync", "logprobs_mode": "the PPO loss",
    **{k: "actor.lora" for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")},
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
    engine_core: str = opt("auto",
        "Where each engine's vLLM engine core (its scheduler and model worker) runs. process: in a "
        "process of its own, as on GPUs, where every call crosses vLLM's engine-core client; inline: "
        "inside the engine's Ray actor (CPU, one worker; GPUs and tensor-parallel engines keep vLLM's own "
        "processes). auto: process on GPUs and inline on CPU, "
        "where a one-worker engine's own processes cost the tiny preset's step and start-up "
        "(bench/engine_core.py).",
        choices=("auto", "process", "inline"))
    additional_engine_args: dict[str, Any] = opt({},
        "Any other vllm.LLM argument by its vLLM 0.32 name, e.g. {cpu_offload_gb: 4, kv_cache_dtype: fp8}; "
        "those areal-kit sets itself are refused.")

    def __post_init__(self) -> None:
        check_choices(self, "actor.vllm.")
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

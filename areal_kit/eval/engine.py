"""Generation for evaluation: one vLLM engine in this process, or data-parallel engines on Ray.

With several GPUs (on this node, or in the Ray cluster this process joins) the requests are
split across `GPUs // tp` vLLM engines, each a Ray actor holding `tp` GPUs; otherwise (one
GPU group, or the CPU) a single engine runs in-process. Both take token-id prompts and
return the generated token ids: the caller decodes them with the checkpoint's own tokenizer
(areal_kit/data/tokenizer.py), never with the one vLLM loads for itself through AutoTokenizer.

Engines run eager (vLLM's enforce_eager, no CUDA graphs) unless told otherwise: the guide's eval
numbers were made so, and a captured graph may round differently.

Each request carries its own sampling seed (derived from the run seed and the sample's key),
so a sample's completion does not depend on which engine or batch produced it: a resumed
run generates the missing samples exactly as an uninterrupted run would have.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from areal_kit import adapters, hardware
from areal_kit.config.vllm_args import VLLMConfig
from areal_kit.interrupts import sigterm_interrupts

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt


@dataclass(frozen=True)
class GenRequest:
    key: str  # the sample's key in the output records
    prompt_ids: tuple[int, ...]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None  # per-request sampling seed (None for greedy)


@dataclass(frozen=True)
class GenResult:
    key: str
    token_ids: tuple[int, ...]
    finish_reason: str


def _sampling_params(r: GenRequest) -> SamplingParams:
    from vllm import SamplingParams

    if r.temperature == 0:
        return SamplingParams(temperature=0.0, max_tokens=r.max_tokens, detokenize=False)
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                          seed=r.seed, detokenize=False)


def _generate(llm: LLM | adapters.AdapterLLM, requests: list[GenRequest]) -> list[GenResult]:
    prompts: list[TokensPrompt] = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
    outs = llm.generate(prompts, [_sampling_params(r) for r in requests], use_tqdm=False)
    results = []
    for r, o in zip(requests, outs):
        c = o.outputs[0]
        results.append(GenResult(r.key, tuple(c.token_ids), str(c.finish_reason)))
    return results


def llm_kwargs(platform: hardware.Platform, model_path: str, max_model_len: int, seed: int, tp: int, enforce_eager: bool) -> dict:
    """vllm.LLM's arguments for an eval engine on platform (a LoRA checkpoint: its base's)."""
    base = adapters.adapter_base(model_path) if adapters.is_adapter_folder(model_path) else model_path
    return hardware.vllm_kwargs(platform, base, max_model_len, seed=seed, tp=tp,
                                engine=VLLMConfig(enforce_eager=enforce_eager))


def _make_llm(model_path: str, max_model_len: int, seed: int, tp: int, enforce_eager: bool) -> LLM | adapters.AdapterLLM:
    p = hardware.detect()
    if p.is_cpu:
        # vLLM reads these at import and engine start: set before importing it.
        for k, v in hardware.cpu_env(os.environ.get("AREAL_CACHE_ROOT")).items():
            os.environ.setdefault(k, v)
    os.environ.update(hardware.vllm_env(p, tp))
    from vllm import LLM

    kw = llm_kwargs(p, model_path, max_model_len, seed, tp, enforce_eager)
    if adapters.is_adapter_folder(model_path):  # a LoRA checkpoint: its base, serving the adapter
        return adapters.adapter_llm(LLM, kw, model_path)
    return LLM(**kw)


class LocalEngine:
    """One vLLM engine in this process (the CPU, or a single GPU group)."""

    def __init__(self, model_path: str, max_model_len: int, seed: int = 0, tp: int = 1, enforce_eager: bool = True):
        self.llm = _make_llm(model_path, max_model_len, seed, tp, enforce_eager)
        self.num_engines = 1

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        return _generate(self.llm, requests) if requests else []

    def close(self) -> None:
        del self.llm


class _EngineActor:
    """Ray actor body: one vLLM engine on the GPUs Ray gave it."""

    def __init__(self, model_path: str, max_model_len: int, seed: int, tp: int, enforce_eager: bool):
        self.llm = _make_llm(model_path, max_model_len, seed, tp, enforce_eager)

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        return _generate(self.llm, requests)


class RayEngines:
    """Data parallel: n vLLM engines as Ray actors of `tp` GPUs (or one CPU) each."""

    def __init__(self, model_path: str, max_model_len: int, n: int, seed: int = 0, tp: int = 1,
                 use_gpu: bool = True, enforce_eager: bool = True):
        opts = {"num_gpus": tp} if use_gpu else {"num_cpus": 1}
        # (The ignore: ray.remote's typed overloads take no options dict, and its typed handles
        # would not see the actor's undecorated methods.)
        actor_cls = ray.remote(**opts)(_EngineActor)  # type: ignore[call-overload]
        self.actors = [actor_cls.remote(model_path, max_model_len, seed, tp, enforce_eager) for _ in range(n)]
        self.num_engines = n

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        shards = split_round_robin(requests, self.num_engines)
        futures = [a.generate.remote(s) for a, s in zip(self.actors, shards) if s]
        by_key = {r.key: r for part in ray.get(futures) for r in part}
        return [by_key[r.key] for r in requests]

    def close(self) -> None:
        for a in self.actors:
            ray.kill(a)


def split_round_robin(items: list, n: int) -> list[list]:
    """items split into n shards of near-equal size; round robin so that the long and short
    questions of a dataset spread over every engine."""
    return [items[i::n] for i in range(n)]


def available_gpus() -> int:
    """GPUs of the Ray cluster this process can join (RAY_ADDRESS), else of this node."""
    if os.environ.get("RAY_ADDRESS"):
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return int(ray.cluster_resources().get("GPU", 0))
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def open_engines(model_path: str, max_model_len: int, seed: int = 0, tp: int = 1,
                 num_engines: int = 0, enforce_eager: bool = True) -> LocalEngine | RayEngines:
    """LocalEngine or RayEngines: num_engines=0 picks GPUs // tp (1 on the CPU)."""

    use_gpu = not hardware.detect().is_cpu
    n = num_engines or (max(1, available_gpus() // tp) if use_gpu else 1)
    if n == 1:
        return LocalEngine(model_path, max_model_len, seed, tp, enforce_eager)

    if not ray.is_initialized():
        env = hardware.worker_env(os.environ.get("AREAL_CACHE_ROOT"))
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False, runtime_env={"env_vars": env})
        sigterm_interrupts()  # ray.init put in its own handler, which aborts eval (exit 134, a C++ stack dump)
    return RayEngines(model_path, max_model_len, n, seed, tp, use_gpu, enforce_eager)

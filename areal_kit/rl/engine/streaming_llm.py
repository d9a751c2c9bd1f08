"""A streaming rollout engine: vLLM's AsyncLLM behind the calls RolloutWorker makes of vllm.LLM.

Under rollout.mode=stream each engine serves many calls at once (a threaded Ray actor: one call
per prompt group, a weight load beside them). AsyncLLM runs on an event loop in a thread of its
own; every call from a Ray thread is a coroutine handed to that loop, so requests from different
calls share the engine's continuous batching, and a group's answers come back as soon as they are
done instead of with the slowest answer of a batch.

New weights interrupt the generations in flight: pause (rollout.interrupt=keep: the requests stay
queued, their KV cache is dropped as it was computed with the old weights; wait: they finish
first), load, label the new version, resume. vLLM itself records which weight version sampled
each output token (the weight_versions of each completion), so a sample knows the version of every
token, and its behaviour logprobs are the ones the weights of that token gave. A request whose
first token is more than max_head_offpolicyness versions older than the new weights can no
longer be trained: the update aborts it rather than recompute its KV and finish it.

    llm = StreamingLLM(**engine_kwargs)          # the same arguments as vllm.LLM
    outs = llm.generate(prompts, params)         # blocks this thread only
    llm.pause("keep"); llm.collective_rpc("receive_weights", ...); llm.resume(version=3, stale_before=2)
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.logprobs import PromptLogprobs
    from vllm.lora.request import LoRARequest
    from vllm.outputs import WeightVersionSpan
    from vllm.v1.engine import PauseMode
    from vllm.v1.engine.async_llm import AsyncLLM

T = TypeVar("T")


@dataclass
class Answer:
    """One answer, with the fields RolloutWorker reads of vLLM's CompletionOutput, and each token's version."""

    token_ids: list[int]
    logprobs: list  # vLLM's per-token {token id: Logprob}
    finish_reason: str | None  # vLLM's: None until the answer ends
    versions: list[int]


@dataclass
class Reply:
    """One prompt's answers (vLLM's RequestOutput, as far as RolloutWorker reads it)."""

    outputs: list[Answer]
    prompt_logprobs: PromptLogprobs | None = None


def token_versions(spans: Sequence[WeightVersionSpan] | None, n_tokens: int, default: int) -> list[int]:
    """The weight version of each of n_tokens output tokens, from vLLM's spans ([start, end) per version)."""
    out = [default] * n_tokens
    for span in spans or ():
        out[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return out


def stale_requests(requests: Iterable[tuple[str, list[tuple[str, int]]]], before: int) -> list[str]:
    """The ids among (request id, vLLM's (version, first token index) spans) whose first token came
    from a version older than `before`; a request not yet sampled has no spans, and is fresh."""
    return sorted({rid for rid, starts in requests if starts and int(starts[0][0]) < before})


class StreamingLLM:
    def __init__(self, **engine_kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="asyncllm", daemon=True)
        self._thread.start()
        self.engine = self._run(self._start(engine_kwargs))
        self.slots = self.engine.vllm_config.scheduler_config.max_num_seqs
        self.version = 0
        self._ids = itertools.count()
        self._paused = False
        self._lock = threading.Lock()  # one pause/load/resume at a time
        # Occupancy: running requests over the engine's slots, integrated over time.
        self._running = 0
        self._since = self._last = time.monotonic()
        self._area = 0.0

    async def _start(self, kw: dict[str, Any]) -> AsyncLLM:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        await engine.update_weight_version("0")  # from now on vLLM labels every token it samples
        return engine

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # ------------------------------------------------------------ generation
    def generate(self, prompts: list[TokensPrompt], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False, priority: int = 0, lora_request: LoRARequest | None = None) -> list[Reply]:
        """vllm.LLM.generate's answer for every prompt, each prompt a request of its own, all at
        `priority` (lower runs first when the engine's slots run short; the engine is started with
        scheduling_policy="priority") and with the adapter `lora_request` names, if any."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        return self._run(self._all(prompts, params, priority, lora_request))

    async def _all(self, prompts: list[TokensPrompt], params: list[SamplingParams], priority: int,
                   lora_request: LoRARequest | None) -> list[Reply]:
        return list(await asyncio.gather(*(self._one(p, sp, priority, lora_request)
                                           for p, sp in zip(prompts, params))))

    async def _one(self, prompt: TokensPrompt, params: SamplingParams, priority: int = 0,
                   lora_request: LoRARequest | None = None) -> Reply:
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        self._count(+params.n)
        try:
            last = None
            async for out in self.engine.generate(prompt, params, request_id=f"r{next(self._ids)}", priority=priority,
                                                  lora_request=lora_request):
                last = out
        finally:
            self._count(-params.n)
        if last is None:  # a request aborted inside vLLM ends its stream without a final output
            raise RuntimeError("vLLM ended the generation without an output")
        answers = [Answer(list(o.token_ids), list(o.logprobs or []), o.finish_reason,
                          token_versions(o.weight_versions, len(o.token_ids), self.version))
                   for o in sorted(last.outputs, key=lambda o: o.index)]
        return Reply(answers, last.prompt_logprobs)

    def _count(self, delta: int) -> None:
        now = time.monotonic()
        self._area += min(self._running, self.slots) * (now - self._last)
        self._running, self._last = self._running + delta, now

    def take_occupancy(self) -> float:
        """Mean share of the engine's slots (max_num_seqs) that held a running request since the last call."""
        def take() -> float:
            self._count(0)
            span = self._last - self._since
            area, self._area, self._since = self._area, 0.0, self._last
            return area / (span * self.slots) if span > 0 else 0.0
        return self._run(_call(take))

    # ------------------------------------------------------------ weights
    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return self._run(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        self._run(self.engine.reset_prefix_cache())

    def pause(self, mode: PauseMode) -> None:
        """Stop scheduling before a weight load; `keep` holds the requests in flight, `wait` lets them finish."""
        with self._lock:
            if not self._paused:
                self._run(self.engine.pause_generation(mode=mode, clear_cache=True))
                self._paused = True

    def resume(self, version: int, stale_before: int | None = None) -> int:
        """Label the tokens sampled from now on with `version`, then schedule again. Requests whose
        first token came from a version older than `stale_before` are aborted first: no step may
        train them any more, so neither their KV recompute nor the rest of their decode is worth
        running. Their answers end there (finish_reason abort); the controller generates their
        prompts again. How many requests were aborted."""
        with self._lock:
            self._run(self.engine.update_weight_version(str(version)))
            self.version = version
            aborted = 0 if stale_before is None else self._run(self._abort_stale(stale_before))
            if self._paused:
                self._run(self.engine.resume_generation())
                self._paused = False
        return aborted

    async def _abort_stale(self, before: int) -> int:
        states = self.engine.output_processor.request_states.values()
        ids = stale_requests(((s.parent_req.external_req_id if s.parent_req else s.external_req_id,
                               s.weight_version_starts) for s in states), before)
        if ids:
            await self.engine.abort(ids)  # by our request id: every answer of an n > 1 request
        return len(ids)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _call(fn: Callable[[], T]) -> T:
    """Run fn on the loop's thread (the occupancy counters are only touched there)."""
    return fn()

"""The rollout engine's end of the turns on shared GPUs (rl/driver/turns.py): a mixin of
RolloutWorker that puts its vLLM engine to sleep while the trainer trains and wakes it in two
parts, the weights first (for the weight sync to fill) and then the KV cache.

The engine must have started with vLLM's sleep mode (`enable_sleep_mode=True`, which vLLM
supports on CUDA only: hardware.vllm_kwargs sets it when turns.sleep_mode says so). Each call
returns what the engine holds afterwards and its seconds, for the driver's log.
"""

from __future__ import annotations

import time
from typing import Any


class Sleeper:
    """Needs from its host class: llm (vllm.LLM started with enable_sleep_mode)."""

    llm: Any

    def sleep(self, level: int) -> dict:
        """Release the engine's GPU memory: level 1 keeps the weights in host memory, level 2
        discards them (the weight sync re-sends them); the KV cache is discarded either way."""
        t0 = time.time()
        self.llm.sleep(level=level)
        return {"asleep": True, "level": level, "seconds": time.time() - t0}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Back on the GPU: tags ["weights"] or ["kv_cache"] (None: everything). vLLM resumes
        scheduling only once every part is back, so a half-awake engine generates nothing."""
        t0 = time.time()
        awake = self.llm.wake_up(tags=tags)
        return {"awake": bool(awake), "tags": tags, "seconds": time.time() - t0}

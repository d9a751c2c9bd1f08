"""The trainer rank's end of the turns on shared GPUs (rl/driver/turns.py): before an engine
wakes, the rank gives the GPU back what torch's caching allocator holds free, which would otherwise
keep the training peak (activations, logits) reserved through generation.
"""

from __future__ import annotations

import torch


class TrainerTurn:
    """The trainer rank's end of the turns (a mixin of TrainerWorker)."""

    def release_memory(self) -> dict[str, int]:
        """Give the GPU back what torch's caching allocator holds free (torch.cuda.empty_cache);
        its bytes still reserved and allocated afterwards. Nothing to give on CPU."""
        if not torch.cuda.is_initialized():
            return {"reserved": 0, "allocated": 0}
        torch.cuda.synchronize()  # queued kernels may still use blocks freed on the host side
        torch.cuda.empty_cache()
        return {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}

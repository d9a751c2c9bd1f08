"""The garbage collector and a long run: what a process loaded while starting stays out of its collections.

A worker holds millions of Python objects once torch, transformers, DeepSpeed or vLLM are loaded
and a model is built; they live as long as the process. Python's full collections walk all of
them, and a step that hits one stalls in the trainer or the engine while the other role waits.
Frozen after set-up, they are no longer walked; what a step allocates is collected as before.
vLLM freezes its engine's start-up objects the same way.

    heap.freeze_imports()   # at the start of a worker's setup, before it builds a model or an engine
    heap.freeze()           # at the end of a worker's setup, and in the driver once the workers are up
"""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """Move what the imports loaded out of the collector's reach now, before set-up builds more:
    vLLM collects the whole heap several times while it builds an engine, and those passes (and
    freeze()'s own collection) then walk only what set-up made."""
    gc.freeze()


def freeze() -> None:
    """Collect what start-up left as garbage, then move every surviving object out of the collector's reach."""
    gc.collect()
    gc.freeze()

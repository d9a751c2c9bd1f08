"""The worker's end of the driver's watchdog (rl/driver/watchdog.py): every thread's Python stack
written to a file on a signal, armed when the worker starts, so a hang leaves its stacks behind."""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

import ray

STACK_SIGNAL = signal.SIGUSR1
_stack_file: IO[str] | None = None  # faulthandler keeps the fd, not the object: keep it from being closed


def arm(stacks_dir: str, name: str) -> tuple[str, int]:
    """In a worker: dump every thread's Python stack to stacks_dir/<name>.txt on STACK_SIGNAL.
    Returns (Ray node id, pid), where the driver sends the signal."""
    global _stack_file
    os.makedirs(stacks_dir, exist_ok=True)
    path = os.path.join(stacks_dir, name.replace(" ", "_") + ".txt")
    _stack_file = open(path, "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
    return ray.get_runtime_context().get_node_id(), os.getpid()


class StackDumps:
    """Mixin of the worker classes: the driver's watchdog arms each worker at start."""

    def arm_stacks(self, stacks_dir: str, name: str) -> tuple[str, int]:
        return arm(stacks_dir, name)

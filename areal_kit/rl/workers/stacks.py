"""The worker's end of the driver's watchdog (rl/driver/watchdog.py): every thread's Python stack
written to a file on a signal, armed when the worker starts, so a hang leaves its stacks behind."""

from __future__ import annotations

import faulthandler
import os
import signal

import ray

STACK_SIGNAL = signal.SIGUSR1


def arm(stacks_dir: str, name: str) -> tuple[str, int]:
    """In a worker: dump every thread's Python stack to stacks_dir/<name>.txt on STACK_SIGNAL.
    Returns (Ray node id, pid), where the driver sends the signal."""
    os.makedirs(stacks_dir, exist_ok=True)
    f = open(os.path.join(stacks_dir, name.replace(" ", "_") + ".txt"), "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True)
    arm.file = f  # faulthandler keeps the fd, not the object: keep it from being closed
    return ray.get_runtime_context().get_node_id(), os.getpid()


class StackDumps:
    """Mixin of the worker classes: the driver's watchdog arms each worker at start."""

    def arm_stacks(self, stacks_dir: str, name: str) -> tuple[str, int]:
        return arm(stacks_dir, name)

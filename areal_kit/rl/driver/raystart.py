"""Join or start the Ray cluster a run's workers go on; light enough to begin before the driver's
heavy imports, so launch.py starts it on a thread while the driver prepares the run.

    from areal_kit.rl.driver.raystart import InBackground, start_ray
    start_ray(cfg)                                      # here and now (controller.start_ray)
    up = InBackground(start_ray, cfg)                   # on its own thread; the caller goes on
    up.wait()                                           # until it is up; raises what it raised
    up.failed()                                         # whether it ended with an error

A start that timed out (Ray's processes slow to register on a loaded machine) is a failure the
relaunch loop retries (rl/driver/retry.py); launch.py then starts Ray again, on a new thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import ray

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.schema import TrainConfig
from areal_kit.rl.common import testhooks


def start_ray(cfg: TrainConfig) -> bool:
    """Join cfg.ray_address or start a cluster on this machine; False when Ray was up already."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # explicit: a Ray without it wants a token the workers do not have
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray.is_initialized():
        return False
    testhooks.before_ray_start()  # a fault the tests inject (unset: nothing)
    verbose = bool(os.environ.get("AREAL_VERBOSE"))
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=verbose, logging_level=logging.WARNING)
        return True
    # Ray prestarts a default worker per CPU for the first driver; a run's actors never use them
    # (each starts a worker of its own, and Ray ends the idle ones), so they only take CPU from the
    # run's own start-up, which on a small machine is bound by it.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # One Ray slot per trainer rank and per engine GPU: colocated roles share GPUs, not slots.
    a = parse_allocation(cfg.allocation_mode)
    ncpu = max(a.gen_gpus + a.train_gpus, os.cpu_count() or 1) if hardware.detect().is_cpu else None
    # address="local": a cluster of this run's own. Ray's default (None) joins the last `ray start`
    # it finds on the machine, whose slots are not this run's to set (and num_cpus then fails).
    ray.init(address="local", num_cpus=ncpu, include_dashboard=False, log_to_driver=verbose,
             logging_level=logging.WARNING)
    return True


class _NoSigtermNotice(logging.Filter):
    """ray.init on a thread says it leaves SIGTERM's handler alone; launch.py installs its own anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


logging.getLogger("ray._private.worker").addFilter(_NoSigtermNotice())


R = TypeVar("R")


class InBackground(Generic[R]):
    """fn(*args) on a thread of its own, started now; wait() returns what it returned, once it
    has, or raises in the waiting thread what it raised (every wait() the same error).

    The thread then stays parked until the process ends, as a daemon: Ray's head processes die
    with the thread that started them (Linux's parent-death signal follows the creating thread,
    not the process), so a thread that returned would take the cluster down with it. A process
    that ends early (bad input found while Ray starts) ends the thread and those processes too.
    """

    def __init__(self, fn: Callable[..., R], *args: Any) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: R | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=f"background {fn.__name__}",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., R], args: tuple[Any, ...]) -> None:
        try:
            self._result = fn(*args)
        except BaseException as e:  # noqa: BLE001  (any error, raised again in the waiting thread)
            self._error = e
        finally:
            self._done.set()
        threading.Event().wait()  # parked: see the class docstring

    def wait(self) -> R:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return cast(R, self._result)  # fn's, set before _done when it raised nothing

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether fn has ended by raising (wait() raises it)."""
        return self._done.is_set() and self._error is not None

"""rl/driver/raystart.py: InBackground, a call on a thread of its own (launch.py starts Ray with it while
the driver imports and prepares the run), its result waited for later, its error raised there; and
the settings start_ray starts a local Ray with (ray.init recorded, not run: the integration tests start it)."""

import os
import threading

import pytest
import ray

from areal_kit.config.loader import load_config
from areal_kit.rl.driver.raystart import InBackground, start_ray


def test_the_caller_goes_on_while_the_call_runs_and_wait_returns_once_it_is_done():
    started, release = threading.Event(), threading.Event()
    calls = []

    def start(a, b):
        started.set()
        release.wait(10)
        calls.append((a, b))

    up = InBackground(start, 1, 2)
    assert started.wait(10) and not up.done()  # running, and this thread is free
    release.set()
    up.wait()
    assert up.done() and calls == [(1, 2)]


def test_its_error_is_raised_by_every_wait_in_the_waiting_thread():
    def start():
        raise RuntimeError("raylet did not start")

    up = InBackground(start)
    for _ in range(2):  # a relaunch waits again: the same error, not a hang
        with pytest.raises(RuntimeError, match="raylet did not start"):
            up.wait()


def test_the_thread_outlives_its_call_as_a_daemon():
    """Ray's head processes get SIGKILL when the thread that started them ends (the parent-death
    signal follows the thread): it stays parked, and goes with the process."""
    up = InBackground(lambda: None)
    up.wait()
    assert up._thread.is_alive() and up._thread.daemon


def test_wait_returns_what_the_call_returned():
    assert InBackground(lambda a: a * 2, 21).wait() == 42


@pytest.mark.parametrize("user", [None, "1"])
def test_a_local_ray_starts_without_idle_workers_unless_the_user_asks(monkeypatch, user):
    """Ray's prestarted workers are never a run's actors: they only take CPU from the start-up."""
    seen = {}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what start_ray sets stays in this test
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, env=os.environ.get("RAY_prestart_worker_first_driver")))
    if user is None:
        monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    else:
        monkeypatch.setenv("RAY_prestart_worker_first_driver", user)
    assert start_ray(load_config("tiny", []))
    assert seen["env"] == (user or "0") and seen["include_dashboard"] is False

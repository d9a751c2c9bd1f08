"""rl/driver/raystart.py's InBackground: a call on a thread of its own (launch.py starts Ray with it while
the driver imports and prepares the run), its result waited for later, its error raised there."""

import threading

import pytest

from areal_kit.rl.driver.raystart import InBackground


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

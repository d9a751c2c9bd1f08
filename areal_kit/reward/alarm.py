"""A time limit for code running in the main thread: SIGALRM raises an exception inside it.

    with alarm(0.5, MyTimeout):
        slow_parse(text)          # MyTimeout once 0.5 s have passed

Used by the math grader (sympy on a pathological answer) and by the reward scorer (a user's
reward function). The alarm repeats every `again` seconds until the block ends: Python drops an
exception raised while a gc callback or a __del__ runs ("Exception ignored in ..."), and a
one-shot alarm that lands there would leave the block running unbounded. The exception should
be a BaseException, so that the code's own `except Exception` blocks cannot swallow it either.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def alarm(seconds: float, exc: type[BaseException], again: float = 0.05) -> Iterator[None]:
    """Raise `exc` in the main thread after `seconds`, and again every `again` seconds until the
    block ends; restores any previous handler and timer."""
    armed = [True]

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            raise exc()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3), again)
    try:
        yield
    finally:
        _disarm(armed, exc)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, old_delay)


def _disarm(armed: list[bool], exc: type[BaseException]) -> None:
    # A repeat may land while we stop the timer: it raises here, and we stop it again.
    while True:
        try:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        except exc:
            continue

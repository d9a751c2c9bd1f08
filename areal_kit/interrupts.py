"""Stops asked for by signals: Ctrl-C and SIGTERM unwind a run instead of killing it.

A command that runs workers wraps its work in `stops_say_so()`: a SIGTERM (a scheduler's stop,
`kill`) or Ctrl-C then leaves as Interrupted, finally blocks stop the workers, and the CLI prints
one line and exits with 128 + the signal number. Ray turns what a signal handler raises into
other exceptions; `interruption(e)` finds the stop behind them.
"""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

from areal_kit.errors import ExitCode


class Interrupted(BaseException):
    """A run stopped by a signal: SIGTERM (`kill`, a scheduler's stop), or Ctrl-C once the run has
    unwound. Like KeyboardInterrupt it is no Exception, so no handler of errors takes it: it
    unwinds, workers are stopped and logs closed, and the CLI says so and exits with 128 + the
    signal number (typer would turn a KeyboardInterrupt into a silent exit 130)."""

    def __init__(self, signame: str, exit_code: int, global_step: int = 0, checkpoint: str = ""):
        super().__init__(signame)
        self.signame, self.exit_code = signame, exit_code
        # Given when the run stopped between steps and wrote a recover checkpoint of the last one.
        self.global_step, self.checkpoint = global_step, checkpoint

    def __str__(self) -> str:
        if self.checkpoint:
            return (f"interrupted ({self.signame}) after global step {self.global_step}; its recover checkpoint "
                    "is written, the same command resumes from it")
        return f"interrupted ({self.signame})"


_signalled: list[Interrupted] = []  # the SIGTERM received, if any: what a KeyboardInterrupt below stands for


def interruption(e: BaseException) -> Interrupted | None:
    """The stop behind an exception, as an Interrupted: SIGTERM if one came, else Ctrl-C; None
    when no KeyboardInterrupt or Interrupted is in its chain. Ray's ray.get raises a fresh
    KeyboardInterrupt for whatever the signal handler raised, and a handler that raises while
    other C code runs comes back as a SystemError caused by it: both are stops, not failures."""
    seen = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, Interrupted):
            return link
        if isinstance(link, KeyboardInterrupt):
            return _signalled[-1] if _signalled else Interrupted("Ctrl-C", ExitCode.INTERRUPTED)
        link = link.__cause__ or link.__context__
    return None


def note_sigterm() -> None:
    """A SIGTERM came: every KeyboardInterrupt from here on is reported as it. A scheduler stops
    a job with SIGTERM to every process and, through the batch shell, a SIGINT to stop at once
    (slurm/script.py); whichever of the two unwinds the run, the stop is the scheduler's."""
    _signalled.append(Interrupted("SIGTERM", ExitCode.TERMINATED))


# What signal.signal takes and returns: a function, SIG_DFL or SIG_IGN, or None (set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | None


def raise_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    """SIGTERM's handler: unwind, as Ctrl-C does; a second SIGTERM kills at once. It raises a
    KeyboardInterrupt, the one exception Ray's ray.get lets a signal handler raise (any other it
    swallows, or leaves behind as a SystemError); `interruption` makes it Interrupted("SIGTERM")."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    note_sigterm()
    raise KeyboardInterrupt("SIGTERM")


def sigterm_interrupts(handler: Handler = raise_on_sigterm) -> Handler:
    """Put a SIGTERM handler in place; returns the one it replaced, or None off the main thread,
    where Python cannot take signals. Call it again after ray.init, which puts its own in place,
    one that aborts the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    _signalled.clear()  # a SIGTERM from before was raised and handled then
    return signal.signal(signal.SIGTERM, handler)


@contextmanager
def stops_say_so() -> Iterator[None]:
    """Ctrl-C or SIGTERM (a scheduler's stop, `kill`) inside the block leaves it as Interrupted
    (exit code 130 / 143): it unwinds, so finally blocks stop the workers, and the CLI says so in
    one line. (typer alone turns Ctrl-C into a silent exit 130; SIGTERM would kill at once.)"""
    previous = sigterm_interrupts()
    try:
        yield
    except BaseException as e:
        if (stop := interruption(e)) is not None:
            raise stop from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

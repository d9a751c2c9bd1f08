"""The exception types users see: each is printed as one line ("error: ..."), no traceback.

A UserError is bad input: exit code 2; raise it with what was wrong and what is expected.
A RunFailed is a run that started and then failed (a worker's error, not the input): exit
code 1; its message names where it failed and the log holding the full traceback.
"""

import re
import signal
import threading
from contextlib import contextmanager


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2


class RunFailed(Exception):
    """A started run that failed: printed as one line, exit code 1 (the traceback is in the log)."""

    exit_code = 1


def describe(e: BaseException) -> str:
    """`[Actor.method: ]Type: first line` of an error, one line, through the RayTaskErrors a
    remote call wraps it in (their own first line is only the ray::Actor.method header)."""
    try:
        from ray.exceptions import RayTaskError
    except ImportError:  # no Ray, no remote calls to look through
        RayTaskError = ()  # isinstance with an empty tuple is always False
    where = ""
    while isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None:
        call = re.search(r"ray::([\w.]+)\(", str(e).split("\n", 1)[0])
        where = where or (f"{call[1]}: " if call else "")  # the outermost: the call the driver made
        e = e.cause
    lines = str(e).splitlines()
    return where + (f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__)


class Interrupted(BaseException):
    """A run stopped by a signal: SIGTERM (`kill`, a scheduler's stop), or Ctrl-C once the run has
    unwound. Like KeyboardInterrupt it is no Exception, so no handler of errors takes it: it
    unwinds, workers are stopped and logs closed, and the CLI says so and exits with 128 + the
    signal number (typer would turn a KeyboardInterrupt into a silent exit 130)."""

    def __init__(self, signame: str, exit_code: int):
        super().__init__(signame)
        self.signame, self.exit_code = signame, exit_code
        # Set when the run stopped between steps and wrote a recover checkpoint of the last one.
        self.global_step, self.checkpoint = 0, ""

    def __str__(self) -> str:
        if self.checkpoint:
            return (f"interrupted ({self.signame}) after global step {self.global_step}; its recover checkpoint "
                    "is written, the same command resumes from it")
        return f"interrupted ({self.signame})"


_signalled: list = []  # the SIGTERM received, if any: what a KeyboardInterrupt below stands for


def interruption(e: BaseException) -> Interrupted | None:
    """The stop behind an exception, as an Interrupted: SIGTERM if one came, else Ctrl-C; None
    when no KeyboardInterrupt or Interrupted is in its chain. Ray's ray.get raises a fresh
    KeyboardInterrupt for whatever the signal handler raised, and a handler that raises while
    other C code runs comes back as a SystemError caused by it: both are stops, not failures."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Interrupted):
            return e
        if isinstance(e, KeyboardInterrupt):
            return _signalled[-1] if _signalled else Interrupted("Ctrl-C", 130)
        e = e.__cause__ or e.__context__
    return None


def raise_on_sigterm(signum, frame):
    """SIGTERM's handler: unwind, as Ctrl-C does; a second SIGTERM kills at once. It raises a
    KeyboardInterrupt, the one exception Ray's ray.get lets a signal handler raise (any other it
    swallows, or leaves behind as a SystemError); `interruption` makes it Interrupted("SIGTERM")."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _signalled.append(Interrupted("SIGTERM", 128 + signum))
    raise KeyboardInterrupt("SIGTERM")


def sigterm_interrupts(handler=raise_on_sigterm):
    """Put a SIGTERM handler in place; returns the one it replaced, or None off the main thread,
    where Python cannot take signals. Call it again after ray.init, which puts its own in place,
    one that aborts the process."""
    if threading.current_thread() is not threading.main_thread():
        return None
    _signalled.clear()  # a SIGTERM from before was raised and handled then
    return signal.signal(signal.SIGTERM, handler)


@contextmanager
def stops_say_so():
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

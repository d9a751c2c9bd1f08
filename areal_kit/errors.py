"""The exception types users see, each printed as one line ("error: ..."), no traceback, and the
exit codes of every command.

A UserError is bad input: exit code 2; raise it with what was wrong and what is expected.
A RunFailed is a run that started and then failed (a worker's error, not the input): exit
code 1; its message names where it failed and the log holding the full traceback.

    raise UserError("--runtime: expected docker or host, got 'podman'")
    return ExitCode.OK if ok else ExitCode.FAILED
"""

import re
import sys
from enum import IntEnum
from typing import NoReturn


class ExitCode(IntEnum):
    """What `areal-kit`'s exit status says (the README lists them)."""

    OK = 0  # done: every host, check, run or graded row as it should be
    FAILED = 1  # it ran and something failed: a host, a check, a started run, a row graded against its expected verdict
    BAD_INPUT = 2  # bad input (a flag, a config value, a run already running): nothing ran
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): workers stopped, the same command resumes
    TERMINATED = 143  # SIGTERM (128 + SIGTERM): the step under way finished and was checkpointed first


def refuse(message: str, code: int = ExitCode.BAD_INPUT) -> NoReturn:
    """Print the one error line (logs.error_line) and exit with code: bad input unless told otherwise.
    The CLI's handler and the `python -m` entry points end with it."""
    from areal_kit import logs  # here, not at the top: stack.py loads this file as a bare script too

    print(logs.error_line(message), file=sys.stderr)
    raise SystemExit(code)


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = ExitCode.BAD_INPUT


class ConfigError(UserError):
    """A config value is invalid: names the field, the value and what is expected."""


class RunFailed(Exception):
    """A started run that failed: printed as one line, exit code 1 (the traceback is in the log)."""

    exit_code = ExitCode.FAILED


def describe(e: BaseException) -> str:
    """`[Actor.method: ]Type: first line` of an error, one line, through the RayTaskErrors a
    remote call wraps it in (their own first line is only the ray::Actor.method header); for our
    own UserError and RunFailed, their line alone."""
    wrappers: tuple[type[BaseException], ...]
    try:
        from ray.exceptions import RayTaskError
        wrappers = (RayTaskError,)
    except ImportError:  # no Ray, no remote calls to look through
        wrappers = ()  # isinstance with an empty tuple is always False
    where = ""
    while isinstance(e, wrappers) and getattr(e, "cause", None) is not None:
        call = re.search(r"ray::([\w.]+)\(", str(e).split("\n", 1)[0])
        where = where or (f"{call[1]}: " if call else "")  # the outermost: the call the driver made
        e = e.cause
    lines = str(e).splitlines()
    if isinstance(e, (UserError, RunFailed)) and lines:  # ours: written as the one whole line users read
        return where + lines[0]
    return where + (f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__)

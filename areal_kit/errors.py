"""The exception types users see: each is printed as one line ("error: ..."), no traceback.

A UserError is bad input: exit code 2; raise it with what was wrong and what is expected.
A RunFailed is a run that started and then failed (a worker's error, not the input): exit
code 1; its message names where it failed and the log holding the full traceback.
"""

import re


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """A config value is invalid: names the field, the value and what is expected."""


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

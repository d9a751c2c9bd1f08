"""How a config option is declared and checked: `opt(default, help)` for an option,
`section(Class, help)` for a group of them, and the checks that raise ConfigError with what was
wrong and what is expected. The help, and the choices where the value is one of a fixed set, live
in the field's metadata, where `--show-args [--json]` and `check_choices` read them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection
from dataclasses import field
from typing import TYPE_CHECKING, TypeVar

from areal_kit.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    check(value in choices, f"{name}={value!r} is not valid; expected one of {', '.join(map(str, choices))}")


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    check(ok, f"{name}={value} is not valid; expected a number {'>= 0' if allow_zero else '> 0'}")


def opt(default: _T, help_text: str, *, choices: tuple = ()) -> _T:
    """A config option: its default, its help and, if its value is one of a fixed set, the choices.
    Typed as its value, as dataclasses.field() is: a default of another type than the option's is an error."""
    meta = {"help": help_text, **({"choices": tuple(choices)} if choices else {})}
    if isinstance(default, (list, dict)):  # each config gets its own copy of a mutable default
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type[_T], help_text: str) -> _T:
    """A group of options (a nested dataclass, e.g. ppo.gen) with its help."""
    return field(default_factory=cls, metadata={"help": help_text})


def check_choices(obj: DataclassInstance, prefix: str) -> None:
    """Every field of obj declared with choices holds one of them; prefix names obj's section."""
    for f in dataclasses.fields(obj):
        if "choices" in f.metadata:
            check_choice(prefix + f.name, getattr(obj, f.name), f.metadata["choices"])

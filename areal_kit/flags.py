"""Command-line options declared once, on the dataclass field they fill.

A field made with `flag(default, "--name", help=...)` (or `many` for a repeatable option, or
`argument`) holds the option's default, its type (the field's annotation) and its help. `command`
gives a typer command the parameters of such fields, `build` makes the dataclass from the values
typer passed: a default or a help text lives in one place, and `--help` cannot say something the
code does not do. An option only one command has, and that fills no dataclass, is declared in that
command's own signature, as typer does. The setup commands (cluster/options.py, cluster/target.py)
and eval and filter (eval/options.py) are made so. An option several commands take is declared once,
in a group they all take: areal_kit/options.py's where the commands live in several packages, else
the package's own (cluster/target.py's Hosts and Route, eval/options.py's Generation). Where their
defaults differ, the group declares it without one (None) and build() gives each command's
dataclass its own. A spelling an option had before (`old=`) is still accepted: it fills the same
field and says the new name on stderr.

    @dataclass
    class Limits:
        min_nofile: int = flag(65536, "--min-nofile", min=0, help="Open-file hard limit ...")

    @command(params(Limits))
    def doctor(as_json: bool = typer.Option(False, "--json", help="..."), **given) -> int:
        limits = build(Limits, given)
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

import typer

from areal_kit.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")
_R = TypeVar("_R")
_D = TypeVar("_D", bound="DataclassInstance")

_KEY = "cli"  # the field metadata that makes a dataclass field a command-line option
_OLD = "cli_old"  # the field metadata of the option's earlier spellings
# The hidden parameter of an earlier spelling (named FIELD_oldN by params) -> the field it fills.
_OLD_SPELLINGS: dict[str, str] = {}


# flag() returns a dataclasses.Field; typed as the field's value, as dataclasses.field() is, so that
# `x: int = flag("a", ...)` is an error. A required option (default `...`) has any type.
@overload
def flag(default: types.EllipsisType, *names: str, help: str, old: tuple[str, ...] = (), **typer_kw: Any) -> Any: ...
@overload
def flag(default: _T, *names: str, help: str, old: tuple[str, ...] = (), **typer_kw: Any) -> _T: ...
def flag(default: Any, *names: str, help: str, old: tuple[str, ...] = (), **typer_kw: Any) -> Any:
    """A dataclass field that is also the command-line option `names` (typer.Option's keywords:
    min, envvar, show_default, ...); default `...`: a required option, a field without a default.
    old: spellings it had before, still accepted (hidden from --help) with a note of the new one."""
    meta = {_KEY: ("option", names, help, typer_kw), _OLD: old}
    return dataclasses.field(metadata=meta) if default is ... else dataclasses.field(default=default, metadata=meta)


def many(*names: str, help: str, **typer_kw: Any) -> list[Any]:
    """A list field given by repeating the option (empty when it is not given)."""
    return dataclasses.field(default_factory=list, metadata={_KEY: ("option", names, help, typer_kw)})


def argument(help: str, **typer_kw: Any) -> list[Any]:
    """A list field given as the command's positional arguments."""
    return dataclasses.field(default_factory=list, metadata={_KEY: ("argument", (), help, typer_kw)})


def _cli_type(hint: Any) -> Any:
    """What typer parses a field as: `X | None` is X (None: the option was not given)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def params(cls: type[DataclassInstance], names: str | None = None) -> list[inspect.Parameter]:
    """The command parameters of cls's option fields: all of them in field order, or the ones
    names lists (space-separated), in that order."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if _KEY in f.metadata}
    out = []
    for name in names.split() if names is not None else fields:
        f = fields[name]  # a KeyError here is a typo in the command's declaration
        kind, decls, help_, kw = f.metadata[_KEY]
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:  # a list not given is None, which build() turns into the field's default; no default: required
            default = None if f.default_factory is not dataclasses.MISSING else ...
        info = typer.Argument(default, help=help_, show_default=False, **kw) if kind == "argument" else \
            typer.Option(default, *decls, help=help_, **kw)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                     annotation=_cli_type(hints[name])))
        for i, spelling in enumerate(f.metadata.get(_OLD, ())):
            _OLD_SPELLINGS[f"{name}_old{i}"] = name
            out.append(inspect.Parameter(f"{name}_old{i}", inspect.Parameter.KEYWORD_ONLY,
                                         default=typer.Option(None, spelling, hidden=True,
                                                              help=f"{decls[0]}'s old spelling."),
                                         annotation=_cli_type(hints[name])))
    return out


def _fold_old_spellings(every: list[inspect.Parameter], kw: dict[str, Any]) -> None:
    """An earlier spelling's value into its field's parameter (in kw), with a note on stderr."""
    decl = {p.name: p.default for p in every}
    for p in every:
        name = _OLD_SPELLINGS.get(p.name)
        if name not in decl or p.name not in kw:
            continue
        value = kw.pop(p.name)
        if value is None:
            continue
        old, new = p.default.param_decls[0], decl[name].param_decls[0]
        print(f"note: {old} is a deprecated alias of {new}; use {new}", file=sys.stderr)
        if kw.get(name) not in (None, decl[name].default):
            raise UserError(f"{old} and {new} are one option: give {new} alone")
        kw[name] = value


def command(*groups: list[inspect.Parameter],
            own_first: bool = False) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """Decorate `fn(own options..., **given)`: typer sees the groups' parameters, in order, then
    fn's own (own_first: fn's own, then the groups'); fn is called with all of them by name."""
    def wrap(fn: Callable[..., _R]) -> Callable[..., _R]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        theirs = [p for group in groups for p in group]
        every = own + theirs if own_first else theirs + own
        names = [p.name for p in every]
        if len(names) != len(set(names)):
            raise TypeError(f"{fn.__name__}: an option is declared twice: {sorted(n for n in names if names.count(n) > 1)}")

        def run(*args: Any, **kw: Any) -> _R:
            _fold_old_spellings(every, kw)
            return fn(*args, **kw)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(run, attr, getattr(fn, attr))
        # setattr: a function's type has no __signature__ to assign to.
        setattr(run, "__signature__",  # noqa: B010
                inspect.Signature(every, return_annotation=hints.get("return", inspect.Signature.empty)))
        run.__annotations__ = {p.name: p.annotation for p in every} | {"return": hints.get("return")}
        return run
    return wrap


def build(cls: type[_D], given: dict[str, Any], **more: Any) -> _D:
    """cls made from the values typer passed: every field of cls that given (or more, which wins)
    names. An option that was not given (None) takes the field's default: a repeatable option's
    empty list, or this class's default of an option several commands take, declared once
    without one (None) in the group they share."""
    values = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.name in more:
            values[f.name] = more[f.name]
        elif f.name in given and not (given[f.name] is None and has_default):
            v = given[f.name]
            values[f.name] = list(v) if isinstance(v, tuple) else v
    return cls(**values)

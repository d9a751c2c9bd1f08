"""Every training config field is read by some code beyond its declaration and validation.

A field that nothing reads is a setting without effect: a user sets it, the run validates it and
does the same as without it. This walks every leaf of TrainConfig (the dataclasses of
config/schema.py and the sections it nests) and looks, in the package's syntax trees, for a read
of each one: an attribute chain ending in the field's section (`cfg.ppo.gen.top_k`,
`self.cfg.exp_ctrl.ckpt_freq_secs`; a section that two parents share, as mb_spec, with its parent:
`cfg.ref_inf.mb_spec.max_tokens_per_mb`), a name the module binds to such a chain (`p = cfg.ppo`,
then `p.kl_ctl`), or, for a section of a unique name, any bare name's attribute (a parameter:
`engine.enforce_eager`) and `getattr(obj, "field")`. The modules that declare and validate the
config do not count. Requiring the section keeps a same-named attribute of something else
(`self.engine.optimizer`, a worker's `self.rank`) from passing for a read.

    .venv/bin/python -m pytest tests/unit/test_config_fields_read.py -q
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from areal_kit.config.schema import TrainConfig

PKG = Path(__file__).resolve().parents[2] / "areal_kit"
# The config's declarations and validation: a read there (a __post_init__ check) is no effect on a
# run. The loader counts: it is where `cluster` takes effect.
DECLARING = {"config/schema.py", "config/fields.py", "config/dataset.py", "config/rollout.py",
             "config/vllm_args.py", "config/lora.py", "config/assets.py", "config/agent.py"}
# Receivers that name the whole TrainConfig (its top-level fields have no section name).
TOP = {"cfg", "config", "train_cfg"}


def leaves(cls=TrainConfig, prefix: str = ""):
    """(dotted key, dotted section path, field name) for every leaf of cls."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", prefix.rstrip("."), f.name


def _chain(node: ast.AST) -> str | None:
    """"self.cfg.ppo" for an attribute chain on a name; None for anything else (a call, an index)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _reads(tree: ast.AST) -> set[tuple[str, str]]:
    """(receiver, attribute) of each attribute read in tree. The receiver is its dotted chain
    (`self.cfg.ppo`); a bare name bound in the module to a chain (`p = self.cfg.ppo`) counts as
    that chain too, and any bare name but self/cls also as "" (an alias the walk cannot follow, a
    parameter). getattr(obj, "field") is ("", field)."""
    aliases: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and (c := _chain(node.value)):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    aliases.setdefault(t.id, set()).add(c)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            c = _chain(node.value)
            if c is None or c in ("self", "cls"):
                continue
            out.add((c, node.attr))
            if "." not in c:
                out.add(("", node.attr))
                out.update((a, node.attr) for a in aliases.get(c, ()))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            out.add(("", str(node.args[1].value)))
    return out


def package_reads(pkg: Path = PKG, skip: set[str] = DECLARING) -> set[tuple[str, str]]:
    reads = set()
    for path in sorted(pkg.rglob("*.py")):
        if path.relative_to(pkg).as_posix() not in skip:
            reads |= _reads(ast.parse(path.read_text()))
    return reads


def _names(section: str, sections: list[str]) -> tuple[str, bool]:
    """The shortest tail of a section path that no other section shares (`mb_spec` is both
    actor_train's and ref_inf's: `ref_inf.mb_spec`), and whether the section name alone is unique."""
    parts = section.split(".")
    for n in range(1, len(parts) + 1):
        tail = ".".join(parts[-n:])
        if sum(s == tail or s.endswith("." + tail) for s in sections) == 1:
            return tail, n == 1
    return section, False


def unread(reads: set[tuple[str, str]], cls=TrainConfig) -> list[str]:
    """The dotted keys of cls with no read in `reads`."""
    found = list(leaves(cls))
    sections = sorted({s for _, s, _ in found if s})
    by_name: dict[str, set[str]] = {}
    for receiver, name in reads:
        by_name.setdefault(name, set()).add(receiver)
    missing = []
    for key, section, name in found:
        receivers = by_name.get(name, set())
        if not section:  # top level: cfg.seed, or a bare alias
            ok = bool(receivers & {""}) or any(r.split(".")[-1] in TOP for r in receivers)
        else:
            tail, unique = _names(section, sections)
            ok = any(r == tail or r.endswith("." + tail) for r in receivers) or (unique and "" in receivers)
        if not ok:
            missing.append(key)
    return missing


def test_every_config_field_is_read():
    missing = unread(package_reads())
    assert not missing, (f"config fields that no code reads (a setting without effect): {missing}; "
                         "read each where it takes effect, or remove it from the schema")


@dataclasses.dataclass
class _Spec:
    size: int = 0


@dataclasses.dataclass
class _Demo:
    used: int = 0
    unused: int = 0

    def __post_init__(self):
        assert self.unused >= 0  # validation: no read


@dataclasses.dataclass
class _Top:
    demo: _Demo = dataclasses.field(default_factory=_Demo)
    train: _Spec = dataclasses.field(default_factory=_Spec)
    infer: _Spec = dataclasses.field(default_factory=_Spec)
    name: str = ""


@pytest.mark.parametrize("source, missing", [
    # demo.unused only validated; infer's spec is train's class, and only train's is read
    ("def go(cfg):\n    return cfg.demo.used, cfg.name, cfg.train.size\n", ["demo.unused", "infer.size"]),
    # another object's same-named attribute is no read of the field
    (("def go(cfg, engine):\n    return cfg.demo.used, cfg.name, engine.state.unused, self.unused, "
      "cfg.train.size, cfg.infer.other\n"), ["demo.unused", "infer.size"]),
    # reads through aliases: d = cfg.demo; s = cfg.infer
    (("def go(cfg):\n    d, s = cfg.demo, None\n    s = cfg.infer\n    return d.used + d.unused, s.size, "
      "cfg.train.size, cfg.name\n"), []),
    (("def go(job):\n    return job.cfg.demo.used, job.cfg.demo.unused, job.cfg.train.size, "
      "job.cfg.infer.size\n"), ["name"]),
])
def test_walk_finds_an_unread_field(tmp_path, source, missing):
    """The walk names the field that only its declaration and validation touch."""
    (tmp_path / "run.py").write_text(source)
    assert unread(package_reads(tmp_path, set()), _Top) == missing

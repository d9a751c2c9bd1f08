"""What the docs name exists: every file (`rl/algo/varlen.py`) and every method (`WeightSync.push`)
that README.md, ARCHITECTURE.md, bench/PERFORMANCE.md and the module docstrings (package, bench, tests) mention is
in the tree, and the README lists every exit code. A file that moved or a method that went leaves
no stale pointer.

    .venv/bin/python -m pytest tests/unit/test_docs_refs.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from areal_kit.errors import ExitCode

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TREES = ("areal_kit", "bench", "tests")
# `rl/algo/varlen.py`, `areal_kit/cli.py`, a bare `store.py`: not part of a longer word or path.
PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
# `Controller.run`, `WeightSync.push`: a capitalised name, a dot, a lower-case attribute.
CLASS_METHOD = re.compile(r"(?<![\w.])([A-Z]\w*)\.([a-z_]\w*)\b")
FILE_SUFFIXES = {"md", "json", "jsonl", "tar", "py", "yaml", "yml", "txt", "log", "toml", "sh", "gz", "pt"}
PLACEHOLDERS = {"path/to/file.py"}
# Classes of other libraries (or local names in an example) the docs name; ours are checked.
NOT_OURS = {"AutoModelForCausalLM": "transformers", "AsyncLLM": "vLLM", "Trainer": "rl/driver/placement.py's example: a Ray actor"}


def _py_files() -> list[Path]:
    return sorted(p for t in TREES for p in (ROOT / t).rglob("*.py"))


def _docs() -> dict[Path, str]:
    docs = {ROOT / "README.md": (ROOT / "README.md").read_text(),
            ROOT / "ARCHITECTURE.md": (ROOT / "ARCHITECTURE.md").read_text(),
            ROOT / "bench" / "PERFORMANCE.md": (ROOT / "bench" / "PERFORMANCE.md").read_text()}
    for p in _py_files():
        text = ast.get_docstring(ast.parse(p.read_text()))
        if text:
            docs[p] = text
    return docs


def _exists(doc: Path, ref: str) -> bool:
    """ref from the repository root, the package, or the doc's own folder and those above it; a
    bare file name (the README's layout lists them under their folder) anywhere in the tree."""
    bases = [ROOT, ROOT / "areal_kit", *[d for d in doc.parents if ROOT in d.parents or d == ROOT]]
    if any((b / ref).is_file() for b in bases):
        return True
    return "/" not in ref and any(p.name == ref for p in _py_files())


def _classes() -> dict[str, set[str]]:
    """Each class of ours -> the names defined in its body (methods, properties, attributes) and
    its bases' (by name, within the tree)."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for p in _py_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                names = own.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))

    def every(cls: str, seen: frozenset = frozenset()) -> set[str]:
        return own.get(cls, set()).union(*(every(b, seen | {cls}) for b in bases.get(cls, []) if b not in seen))

    return {cls: every(cls) for cls in own}


def test_every_file_the_docs_name_is_in_the_tree():
    missing = [f"{doc.relative_to(ROOT)}: {m[1]}" for doc, text in _docs().items() for m in PATH.finditer(text)
               if m[1] not in PLACEHOLDERS and not _exists(doc, m[1])]
    assert not missing, "the docs name files that are not in the tree: " + "; ".join(missing)


def test_every_class_method_the_docs_name_is_defined():
    classes = _classes()
    wrong = []
    for doc, text in _docs().items():
        for m in CLASS_METHOD.finditer(text):
            cls, attr = m[1], m[2]
            if attr in FILE_SUFFIXES or cls in NOT_OURS:
                continue
            if cls not in classes:
                wrong.append(f"{doc.relative_to(ROOT)}: {m[0]} (no class {cls})")
            elif attr not in classes[cls]:
                wrong.append(f"{doc.relative_to(ROOT)}: {m[0]} ({cls} has no {attr})")
    assert not wrong, "the docs name methods that do not exist: " + "; ".join(wrong)


def test_the_readme_lists_every_exit_code():
    readme = (ROOT / "README.md").read_text()
    missing = [f"{c.value} {c.name}" for c in ExitCode if not re.search(rf"\|\s*{c.value}\s*\|\s*`?{c.name}`?\s*\|", readme)]
    assert not missing, f"README.md's exit code table lacks: {', '.join(missing)}"

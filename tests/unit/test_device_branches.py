"""Every module that branches on the device has its row in ARCHITECTURE.md's "Where CPU and GPU runs
differ", and every test a row names is in the tree: GPU-only code cannot land unlisted.

What counts as a branch on the device, read from each module's syntax tree (so docstrings and
comments never count, and neither does code that only passes the platform's values along):
- a comparison (==, !=, in, not in) with one of the device words "cpu", "cuda", "nccl", "gloo",
  "vllm-cpu", alone or in a tuple, list or set (case-sensitive: Ray's "CPU" and "GPU" resources
  are names of resources, not devices), and a dict keyed by one of them (a table by device);
- a `case` pattern of one of those words;
- reading the platform's predicates: `.is_cpu`, `.is_cuda`, `.exclusive_weight_send`, and calling
  sharing.py's `shares_gpus` or `sleep_mode` (false on every CPU run);
- `torch.cuda` in any form (`torch.cuda.X`, `from torch.cuda import ...`, `import torch.cuda`):
  code that only runs where CUDA is;
- a tensor's or a worker's `.device.type`;
- the switch itself, the string "AREAL_DEVICE".
A module that calls a listed module's function (hardware.vllm_kwargs, hardware.synchronize) does
not branch itself: the function does, and its module's row says what it does on each device.

The table's first column names its modules as `areal_kit/...py`; any column names tests as
`tests/...py`, a glob allowed (it must match a file). A module the table names must exist and still
branch, so that the list stays true when a branch goes.

    .venv/bin/python -m pytest tests/unit/test_device_branches.py -q
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Where CPU and GPU runs differ"
DEVICE_WORDS = frozenset({"cpu", "cuda", "nccl", "gloo", "vllm-cpu"})
PREDICATES = frozenset({"is_cpu", "is_cuda", "exclusive_weight_send"})
PREDICATE_CALLS = frozenset({"shares_gpus", "sleep_mode"})
CUDA_MODULES = ("torch.cuda",)
MODULE = re.compile(r"`(areal_kit/[\w/]+\.py)`")
TEST = re.compile(r"`(tests/[\w/*.-]+\.py)`")


def _words(node: ast.AST) -> list[str]:
    """The string constants of node, or of a tuple, list or set it is."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [w for e in node.elts for w in _words(e)]
    return []


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def branch(node: ast.AST) -> str:
    """What makes node a branch on the device (see the module docstring), or ''."""
    if isinstance(node, ast.Compare):
        hit = [w for side in (node.left, *node.comparators) for w in _words(side) if w in DEVICE_WORDS]
        return f'compares with "{hit[0]}"' if hit else ""
    if isinstance(node, ast.Dict):
        hit = [w for k in node.keys if k is not None for w in _words(k) if w in DEVICE_WORDS]
        return f'a dict keyed by "{hit[0]}"' if hit else ""
    if isinstance(node, ast.match_case):
        hit = [n.value for n in ast.walk(node.pattern) if isinstance(n, ast.Constant) and n.value in DEVICE_WORDS]
        return f'a case of "{hit[0]}"' if hit else ""
    if isinstance(node, ast.Attribute):
        if node.attr in PREDICATES:
            return f".{node.attr}"
        name = _dotted(node)
        if any(name == m or name.startswith(m + ".") for m in CUDA_MODULES):
            return name
        if node.attr == "type" and isinstance(node.value, ast.Attribute) and node.value.attr == "device":
            return ".device.type"
        return ""
    if isinstance(node, ast.Call) and _called(node) in PREDICATE_CALLS:
        return f"calls {_called(node)}"
    if isinstance(node, ast.ImportFrom) and any((node.module or "").startswith(m) for m in CUDA_MODULES):
        return f"from {node.module} import"
    if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "cuda" for a in node.names):
        return "from torch import cuda"
    if isinstance(node, ast.Import) and any(a.name.startswith(CUDA_MODULES) for a in node.names):
        return "import torch.cuda"
    if isinstance(node, ast.Constant) and node.value == "AREAL_DEVICE":
        return "AREAL_DEVICE"
    return ""


def branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of each branch on the device in a module's source."""
    return sorted({(getattr(n, "lineno", 0), why) for n in ast.walk(ast.parse(source)) if (why := branch(n))})


@functools.cache  # one scan of the tree (about half a second) for the tests below
def branching_modules() -> dict[str, list[tuple[int, str]]]:
    """Each module of areal_kit/ that branches on the device -> its branches."""
    out = {}
    for p in sorted((ROOT / "areal_kit").rglob("*.py")):
        found = branches(p.read_text())
        if found:
            out[p.relative_to(ROOT).as_posix()] = found
    return out


def table() -> list[tuple[list[str], list[str]]]:
    """(modules, tests) of each row of ARCHITECTURE.md's table of CPU/GPU differences."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    assert SECTION in text, f"ARCHITECTURE.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in body.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        first = line.strip("|").split("|", 1)[0]
        modules = MODULE.findall(first)
        if first.strip() == "Module":  # the header
            continue
        assert modules, f"a row of {SECTION!r} names no module (`areal_kit/...py`) in its first column: {line[:120]}"
        rows.append((modules, TEST.findall(line)))
    assert rows, f"{SECTION!r} has no table"
    return rows


def test_every_module_that_branches_on_the_device_has_its_row():
    listed = {m for modules, _ in table() for m in modules}
    unlisted = {m: found for m, found in branching_modules().items() if m not in listed}
    assert not unlisted, (
        f"modules branch on the device without a row in ARCHITECTURE.md's {SECTION!r} (what CPU does, what "
        "GPU does, the CPU test that crosses the same boundary or why none can): "
        + "; ".join(f"{m} (line {found[0][0]}: {found[0][1]})" for m, found in unlisted.items()))


def test_every_module_the_table_names_exists_and_still_branches():
    found = branching_modules()
    stale = sorted({m for modules, _ in table() for m in modules if m not in found})
    assert not stale, f"ARCHITECTURE.md's {SECTION!r} names modules that are gone or no longer branch: {stale}"


def test_every_test_the_table_names_is_in_the_tree():
    named = sorted({t for _, tests in table() for t in tests})
    assert named
    missing = [t for t in named if not (any(ROOT.glob(t)) if "*" in t else (ROOT / t).is_file())]
    assert not missing, f"ARCHITECTURE.md's {SECTION!r} names tests that are not in the tree: {missing}"


@pytest.mark.parametrize("source, why", [
    ("if plat.device == 'cuda': pass", 'compares with "cuda"'),
    ("x = backend in ('nccl',)", 'compares with "nccl"'),
    ("ARGS = {'cpu': 1, 'cuda': 2}", 'a dict keyed by "cpu"'),
    ("match d:\n    case 'cpu':\n        pass", 'a case of "cpu"'),
    ("if p.is_cpu: pass", ".is_cpu"),
    ("torch.cuda.synchronize()", "torch.cuda.synchronize"),
    ("from torch.cuda import empty_cache", "from torch.cuda import"),
    ("from torch import cuda", "from torch import cuda"),
    ("if t.device.type != 'meta': pass", ".device.type"),
    ("on = shares_gpus(cfg)", "calls shares_gpus"),
    ("v = os.environ.get('AREAL_DEVICE')", "AREAL_DEVICE"),
])
def test_each_kind_of_branch_is_found(source, why):
    assert why in [w for _, w in branches(source)]


@pytest.mark.parametrize("source", [
    '"""On CPU the engine runs ... == "cuda" ..."""',  # a docstring
    "t = x.to('cpu')",  # a device named, not branched on
    "if bundle['GPU'] == 1: pass",  # Ray's resource names
    "dev = plat.torch_device",
    "kw = hardware.vllm_kwargs(plat, path, 64)",  # the branch is in hardware.py
])
def test_what_only_names_or_passes_the_device_is_no_branch(source):
    assert branches(source) == []

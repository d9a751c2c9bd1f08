"""The package's shape: no import cycle, imports inside functions only where they keep `--help`
fast, and modules and functions short enough to read.

`areal-kit --help` loads the CLI and the command modules; everything heavy (torch, Ray, vLLM,
transformers) must stay out of that set, which is why those modules import inside their
commands. Every other module imports at the top, so that its dependencies are visible and a
cycle cannot hide inside a function; the exceptions are libraries whose import must wait for
the environment a worker sets first (vLLM, DeepSpeed) and optional ones (inside try or if).

The packages lean one way: the CLI starts the commands' packages, training may run the
evaluator for its in-training eval, and what two of them share (checkpoint naming, grading,
doctor's saved figures) sits in the modules below them all, which import none of them.

No module is over MAX_MODULE_LINES lines and no function body over MAX_FUNCTION_LINES: a longer
one is split along a seam (a section of its own module, a named helper), not allowed here.
"""

import ast
import functools
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "areal_kit"
HEAVY = ("torch", "ray", "vllm", "transformers", "deepspeed", "matplotlib", "math_verify", "omegaconf")
# peft: only LoRA runs (actor.lora) use it, and its import takes a second or two.
LAZY_BY_DESIGN = ("vllm", "deepspeed", "flash_attn", "wandb", "plotext", "torch.utils.tensorboard", "peft",
                  "math_verify")  # sympy under it: only where a grade runs
# Modules the training driver imports, whose model code only a worker (or a tiny model's first
# build) runs: importing it there kept a second of model classes out of every run's start-up.
MODEL_CODE_IN_WORKERS = {"areal_kit.rl.trainer.worker": ("transformers", "areal_kit.rl.algo"),
                         "areal_kit.data.tiny_model": ("transformers",),
                         # the driver builds a LoRA run's model on the meta device to check its targets
                         "areal_kit.rl.lora": ("transformers",),
                         # the driver starts Ray on a thread first; the controller and what it loads
                         # (torch, the workers' modules) import while Ray comes up
                         "areal_kit.rl.driver.launch": ("areal_kit.rl.driver.controller",
                                                        "areal_kit.rl.driver.checkpointer"),
                         # the chat server (fastapi, uvicorn, vLLM's OpenAI layer) loads only in an agent's engine
                         "areal_kit.rl.engine.worker": ("areal_kit.rl.engine.agent", "areal_kit.rl.engine.endpoint"),
                         # loaded at every start of SGLang's CPU venv (a .pth line): torch only once
                         # torchvision is imported, not in every pip or helper process there
                         "areal_kit.rl.engine.sglang_cpu_standins": ("torch",),
                         # half a second of import, paid on the thread that reads a long metrics
                         # file, not by the page's first answer
                         "areal_kit.view.metrics": ("pyarrow", "pyarrow.json")}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {_module(p): ast.parse(p.read_text()) for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Our modules `name` imports anywhere: at the top, or inside a function (a cycle hidden
    there is still a cycle); not under TYPE_CHECKING."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for sub in ast.walk(tree):
        if id(sub) in skip:
            continue
        if isinstance(sub, ast.Import):
            out |= {a.name for a in sub.names if a.name in known}
        elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("areal_kit"):
            if sub.module in known:
                out.add(sub.module)
            out |= {f"{sub.module}.{a.name}" for a in sub.names if f"{sub.module}.{a.name}" in known}
    out.discard(name)
    return out


# The packages that are commands, and which of the others each may import (anywhere in it,
# function-level imports included). Everything else in areal_kit (config, data, reward, and the
# modules at the top: checkpoints, netfigures, logs, ...) is below them and imports none of them.
MAY_IMPORT = {
    "cli": {"cluster", "rl", "eval", "monitor", "slurm", "view"},
    "rl": {"eval"},  # in-training validation runs the evaluator's pass@k
    "cluster": {"eval"},  # setup --data fetches the eval datasets onto the cluster's storage
    # `areal-kit logs` reads the recover checkpoints' state (rl/checkpoint/store.py), and a Slurm job's
    "monitor": {"rl", "slurm"},
    # `areal-kit view`'s run page lists the recover checkpoints as a resume sees them (the same store)
    "view": {"rl"},
    "slurm": set(),  # a job runs `areal-kit train` on its node: the submission needs none of the training
    "eval": set(),  # eval reads checkpoints, never the trainer
    "agents": set(),  # shipped tasks: the contracts and the data below them; the endpoint names their parser
}


def _package(module: str) -> str:
    """The top-level part of areal_kit a module belongs to: `rl` for areal_kit.rl.trainer.worker."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_the_packages_below_them():
    """cluster and rl never import each other (doctor runs the training through a command, the dry
    run reads doctor's figures from netfigures.py), nor eval rl, nor slurm either of them; the shared
    modules import no command."""
    mods = _modules()
    wrong = []
    for name, tree in mods.items():
        src = _package(name)
        for dep in sorted(_imports(name, tree, set(mods))):
            dst = _package(dep)
            if dst in MAY_IMPORT and dst != src and dst not in MAY_IMPORT.get(src, set()):
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the packages' direction: " + "; ".join(wrong)


# Inside rl/, one folder a process: the driver (rl/driver/) starts and calls the Ray actors, the
# trainer ranks (rl/trainer/) and the rollout engines (rl/engine/), and the engines load code into
# vLLM's worker processes (rl/vllm_worker/). What two of them share sits below all of them: the
# weight sync's wire and plan (rl/weight_sync/), the recover checkpoint's format (rl/checkpoint/),
# what every actor process has (rl/common/), the algorithm (rl/algo/: pure math, which reaches
# into nothing that runs a process). No process's folder imports another's.
PROCESSES = ("areal_kit.rl.driver", "areal_kit.rl.trainer", "areal_kit.rl.engine", "areal_kit.rl.vllm_worker")
SHARED = ("areal_kit.rl.weight_sync", "areal_kit.rl.checkpoint", "areal_kit.rl.common")
RL_MAY_NOT_IMPORT = {
    **{p: tuple(q for q in PROCESSES if q != p and q != "areal_kit.rl.vllm_worker") for p in PROCESSES},
    # an engine hands vLLM the extension by its name; its own code never runs there
    "areal_kit.rl.vllm_worker": tuple(q for q in PROCESSES if q != "areal_kit.rl.vllm_worker"),
    **{s: PROCESSES for s in SHARED},
    "areal_kit.rl.algo": (*PROCESSES, *SHARED, "areal_kit.rl.memory"),
}
# The driver imports the actors' classes: to create them (ray.remote) and to name their methods
# in its typed calls (rl/driver/client.py). It never runs their code.
DRIVER_NAMES = {"areal_kit.rl.trainer.worker", "areal_kit.rl.engine.worker", "areal_kit.rl.common.stacks"}


def test_rl_layers_follow_the_processes():
    mods = _modules()
    wrong = []
    for name, tree in mods.items():
        for layer, banned in RL_MAY_NOT_IMPORT.items():
            if name == layer or name.startswith(layer + "."):
                wrong += [f"{name} imports {dep}" for dep in sorted(_imports(name, tree, set(mods)))
                          if any(dep == b or dep.startswith(b + ".") for b in banned)
                          and not (layer == "areal_kit.rl.driver" and dep in DRIVER_NAMES)]
    assert not wrong, "rl/ imports against the processes' direction: " + "; ".join(wrong)


def _help_modules() -> set[str]:
    code = "import sys, areal_kit.cli; print(' '.join(sorted(m for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def _graph_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every module of ours that `name` imports, wherever the import stands: at the top, inside a
    function, under TYPE_CHECKING (a circle through an annotation still ties the two modules into
    one). `from pkg import mod` is the module pkg.mod where that is one, else pkg; a relative import
    is resolved against name's package."""
    package = name if any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    out.add(f"{base}.{a.name}")
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected part of the graph with more than one module
    (Tarjan's algorithm, iterative), as one circle through it, first module again at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            nxt = next((n for n in todo if n not in index or n in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt is not None:
                low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        part.add(m)
                        if m == node:
                            break
                    if len(part) > 1:
                        parts.append(part)
    return [_circle(graph, part) for part in parts]


def _circle(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """One circle inside a strongly connected part: from its first module, the shortest way back."""
    start = min(part)
    paths = {n: [start, n] for n in sorted(graph[start] & part)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for n in frontier:
            for m in sorted(graph[n] & part):
                if m not in paths:
                    paths[m] = [*paths[n], m]
                    nxt.append(m)
        frontier = nxt
    return paths[start]


def test_no_import_cycle():
    """No module of areal_kit imports, through any chain, a module that imports it back: not at the
    top, not inside a function, not under TYPE_CHECKING. What two modules share lives in a module
    below both (a Protocol there where one side only names the other's type)."""
    mods = _modules()
    graph = {m: _graph_imports(m, t, set(mods)) for m, t in mods.items()}
    cycles = [" -> ".join(c) for c in _cycles(graph)]
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_the_cycle_finder_names_every_circle():
    """The finder itself, on a graph with a known answer: two circles (one of three modules, one of
    two), a module that only imports into one, and one with no import."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert _cycles(graph) == [["d", "e", "d"], ["a", "b", "c", "a"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import m\n"
                     "def f():\n    from p.q import X\nfrom . import r\n")
    assert _graph_imports("p.s", tree, {"p", "p.m", "p.q", "p.r", "p.s"}) == {"p.m", "p.q", "p.r"}


def test_help_loads_no_heavy_library():
    loaded = _help_modules()
    heavy = sorted(h for h in HEAVY if h in loaded)
    assert not heavy, f"`areal-kit --help` imports {heavy}; keep them inside the commands that need them"


@pytest.mark.slow
def test_function_level_imports_only_where_help_needs_them():
    help_set = {m for m in _help_modules() if m.startswith("areal_kit")}
    offenders = []
    for name, tree in _modules().items():
        if name in help_set:
            continue
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            chain, n = [], node
            while n in parents:
                n = parents[n]
                chain.append(n)
            funcs = [i for i, c in enumerate(chain) if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if not funcs or any(isinstance(c, (ast.Try, ast.If)) for c in chain[:funcs[0]]):
                continue  # module level, or a guarded (optional / conditional) import
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if any(mod == k or mod.startswith(k + ".") for k in LAZY_BY_DESIGN + MODEL_CODE_IN_WORKERS.get(name, ())):
                continue
            offenders.append(f"{name}:{node.lineno} imports {mod}")
    # torch comes with the cpu or gpu extra: a controller with the base install plans and
    # provisions a cluster (hardware.detect) without it.
    offenders = [o for o in offenders if not (o.startswith("areal_kit.hardware:") and o.endswith(" torch"))]
    assert not offenders, "imports inside functions of modules `--help` never loads: " + "; ".join(offenders)


@pytest.mark.slow
def test_every_import_of_ours_names_what_exists():
    """`from areal_kit.m import x` anywhere in the tree (package, bench, tests) names a module
    and a name that exist. Imports inside functions run only when the function does: a benchmark
    importing a function that moved to another module fails only when someone runs it."""
    missing = []
    files = [*PKG.rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    for path in sorted(files):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("areal_kit"):
                mod = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                            if not hasattr(mod, a.name) and not _is_module(f"{node.module}.{a.name}")]
    assert not missing, "imports of names that do not exist: " + "; ".join(missing)


def _is_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def test_every_module_is_at_most_450_lines():
    """Every line counts, docstrings and comments included: they are read too."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(PKG.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along a seam): " + "; ".join(long)


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body: from its first statement after the docstring to its end. The
    signature does not count (a typer command declares one option a line, with its help), nor the
    docstring; a nested function's lines count in the function around it as well as its own."""
    body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
    first = body[0]
    start = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", []))])
    return node.end_lineno - start + 1


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in tree, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)


def test_every_function_body_is_at_most_60_lines():
    """Counted from the first statement after the signature and docstring (see _body_lines), so a
    typer command whose options make a long signature over a short body passes; no allowance."""
    long = [f"{p.relative_to(ROOT)}:{node.lineno} {name}: {n} lines"
            for p in sorted(PKG.rglob("*.py")) for name, node in _functions(ast.parse(p.read_text()))
            if (n := _body_lines(node)) > MAX_FUNCTION_LINES]
    assert not long, (f"function bodies over {MAX_FUNCTION_LINES} lines (split them into named helpers): "
                      + "; ".join(long))

"""What the docs name exists. The docs: README.md, every page of docs/, ARCHITECTURE.md,
bench/PERFORMANCE.md and the module docstrings (package, bench, tests).

- every file (`rl/algo/varlen.py`) and every method (`WeightSync.push`) they mention is in the tree;
- every `areal-kit COMMAND ...` of README.md and docs/ (a line of a code block, or a span of inline
  code) names a command of the CLI, and each `--option` it spells is one of that command's (old
  spellings the CLI still accepts count);
- every `--option` named alone in their inline code is an option of some command, and every config
  key they set (`areal-kit train PRESET key=value`, an inline `ppo.kl_ctl=0.1`) is in the schema;
- every relative link between them reaches a file, and a `#anchor` a heading of that file;
- every docs/ page is linked from the README and links back to it, and no line of prose is written
  in two places (the README and docs/ move text, they do not copy it);
- the README lists every exit code.

A file that moved, a method or option that went, a heading renamed leaves no stale pointer.

    .venv/bin/python -m pytest tests/unit/test_docs_refs.py -q
"""

from __future__ import annotations

import ast
import os
import re
import shlex
from collections import Counter
from functools import cache
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


def _pages() -> list[Path]:
    """The README and the pages of docs/: the guide, where every command is checked."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _markdown() -> list[Path]:
    """Every markdown file of the docs, the pages and the rest."""
    return [*_pages(), ROOT / "ARCHITECTURE.md", ROOT / "bench" / "PERFORMANCE.md"]


def _docs() -> dict[Path, str]:
    docs = {p: p.read_text() for p in _markdown()}
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


# ```bash ... ```: its language, its body. A block of another language (python, text: output) holds
# no command line.
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = {"", "bash", "sh", "shell", "console"}
INLINE = re.compile(r"`([^`]+)`")
ENV = re.compile(r"^[A-Za-z_]\w*=")
HELP = {"--help", "-h"}


@cache
def _cli() -> dict[str, set[str]]:
    """Each command of the CLI -> every option it accepts, old spellings and --no- forms included."""
    import typer.main

    from areal_kit.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} | HELP
            for name, cmd in group.commands.items()}


def _command_lines(text: str) -> list[str]:
    """Each command line of a page's shell blocks (continuations joined) and each inline span."""
    lines = []
    for m in FENCE.finditer(text):
        if m[1] in SHELL:
            lines += m[2].replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    lines += [" ".join(m[1].split()) for m in INLINE.finditer(prose)]
    return lines


def _invocations(line: str) -> list[list[str]]:
    """The `areal-kit ...` commands of one shell line, each as its words (comments dropped, split at
    ; && || |, leading VAR=value assignments dropped)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        words = list(lex)
    except ValueError:  # an unbalanced quote: prose, not a command
        return []
    out, cur = [], []
    for w in [*words, ";"]:
        if w and set(w) <= set(";&|"):
            while cur and ENV.match(cur[0]):
                cur.pop(0)
            if cur and os.path.basename(cur[0]) == "areal-kit":
                out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out


def _wrong_command(words: list[str]) -> str | None:
    cli = _cli()
    args = [w.strip("[]") for w in words[1:]]
    if not args or args[0] in HELP:
        return None
    cmd, rest = args[0], args[1:]
    if cmd not in cli:
        return f"no command {cmd!r}"
    bad = [w.split("=", 1)[0] for w in rest
           if (w.startswith("--") and w != "--") or re.fullmatch(r"-[A-Za-z]", w)]
    bad = [w for w in bad if w not in cli[cmd]]
    return f"{cmd} has no option {', '.join(bad)}" if bad else None


def test_every_command_the_docs_give_exists_with_its_options():
    wrong, seen = [], 0
    for page in _pages():
        for line in _command_lines(page.read_text()):
            for words in _invocations(line):
                seen += 1
                why = _wrong_command(words)
                if why:
                    wrong.append(f"{page.relative_to(ROOT)}: `{' '.join(words)}`: {why}")
    assert seen > 50, f"only {seen} areal-kit commands found in the docs: the parser lost them"
    assert not wrong, "the docs give commands the CLI does not take: " + "; ".join(wrong)


def test_the_command_check_catches_a_wrong_command_and_option():
    assert _invocations("AREAL_DEVICE=cuda .venv/bin/areal-kit train 1.5B_n4 --dry-run  # a plan") == [
        [".venv/bin/areal-kit", "train", "1.5B_n4", "--dry-run"]]
    assert [w[1] for w in _invocations("bash .ci/install.sh && areal-kit train tiny ; areal-kit plot tiny/run0")] == [
        "train", "plot"]
    assert _wrong_command(["areal-kit", "train", "tiny", "--fresh", "--discard"]) is None
    assert _wrong_command(["areal-kit", "eval", "--n_sampling", "8", "--num-samples=8"]) is None  # old and new
    assert _wrong_command(["areal-kit", "setup", "--private_key_file", "K", "[--dry-run]"]) is None
    assert _wrong_command(["areal-kit", "trian", "tiny"]) == "no command 'trian'"
    assert _wrong_command(["areal-kit", "logs", "RUN", "--folow"]) == "logs has no option --folow"
    assert OVERRIDE.match("ppo.kl_ctl=0.1")[1] == "ppo.kl_ctl" and not OVERRIDE.match("BASE_IMAGE=x")


# Options of other programs that the docs name in inline code: they are not the CLI's.
OTHER_OPTIONS = {"--gres": "sbatch", "--signal": "sbatch", "--requeue": "sbatch"}


def test_every_option_the_docs_name_alone_is_an_option_of_a_command():
    """`--fresh --discard`, `--min-shm-gb` in prose: each an option of one command or another."""
    every = set().union(*_cli().values())
    wrong = []
    for page in _pages():
        for m in INLINE.finditer(FENCE.sub("", page.read_text())):
            span = " ".join(m[1].split())
            if span.startswith("--"):
                opts = {m[0] for w in span.split() if (m := re.match(r"--[A-Za-z][\w-]*", w.strip("[]")))}
                wrong += [f"{page.relative_to(ROOT)}: {o}" for o in opts if o not in every and o not in OTHER_OPTIONS]
    assert not wrong, "the docs name options no command has: " + "; ".join(wrong)


# `ppo.kl_ctl=0.1`: a config override (a dotted key, lower case); `[key=value ...]` is a placeholder.
OVERRIDE = re.compile(r"^\+?([a-z_]\w*(?:\.\w+)*)=\S*$")


def _overrides(page: Path) -> list[str]:
    """The keys a page sets: each key=value of an `areal-kit train` command, and each of an inline
    span made of dotted key=value overrides alone."""
    text = page.read_text()
    keys = []
    for line in _command_lines(text):
        for words in _invocations(line):
            if words[1:2] == ["train"]:
                keys += [m[1] for w in words[2:] if (m := OVERRIDE.match(w))]
    for m in INLINE.finditer(FENCE.sub("", text)):
        words = m[1].split()
        found = [OVERRIDE.match(w) for w in words]
        if words and all(found) and all("." in f[1] for f in found):
            keys += [f[1] for f in found]
    return [k for k in keys if k != "key"]


def test_every_config_key_the_docs_set_exists():
    from areal_kit.config import loader

    keys = loader.all_keys()
    known = set(getattr(loader, "FIXED", {})) | set(getattr(loader, "WITHOUT_EFFECT", {}))

    def exists(key: str) -> bool:  # a key of the schema, or one inside an option whose value is a mapping
        parts = key.split(".")
        return key in keys or key in known or any(".".join(parts[:i]) in keys for i in range(1, len(parts)))

    seen = {p: _overrides(p) for p in _pages()}
    assert sum(map(len, seen.values())) > 30, "the parser lost the docs' overrides"
    wrong = [f"{p.relative_to(ROOT)}: {k}" for p, ks in seen.items() for k in ks if not exists(k)]
    assert not wrong, "the docs set config keys the schema does not have: " + "; ".join(wrong)

# [text](target): a link; an image's ![alt](src) too.
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markdown links to their text, lower case, every character but
    letters, digits, spaces, - and _ dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", md.read_text()), re.MULTILINE):
        slug = _slug(m[1])
        out.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return out


def _links(md: Path) -> list[str]:
    prose = INLINE.sub("", FENCE.sub("", md.read_text()))
    return [t for t in LINK.findall(prose) if not SCHEME.match(t)]


def test_every_relative_link_between_the_docs_resolves():
    wrong = []
    for md in _markdown():
        for target in _links(md):
            path, _, anchor = target.partition("#")
            dest = Path(os.path.normpath(md.parent / path)) if path else md
            if ROOT not in dest.parents and dest != ROOT:
                wrong.append(f"{md.relative_to(ROOT)}: {target} (outside the repository)")
            elif not dest.exists():
                wrong.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                wrong.append(f"{md.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not wrong, "the docs link to places that are not there: " + "; ".join(wrong)


def test_the_link_check_knows_github_anchors():
    assert _slug("The tiny preset's KL term and learning rate") == "the-tiny-presets-kl-term-and-learning-rate"
    assert _slug("`task_reward` against the guide's curves") == "task_reward-against-the-guides-curves"
    assert _slug("Agents: tools and OpenAI-style clients") == "agents-tools-and-openai-style-clients"


def test_every_docs_page_is_linked_from_the_readme_and_back():
    readme = {Path(os.path.normpath(ROOT / t.partition("#")[0])) for t in _links(ROOT / "README.md")}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    unlisted = [p.name for p in pages if p not in readme]
    assert not unlisted, f"README.md does not link these docs/ pages: {unlisted}"
    no_way_back = [p.name for p in pages if not any(t.partition("#")[0] == "../README.md" for t in _links(p))]
    assert not no_way_back, f"these docs/ pages do not link back to README.md: {no_way_back}"
    untitled = [p.name for p in pages if not p.read_text().startswith("# ")]
    assert not untitled, f"these docs/ pages do not start with a title: {untitled}"


def test_no_line_of_prose_is_written_twice():
    """The README and docs/ hold each fact once: a long line found twice was copied, not moved."""
    where: dict[str, list[str]] = {}
    for page in _pages():
        for line in FENCE.sub("", page.read_text()).splitlines():
            line = line.strip()
            if len(line) >= 60 and not set(line) <= set("|-: "):
                where.setdefault(line, []).append(str(page.relative_to(ROOT)))
    twice = {line[:60]: at for line, at in where.items() if len(at) > 1}
    assert not twice, f"lines written twice (link to one place instead): {twice}"

"""areal_kit.console: rich tables on a terminal, whole markdown rows and unwrapped lines elsewhere.

    .venv/bin/python -m pytest tests/unit/test_console.py -q
"""

import io

import pytest
from rich.table import Table

from areal_kit.console import make_console, markdown_table

LONG = "a help text far longer than any terminal is wide, " * 6


@pytest.fixture(autouse=True)
def _no_terminal_hints(monkeypatch):
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def sample_table() -> Table:
    t = Table(title="[bold]options[/]")
    t.add_column("key")
    t.add_column("n", justify="right")
    t.add_column("help")
    t.add_row("ppo.max_head_offpolicyness", "0", LONG.strip())
    t.add_row("[green]marked[/]", "12", "one | two")
    return t


def printed(table_or_text, **kw) -> str:
    buf = io.StringIO()
    make_console(file=buf, **kw).print(table_or_text)
    return buf.getvalue()


def test_off_a_terminal_a_table_is_markdown_with_whole_cells():
    lines = printed(sample_table()).splitlines()
    assert lines[0] == "options", f"title line: {lines[0]!r}"
    assert lines[2].startswith("| key "), f"header: {lines[2]!r}"
    assert lines[3].split(" | ")[1] == "--:", f"a right-justified column's rule: {lines[3]!r}"
    assert lines[4] == f"| ppo.max_head_offpolicyness |   0 | {LONG.strip()} |", f"first row: {lines[4]!r}"
    assert lines[5].startswith("| marked "), f"markup left in a cell: {lines[5]!r}"
    assert lines[5].endswith("| one \\| two |"), f"'|' in a cell not escaped: {lines[5]!r}"


def test_the_markdown_separator_line_is_valid():
    # markdown needs at least three dashes a column; a 1-character right-justified column gets them too
    rule = markdown_table(sample_table()).splitlines()[3]
    cells = rule.strip("| ").split(" | ")
    assert all(len(c) >= 3 for c in cells), rule


def test_off_a_terminal_text_is_never_wrapped_and_has_no_colour_codes():
    out = printed("[bold red]" + LONG + "[/]")
    assert out == LONG + "\n", f"wrapped or styled: {out!r}"


def test_on_a_terminal_a_table_is_rich():
    out = printed(sample_table(), force_terminal=True)
    assert "┃" in out, "no rich borders on a terminal"
    assert "| --- |" not in out, "markdown on a terminal"


def test_no_color_on_a_terminal(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    out = printed("[red]stop[/]", force_terminal=True)
    assert "stop" in out
    assert "\x1b[31m" not in out, f"a colour code despite NO_COLOR: {out!r}"


def test_colour_on_a_terminal_without_no_color():
    out = printed("[red]stop[/]", force_terminal=True)
    assert "\x1b[31m" in out, f"no colour on a terminal: {out!r}"

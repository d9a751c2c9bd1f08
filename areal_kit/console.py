"""The console every command prints through: rich on a terminal, whole lines everywhere else.

On a terminal the output is rich's: colours, and tables fitted to the window. When stdout is
not a terminal (a pipe, a file, CI) nothing is cut: text lines are never wrapped, and a table
prints as a markdown table, one line per row with every cell whole. That form was chosen over
rich's own table at an unlimited width and over tab-separated rows: `grep KEY` shows the key
with its value and help on one line, with no box-drawing characters around them; the `|`
separators are visible (tabs are not) and split with `cut -d'|'`; and the text saved to a file
renders as a table in a README or an issue, like the results.md that `areal-kit eval` writes.
Programs that want values rather than a view have `--show-args --json` and results.csv.

No colour codes are written when stdout is not a terminal, and on a terminal NO_COLOR turns
colours off (rich reads both FORCE_COLOR and NO_COLOR from the environment).

    from areal_kit.console import make_console
    console = make_console()
    console.print(table)                 # a rich table on a terminal, markdown rows in a pipe
    console.out(line, highlight=False)   # one line exactly as given, never wrapped

    areal-kit train tiny --show-args | grep offpolicy
"""

from __future__ import annotations

import io
from typing import IO, Any

from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Column, Table
from rich.text import Text


class ReadableConsole(Console):
    """A rich Console that prints tables as markdown rows when its output is not a terminal."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if not self.is_terminal and any(isinstance(o, Table) for o in objects):
            objects = tuple(Text(markdown_table(o, self), end="") if isinstance(o, Table) else o
                            for o in objects)
            kwargs["soft_wrap"] = True  # a row is one line however long it is
        super().print(*objects, **kwargs)


def make_console(*, highlight: bool = True, file: IO[str] | None = None, force_terminal: bool | None = None) -> Console:
    """The console of a command. Off a terminal it never wraps: a long line is one line.

    highlight: rich's colouring of numbers and strings in printed text (terminal only).
    file, force_terminal: for tests and for callers that print elsewhere than stdout.
    """
    # emoji=False: ":name:" in a path or a log line is text, never an emoji.
    console = ReadableConsole(highlight=highlight, file=file, force_terminal=force_terminal, emoji=False)
    console.soft_wrap = not console.is_terminal
    return console


def markdown_table(table: Table, console: Console | None = None) -> str:
    """A rich Table as markdown: title line, header, one line per row; cells whole, markup removed.

    Cells are padded to their column's widest so the rows line up in a file: on the left in
    right-justified columns (`---:` in the separator line; centred ones get `:---:`), on the
    right in the others but the last, whose text just ends the line.
    """
    console = console or Console(file=io.StringIO(), emoji=False)
    columns = table.columns
    header = [_plain(c.header, console) for c in columns]
    body = [[_plain(cell, console) for cell in row] for row in zip(*(c.cells for c in columns))]
    shown = ([header] if table.show_header else []) + body
    widths = [max([3] + [cell_len(r[i]) for r in shown]) for i in range(len(columns))]

    def line(cells: list[str]) -> str:
        padded = []
        for i, (c, w, column) in enumerate(zip(cells, widths, columns)):
            fill = " " * (w - cell_len(c))
            if column.justify == "right":
                padded.append(fill + c)
            else:  # a long last cell (a help text) sets no width for the ones above it
                padded.append(c if i == len(columns) - 1 else c + fill)
        return "| " + " | ".join(padded) + " |"

    def rule(column: Column, width: int) -> str:
        dashes = "-" * width
        if column.justify == "right":
            return dashes[:-1] + ":"
        if column.justify == "center":
            return ":" + dashes[2:] + ":"
        return dashes

    lines = []
    if table.title:
        lines += [_plain(table.title, console), ""]
    if table.show_header:
        lines.append(line(header))
        # An unpadded last column (left-justified) gets the shortest rule markdown allows.
        rules = [rule(c, 3 if i == len(columns) - 1 and c.justify != "right" else w)
                 for i, (c, w) in enumerate(zip(columns, widths))]
        lines.append("| " + " | ".join(rules) + " |")
    lines += [line(r) for r in body]
    if table.caption:
        lines += ["", _plain(table.caption, console)]
    return "\n".join(lines) + "\n"


def _plain(cell: RenderableType | None, console: Console) -> str:
    """A cell's text as it would show, without styles, on one line, `|` escaped for markdown."""
    if cell is None:
        text = ""
    elif isinstance(cell, str):
        text = console.render_str(cell, highlight=False).plain  # markup applied as rich would
    elif isinstance(cell, Text):
        text = cell.plain
    else:  # any other renderable: rendered without a width limit
        buf = io.StringIO()
        wide = Console(file=buf, width=1_000_000, color_system=None, emoji=False)
        wide.print(cell, soft_wrap=True)
        text = buf.getvalue()
    return " ".join(text.split("\n")).strip().replace("|", "\\|")

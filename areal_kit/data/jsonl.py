"""Read jsonl files line by line, with errors a user can act on (file, line, what was expected)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from areal_kit.errors import UserError


def iter_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a bad line is a one-line UserError."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one JSON object a line") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: a {type(row).__name__}, expected a JSON object")
            yield lineno, row

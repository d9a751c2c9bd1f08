"""Several checkpoints in one `areal-kit eval`: which folders, and the table that compares them.

`--model_path` may be repeated, or name a folder of checkpoints (a run's saved models,
`.../checkpoints/<user>/<experiment>/<trial>/actor`), taken in global-step order. Each checkpoint
is evaluated on its own into OUT/<checkpoint name>/ (resumable, as a single run is), then
OUT/compare.json, compare.md and compare.csv hold one row per checkpoint: for each dataset its
greedy accuracy and sampled pass@1 (percent).

    areal-kit eval --model_path RUN/checkpoints/root/tiny/run0/actor --output_path OUT
    areal-kit eval --model_path BASE --model_path RUN/.../globalstep600 --output_path OUT
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from areal_kit.checkpoints import step_of
from areal_kit.errors import UserError
from areal_kit.eval import report

if TYPE_CHECKING:
    from rich.table import Table

METRICS = ("greedy_acc", "sample_pass@1")


def _is_model(p: Path) -> bool:
    """A Hugging Face model folder, or a LoRA adapter folder (the base named in it)."""
    return (p / "config.json").exists() or (p / "adapter_config.json").exists()


def expand(paths: list[str]) -> list[Path]:
    """The model folders to evaluate: each path that is one (it has config.json), else the
    checkpoints inside it, in global-step order."""
    models: list[Path] = []
    for given in paths:
        p = Path(given)
        if not p.is_dir():
            raise UserError(f"model path {given} not found; expected a Hugging Face model folder "
                            "(config.json, weights, tokenizer) or a folder of them")
        if _is_model(p):
            models.append(p)
            continue
        # a save under way is a .tmp folder until renamed
        inside = sorted((c for c in p.iterdir() if _is_model(c) and not c.name.endswith(".tmp")),
                        key=lambda c: (step_of(c.name), c.name))
        if not inside:
            raise UserError(f"model path {given} has no config.json and no checkpoint folders inside; expected "
                            "a Hugging Face model folder (a checkpoint saved by areal-kit train is one) "
                            "or a folder of them")
        models += inside
    names = [m.name for m in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"two checkpoints are named {twice[0]!r}; each is evaluated into OUT/<name>, so "
                        "give folders with different names")
    return models


def columns(aggs: list[dict]) -> list[str]:
    first = aggs[0]["results"]
    return ["checkpoint"] + [f"{d}:{m}" for d in first for m in METRICS
                             if any(a["results"][d][m] is not None for a in aggs)]


def table(aggs: list[dict]) -> dict:
    """One row per checkpoint (by the folder name), a column per dataset and metric."""
    cols = columns(aggs)
    rows = []
    for a in aggs:
        row = {"checkpoint": Path(a["settings"]["model_path"]).name}
        for c in cols[1:]:
            d, m = c.split(":", 1)
            row[c] = a["results"][d][m]
        rows.append(row)
    return {"columns": cols, "rows": rows, "settings": {k: v for k, v in aggs[0]["settings"].items()
                                                        if k != "model_path"}}


def write(out: Path, cmp: dict) -> None:
    (out / "compare.json").write_text(json.dumps(cmp, indent=1) + "\n")
    (out / "compare.md").write_text(report.md_table(cmp["columns"], cmp["rows"]))
    (out / "compare.csv").write_text(report.csv_table(cmp["columns"], cmp["rows"]))


def rich_table(cmp: dict) -> Table:
    return report.rich_rows("checkpoints compared (percent)", cmp["columns"], cmp["rows"])

"""The evaluation table: aggregate graded records, print them, write JSON, markdown, CSV.

Columns are the AReaL guide's:
  dataset | num_questions | greedy_length | sample_length | greedy_acc | sample_pass@1 | pass@8 | pass@16
lengths are mean generated tokens; accuracies are percentages; pass@k is the unbiased
estimator (areal_kit.eval.passk) averaged over questions, shown where num_samples >= k.
The aggregate holds no timings or dates, so re-running on the same records reproduces it
byte for byte. Printed through areal_kit.console, the table is rich's on a terminal and
markdown rows (every name and number whole) in a pipe.

    python -m areal_kit.eval.report OUT      # print the table of an earlier run
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from areal_kit.eval.data import sample_keys
from areal_kit.eval.passk import mean_pass_at_k

if TYPE_CHECKING:
    from areal_kit.eval.options import EvalConfig

COLUMNS = ["dataset", "num_questions", "greedy_length", "sample_length", "greedy_acc",
           "sample_pass@1", "pass@8", "pass@16"]
PASS_KS = (8, 16)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def aggregate(cfg: EvalConfig, questions: dict, records: dict[str, dict[str, dict]]) -> dict:
    """Numbers per dataset from the records of the current questions and sample count."""

    results = {}
    for name, qs in questions.items():
        recs = records[name]
        greedy, sampled, counts, truncated, n = [], [], [], 0, 0
        for q in qs:
            c = 0
            for key, mode, _ in sample_keys(q, cfg):
                r = recs[key]
                n += 1
                truncated += r["finish_reason"] in ("length", "prompt_too_long")
                if mode == "greedy":
                    greedy.append(r)
                else:
                    sampled.append(r)
                    c += bool(r["correct"])
            if cfg.num_samples:
                counts.append((cfg.num_samples, c))
        row = {
            "dataset": name,
            "num_questions": len(qs),
            "greedy_length": _mean([r["tokens"] for r in greedy]),
            "sample_length": _mean([r["tokens"] for r in sampled]),
            "greedy_acc": _mean([100.0 * r["correct"] for r in greedy]),
            "sample_pass@1": round(100 * mean_pass_at_k(counts, 1), 4) if counts else None,
        }
        for k in PASS_KS:
            ok = counts and (cfg.num_samples or 0) >= k  # None only before EvalConfig's check
            row[f"pass@{k}"] = round(100 * mean_pass_at_k(counts, k), 4) if ok else None
        row["num_samples"] = cfg.num_samples
        row["truncated_pct"] = round(100.0 * truncated / n, 4) if n else None
        results[name] = row
    settings = {k: getattr(cfg, k) for k in ("model_path", "prompt_type", "max_gen_tokens", "greedy",
                                             "num_samples", "temperature", "top_p", "seed",
                                             "max_questions")}
    return {"settings": settings, "columns": COLUMNS, "results": results}


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


# Tables of rows (dicts) under named columns, as text: shared with eval/compare.py.
def md_table(columns: list[str], rows: Iterable[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_table(columns: list[str], rows: Iterable[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r[c] is None else r[c] for c in columns])
    return buf.getvalue()


def rich_rows(title: str, columns: list[str], rows: Iterable[dict]) -> Table:
    """A rich Table of the rows; printed by areal_kit.console, it is markdown in a pipe."""
    t = Table(title=escape(title))  # a model folder name is text, not markup
    for i, c in enumerate(columns):
        # The name column never wraps: numbers may, a dataset or checkpoint name stays one word.
        t.add_column(c, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        t.add_row(*[Text(_fmt(r[c])) for c in columns])
    return t


def rows(agg: dict) -> list[list[str]]:
    return [[_fmt(r[c]) for c in COLUMNS] for r in agg["results"].values()]


def markdown(agg: dict) -> str:
    return md_table(COLUMNS, agg["results"].values())


def csv_text(agg: dict) -> str:
    return csv_table(COLUMNS, agg["results"].values())


def rich_table(agg: dict) -> Table:
    s = agg["settings"]
    return rich_rows(f"{Path(s['model_path']).name}  prompt {s['prompt_type']}, max_gen_tokens "
                     f"{s['max_gen_tokens']}, {s['num_samples']} samples at T={s['temperature']} "
                     f"top_p={s['top_p']}", COLUMNS, agg["results"].values())


def write(out: Path, agg: dict) -> None:
    out = Path(out)
    (out / "aggregate.json").write_text(json.dumps(agg, indent=1) + "\n")
    (out / "results.md").write_text(markdown(agg))
    (out / "results.csv").write_text(csv_text(agg))


if __name__ == "__main__":
    import sys

    from areal_kit.console import make_console

    make_console().print(rich_table(json.loads((Path(sys.argv[1]) / "aggregate.json").read_text())))

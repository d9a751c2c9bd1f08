"""Training datasets from files: AReaL's format, plain jsonl, Hugging Face datasets folders.

`load(dataset_cfg)` returns rows, each a dict with a unique `id`, the question under `prompt`
and the reference under `answer` (jsonl, hf) or `solutions` (areal), plus the row's other
fields (a custom reward may read them). Chosen by dataset.type:

  areal  AReaL's published RL data: jsonl rows {"prompt", "query_id", "task"}; id2info.json
         maps each query_id to {"solutions": ["\\boxed{...}", ...]}. A row is correct when
         the final answer matches any solution (reward `math`).
  jsonl  any jsonl with the question and answer under dataset.question_field / answer_field.
  hf     a Hugging Face datasets folder: one written by `save_to_disk` (read with
         load_from_disk) or a script-free folder of data files (jsonl/json/parquet/csv, as
         downloaded from the Hub); split "train".

Every problem (a missing file, a bad line, a query_id absent from id2info.json) is one
UserError naming the file, before any worker starts. `split_eval` holds out the in-training
evaluation split.

    python -m areal_kit.data.sources PATH [areal|jsonl|hf]     # row count and the first row
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, TypeAlias

from areal_kit.data.jsonl import iter_objects
from areal_kit.errors import UserError

if TYPE_CHECKING:
    from areal_kit.config.dataset import DatasetConfig

# What a dataset is read by: dataset.*, or one dataset.mix entry over it (data/prompts.py's _sources).
Source: TypeAlias = "DatasetConfig | SimpleNamespace"

_SHOW = 3  # ids quoted in an error about many rows


def load(d: Source, path: str | None = None) -> list[dict]:
    """Rows of a DatasetConfig (`path` overrides d.path: the eval split uses the same format)."""
    path = check_path(d, path)
    if d.type == "areal":
        return load_areal(path, d.id2info_path)
    if d.type == "jsonl":
        return _as_qa(read_jsonl(path), path, d.question_field, d.answer_field)
    if d.type == "hf":
        return _as_qa(read_hf(path), path, d.question_field, d.answer_field)
    raise UserError(f"dataset.type={d.type!r} has no file loader; expected areal, jsonl or hf")


def check_path(d: Source, path: str | None = None) -> str:
    """d.path (or `path`), a UserError where nothing is there."""
    path = path or d.path
    if not os.path.exists(path):
        raise UserError(f"dataset.path={path} not found; expected a {d.type} dataset there")
    return path


def read_jsonl(path: str) -> list[dict]:
    """Objects of a jsonl file; a bad line is a UserError naming the file and line."""
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder; expected a .jsonl file (dataset.type=hf reads folders)")
    rows = []
    for n, row in iter_objects(path):
        row["_line"] = n
        rows.append(row)
    if not rows:
        raise UserError(f"{path} has no rows; expected a jsonl file with one prompt a line")
    return rows


def read_id2info(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UserError(f"id2info file {path} not found; expected AReaL's id2info.json (query_id -> "
                        "solutions), set dataset.id2info_path") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"id2info file {path} is unreadable ({str(e).splitlines()[0]}); expected a JSON "
                        "object mapping query_id to {\"solutions\": [...]}") from None
    if not isinstance(data, dict):
        raise UserError(f"id2info file {path} holds a {type(data).__name__}; expected a JSON object "
                        "mapping query_id to {\"solutions\": [...]}")
    return data


def _solutions(info: object) -> list[str] | None:
    sols = info.get("solutions") if isinstance(info, dict) else None
    if isinstance(sols, str):
        sols = [sols]
    if not isinstance(sols, list) or not sols or not all(isinstance(s, str) for s in sols):
        return None
    return sols


def load_areal(path: str, id2info_path: str = "") -> list[dict]:
    """AReaL rows with their solutions attached; every query_id must be in id2info.json."""
    rows = read_jsonl(path)
    id2info_path = id2info_path or os.path.join(os.path.dirname(os.path.abspath(path)), "id2info.json")
    # Later AReaL files carry solutions inline; id2info.json is then optional.
    inline = all(_solutions(r) for r in rows)
    id2info = read_id2info(id2info_path) if not (inline and not os.path.exists(id2info_path)) else {}
    out, missing = [], []
    for r in rows:
        if "query_id" not in r or not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise UserError(f"{path}:{r['_line']}: expected AReaL fields \"prompt\" (text) and \"query_id\"")
        qid = str(r["query_id"])
        # AReaL v0.1 ids can carry a per-copy suffix "<id>@idx:<n>"; id2info keys are the bare id.
        info = id2info.get(qid, id2info.get(qid.split("@idx:")[0])) if id2info else r
        sols = _solutions(info)
        if sols is None:
            missing.append(qid)
            continue
        out.append({**{k: v for k, v in r.items() if k != "_line"}, "id": qid, "solutions": sols})
    if missing:
        raise UserError(f"{path}: {len(missing)} of {len(rows)} rows have a query_id missing from {id2info_path} "
                        f"or without solutions ({', '.join(map(repr, missing[:_SHOW]))}"
                        f"{', ...' if len(missing) > _SHOW else ''}); expected every query_id there with a "
                        "non-empty \"solutions\" list")
    return _unique_ids(out)


def read_hf(path: str) -> list[dict]:
    """Rows of the "train" split of a datasets folder (save_to_disk output or script-free files)."""
    try:
        import datasets
    except ImportError:
        raise UserError("dataset.type=hf needs the `datasets` package; pip install datasets") from None
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"dataset.path={path} is not a folder; dataset.type=hf expects a datasets folder "
                        "(use dataset.type=jsonl for a .jsonl file)")
    saved = any((p / f).exists() for f in ("dataset_dict.json", "state.json"))
    try:
        if saved:
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise UserError(f"{path} has splits {', '.join(ds)}; expected a \"train\" split")
                ds = ds["train"]
        else:
            ds = datasets.load_dataset(str(p), split="train")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        raise UserError(f"{path}: not a readable datasets folder ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}); expected save_to_disk output or data files "
                        "with a train split") from None
    rows = [dict(r) for r in ds]
    if not rows:
        raise UserError(f"{path}: the train split is empty; expected prompts")
    return rows


def _as_qa(rows: list[dict], path: str, qf: str, af: str) -> list[dict]:
    """Question under `prompt`, reference under `answer`, a unique id for each row."""
    stem = Path(path).stem
    out = []
    for i, r in enumerate(rows):
        where = f"{path}:{r['_line']}" if "_line" in r else f"{path} row {i}"
        q = r.get(qf)
        if not isinstance(q, str) or not q:
            raise UserError(f"{where}: no text in field {qf!r} (fields: {', '.join(k for k in r if k != '_line')}); "
                            "set dataset.question_field")
        a = r.get(af)
        if a is None or a == "":
            raise UserError(f"{where}: no reference answer in field {af!r}; set dataset.answer_field")
        rid = r.get("id", r.get("unique_id", r.get("idx")))
        row = {k: v for k, v in r.items() if k != "_line"}
        row.update(id=str(rid) if rid is not None else f"{stem}-{i}", prompt=q,
                   answer=a if isinstance(a, (str, list)) else str(a))
        out.append(row)
    return _unique_ids(out)


def _unique_ids(rows: list[dict]) -> list[dict]:
    # Ids key a prompt's group of samples and the loader's record of used prompts: a repeated
    # id would merge two groups, so repeats get a suffix.
    seen: dict[str, int] = {}
    for r in rows:
        n = seen.get(r["id"], 0)
        seen[r["id"]] = n + 1
        if n:
            r["id"] = f"{r['id']}#{n}"
    return rows


def split_eval(rows: list[dict], d: DatasetConfig, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows): the eval split is d.eval_path (first eval_size rows, 0 = all),
    or else eval_size rows held out of the training data (seeded, removed from training)."""
    if d.eval_path:
        ev = load(d, d.eval_path)
        return rows, ev[:d.eval_size] if d.eval_size else ev
    if not d.eval_size:
        return rows, []
    if d.eval_size >= len(rows):
        raise UserError(f"dataset.eval_size={d.eval_size} holds out every prompt of the dataset ({len(rows)}); "
                        "expected fewer, or set dataset.eval_path")
    idx = set(random.Random(seed * 7919 + 17).sample(range(len(rows)), d.eval_size))
    return [r for i, r in enumerate(rows) if i not in idx], [r for i, r in enumerate(rows) if i in idx]


if __name__ == "__main__":
    import sys
    from types import SimpleNamespace

    from areal_kit.errors import refuse

    if len(sys.argv) not in (2, 3):
        refuse("usage: python -m areal_kit.data.sources PATH [areal|jsonl|hf]")
    kind = sys.argv[2] if len(sys.argv) == 3 else ("hf" if os.path.isdir(sys.argv[1]) else "jsonl")
    cfg = SimpleNamespace(path=sys.argv[1], type=kind, id2info_path="", question_field="question",
                          answer_field="answer")
    got = load(cfg)
    print(f"{len(got)} rows; first: {json.dumps(got[0], ensure_ascii=False)[:500]}")

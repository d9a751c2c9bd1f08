"""Evaluation datasets and prompts: the manifest in evaluation/, where the sets live, rows to questions.

evaluation/manifest.yaml names each dataset (its url, source, question and answer fields,
answer format); evaluation/prompts.yaml holds the prompt template of each prompt_type. A
dataset is read from <data_dir>/<name>/test.jsonl; every problem in it is reported as a
UserError naming the file and line. `eval_sets_dir(storage_root)` is where `areal-kit setup`
fetches the sets and `areal-kit eval` looks for them by default (`find_sets` fetches a missing
one there on first use).

    python -m areal_kit.eval.data DATA_DIR math_500 [--prompt_type deepscaler]  # first prompt
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Protocol

import yaml

from areal_kit.data.assets import Asset, FetchError, fetch
from areal_kit.data.jsonl import iter_objects
from areal_kit.errors import UserError
from areal_kit.reward import extract_answer, gsm8k_reference

# evaluation/ ships inside the package (pyproject.toml maps it to areal_kit.evaluation), so every
# kind of install finds it; AREAL_EVAL_MANIFEST_DIR points at another folder of the same files.
EVAL_DIR = Path(os.environ.get("AREAL_EVAL_MANIFEST_DIR") or str(resources.files("areal_kit.evaluation")))
ANSWER_FORMATS = ("answer", "gsm8k", "boxed")
EVAL_SETS = "datasets/eval"  # under the storage root


@dataclass(frozen=True)
class DatasetSpec:
    """One manifest entry (see evaluation/manifest.yaml for the meaning of each field)."""

    name: str
    question_field: str
    answer_field: str
    answer_format: str = "answer"
    id_field: str | None = None
    source: tuple[str, ...] = ()
    rows: int | None = None
    url: str = ""

    def __post_init__(self) -> None:
        if self.answer_format not in ANSWER_FORMATS:
            raise UserError(f"manifest: dataset {self.name}: answer_format {self.answer_format!r}; "
                            f"expected one of {', '.join(ANSWER_FORMATS)}")


@dataclass(frozen=True)
class Question:
    """One evaluation question, ready to prompt and grade."""

    dataset: str
    qid: str  # id_field value, or the row number
    question: str
    reference: str  # the final answer to grade against
    prompt: str


def _load_yaml(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path} not found; expected the evaluation/ folder of areal-kit "
                        "(or set AREAL_EVAL_MANIFEST_DIR)")
    with open(path) as f:
        return yaml.safe_load(f) or {}


@cache
def manifest() -> dict[str, DatasetSpec]:
    raw = _load_yaml(EVAL_DIR / "manifest.yaml").get("datasets", {})
    return {name: DatasetSpec(name=name, **{**d, "source": tuple(d.get("source", ()))})
            for name, d in raw.items()}


@cache
def prompt_templates() -> dict[str, str]:
    raw = _load_yaml(EVAL_DIR / "prompts.yaml").get("prompt_types", {})
    return {name: d["template"] for name, d in raw.items()}


def parse_data_names(data_names: str) -> list[str]:
    """'math_500,aime24' -> ['math_500', 'aime24'], each checked against the manifest."""
    names = [n.strip() for n in data_names.split(",") if n.strip()]
    known = manifest()
    if not names:
        raise UserError(f"--data_names is empty; known datasets: {', '.join(known)}")
    for n in names:
        if n not in known:
            raise UserError(f"unknown dataset {n!r}; known datasets: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise UserError(f"--data_names lists a dataset twice: {data_names}")
    return names


def template_for(prompt_type: str) -> str:
    templates = prompt_templates()
    if prompt_type not in templates:
        raise UserError(f"unknown prompt_type {prompt_type!r}; known: {', '.join(templates)}")
    return templates[prompt_type]


def reference_answer(spec: DatasetSpec, value: object) -> str:
    if spec.answer_format == "gsm8k":
        return gsm8k_reference(str(value))
    if spec.answer_format == "boxed":
        return extract_answer(str(value), strict=True) or ""
    return str(value)


def dataset_path(data_dir: str | Path, name: str) -> Path:
    return Path(data_dir) / name / "test.jsonl"


def eval_sets_dir(storage_root: str) -> Path:
    """Where `areal-kit setup` fetches the eval sets and `areal-kit eval` reads them by default."""
    return Path(storage_root) / EVAL_SETS


def eval_set_assets(data_dir: str | Path, names: list[str] | None = None) -> list[Asset]:
    """The manifest's sets that have a url, as assets landing at <data_dir>/<name>/test.jsonl."""
    specs = manifest()
    return [Asset(f"eval/{n}", specs[n].url, str(dataset_path(data_dir, n)), rows=specs[n].rows or 0)
            for n in names or specs if specs[n].url]


def find_sets(data_dir: str | Path, names: list[str], fetch_missing: bool, mirror: str = "") -> list[str]:
    """Check that every set is in data_dir; with fetch_missing, fetch a missing one from its url
    (through mirror, if given). A set still missing is a UserError: the set, where it was looked
    for and the command that fetches it. Returns a line per set fetched."""
    done = []
    by_name = {a.name.removeprefix("eval/"): a for a in eval_set_assets(data_dir, names)}
    for name in names:
        path = dataset_path(data_dir, name)
        if path.exists():
            continue
        a = by_name.get(name)
        if a is None:
            src = manifest()[name].source[0] if manifest()[name].source else "its source"
            raise UserError(f"dataset file {path} not found; put {name} there (from {src}) "
                            "or point --data_dir at a folder of <name>/test.jsonl")
        why = ""
        if fetch_missing:
            try:
                done.append(fetch(a, mirror))
                continue
            except (FetchError, OSError) as e:
                why = f", and fetching it failed ({e})"
        cmd = f"python -m areal_kit.cluster.fetch {a.uri} {path} --rows {a.rows}"
        cmd += f" --mirror {mirror}" if mirror else " (add --mirror URL where the internet is out of reach)"
        raise UserError(f"eval set {name} is missing: {path} not found{why}; fetch it with: {cmd}, or point "
                        "--data_dir at a folder of <name>/test.jsonl")
    return done


def load_questions(data_dir: str | Path, name: str, prompt_type: str,
                   max_questions: int = 0) -> list[Question]:
    """The first max_questions (0 = all) questions of a dataset, prompts filled in."""
    spec = manifest()[name]
    template = template_for(prompt_type)
    path = dataset_path(data_dir, name)
    if not path.exists():
        src = spec.source[0] if spec.source else "its source"
        raise UserError(f"dataset file {path} not found; put {name} there (from {src}) "
                        "or point --data_dir at a folder of <name>/test.jsonl")
    out: list[Question] = []
    seen: set[str] = set()
    for lineno, row in iter_objects(path):
        for field in (spec.question_field, spec.answer_field):
            if not isinstance(row.get(field), (str, int, float)) or row.get(field) == "":
                raise UserError(f"{path}:{lineno}: row has no {field!r} field "
                                f"(the manifest's {name} rows need {spec.question_field!r} "
                                f"and {spec.answer_field!r}); fields present: {', '.join(row)}")
        qid = str(row[spec.id_field]) if spec.id_field and spec.id_field in row else str(lineno - 1)
        if qid in seen:
            raise UserError(f"{path}:{lineno}: duplicate {spec.id_field or 'row'} id {qid!r}")
        seen.add(qid)
        question = str(row[spec.question_field])
        # str.replace, not str.format: LaTeX braces in the question must stay as they are.
        out.append(Question(name, qid, question, reference_answer(spec, row[spec.answer_field]),
                            template.replace("{question}", question)))
        if max_questions and len(out) >= max_questions:
            break
    if not out:
        raise UserError(f"{path} has no rows")
    return out


class Sampling(Protocol):
    """What `sample_keys` reads of a run's settings: EvalConfig's greedy and num_samples
    (eval/options.py, which reads this module's templates: typed so, this module needs nothing of it)."""

    @property
    def greedy(self) -> bool: ...

    @property
    def num_samples(self) -> int | None: ...


def sample_keys(q: Question, cfg: Sampling) -> list[tuple[str, str, int]]:
    """(key, mode, index) of every sample a question needs, under an EvalConfig's greedy / num_samples."""
    keys = [(f"{q.dataset}/{q.qid}/greedy", "greedy", 0)] if cfg.greedy else []
    keys += [(f"{q.dataset}/{q.qid}/s{i}", "sample", i) for i in range(cfg.num_samples or 0)]  # None only before EvalConfig's check
    return keys


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir")
    ap.add_argument("name")
    ap.add_argument("--prompt_type", default="deepscaler")
    a = ap.parse_args()
    q = load_questions(a.data_dir, a.name, a.prompt_type, max_questions=1)[0]
    print(f"{q.dataset} #{q.qid} reference={q.reference!r}\n{q.prompt}")

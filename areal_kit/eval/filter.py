"""Difficulty filtering: every training prompt's pass rate, and the prompts within a range.

Each prompt of a training dataset is sampled num_samples times by the eval engine
(eval/engine.py), each completion graded by the grader of in-training validation
(reward/grading.grade_row), and the prompts whose pass rate n_correct / num_samples lies within
--keep LO-HI (inclusive) are written out: dropping the ones the model always or never solves,
which teach a GRPO-style policy nothing, as AReaL did for its boba data. Prompts are read and
tokenized the way training reads them (data/sources.load, data/prompts.tokenize_rows); a prompt
longer than --max_prompt_len, which training would drop, is not sampled and never kept. The
options are FilterConfig's (eval/options.py).

Outputs under output_path:
  run_config.json   the settings a sample depends on (model, dataset and its content, chat
                    template, sampling, seed, max tokens); a re-run with other ones is refused
  samples.jsonl     one graded record a sample, appended chunk by chunk (fsynced)
  rates.jsonl       every prompt: id, pass_rate, n_correct, n_samples, kept
  filtered.jsonl    the kept rows as the dataset holds them, plus pass_rate, n_correct, n_samples
  id2info.json      areal input with an id2info.json: the kept rows' entries of it

filtered.jsonl is read back by training with the input's format: --type areal stays areal (its
prompt/query_id rows, with the id2info.json beside it, or with their solutions inline when the
input had them inline), jsonl and hf become dataset.type=jsonl with the same question and
answer fields.

Resumable like `areal-kit eval`: a re-run skips every sample in samples.jsonl, so an interrupted
run resumes and a finished one only rewrites the outputs (no engine start): a new --keep or
--max_prompt_len costs no generation. Sample i of a prompt has its own seed, so it is the same
whatever --num_samples is: more samples adds the missing ones, fewer uses the first ones.

    areal-kit filter --model_path CKPT --dataset boba.jsonl --type areal --num_samples 8 \\
        --keep 0.1-0.9 --output_path boba_filtered
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from areal_kit import durable
from areal_kit.console import make_console
from areal_kit.data import sources
from areal_kit.data.prompts import tokenize_rows
from areal_kit.data.tokenizer import load_tokenizer
from areal_kit.errors import UserError
from areal_kit.eval.evaluation import append_records, check_identity, failed, generate, load_records
from areal_kit.eval.options import FilterConfig
from areal_kit.interrupts import interruption
from areal_kit.reward import extract_answer
from areal_kit.reward.grading import grade_row, references

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

# Upper edges of the summary's histogram bins of pass rates strictly between 0 and 1.
_BINS = (0.25, 0.5, 0.75, 1.0)


def kept(rate: float | None, keep: tuple[float, float]) -> bool:
    """The selection rule: a sampled prompt whose pass rate is within keep, ends included."""
    return rate is not None and keep[0] <= rate <= keep[1]


def sample_keys(row_id: str, num_samples: int) -> list[str]:
    return [f"{row_id}/s{i}" for i in range(num_samples)]


def digest(rows: list[dict]) -> str:
    """A fingerprint of what the samples depend on in the dataset: ids, questions, references."""
    blob = json.dumps([[r["id"], r["prompt"], references(r)] for r in rows], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prompt_rates(rows: list[dict], sampled: set[str], done: dict[str, dict], num_samples: int,
                 keep: tuple[float, float]) -> list[dict]:
    """One rates row per dataset row, in order: the pass rate over its first num_samples
    records, and whether keep keeps it; a row not sampled (too long) has pass_rate None."""
    out = []
    for r in rows:
        if r["id"] not in sampled:
            out.append({"id": r["id"], "pass_rate": None, "n_correct": 0, "n_samples": 0, "kept": False,
                        "skipped": "prompt_too_long"})
            continue
        recs = [done[k] for k in sample_keys(r["id"], num_samples)]
        n_correct = sum(bool(x["correct"]) for x in recs)
        rate = n_correct / num_samples
        out.append({"id": r["id"], "pass_rate": rate, "n_correct": n_correct, "n_samples": num_samples,
                    "kept": kept(rate, keep)})
    return out


def summary(rates: list[dict], keep: tuple[float, float], max_prompt_len: int) -> str:
    """One line: how many were kept, the mean rate and a histogram of the rates."""
    got = [r["pass_rate"] for r in rates if r["pass_rate"] is not None]
    n_kept = sum(r["kept"] for r in rates)
    hist = [("0", sum(x == 0 for x in got))]
    lo = 0.0
    for hi in _BINS:
        hist.append((f"{'(' if lo == 0 else '['}{lo:g},{hi:g})", sum(lo < x < hi or (x == lo and lo > 0) for x in got)))
        lo = hi
    hist.append(("1", sum(x == 1 for x in got)))
    mean = f"{sum(got) / len(got):.3f}" if got else "-"
    line = (f"filter: kept {n_kept} of {len(rates)} prompts (pass rate in [{keep[0]:g}, {keep[1]:g}]); "
            f"mean pass rate {mean}; rates {' '.join(f'{b}:{n}' for b, n in hist)}")
    skipped = len(rates) - len(got)
    if skipped:
        line += f"; {skipped} longer than max_prompt_len={max_prompt_len} not sampled"
    return line


def _raw_rows(cfg: FilterConfig) -> list[dict]:
    """The dataset's rows as stored (sources.load adds id/prompt/answer/solutions), for writing back."""
    raw = sources.read_hf(cfg.dataset) if cfg.type == "hf" else sources.read_jsonl(cfg.dataset)
    return [{k: v for k, v in r.items() if k != "_line"} for r in raw]


def _tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    try:
        return load_tokenizer(model_path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a folder without a tokenizer
        raise UserError(f"cannot load the tokenizer of {model_path} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}); expected a model folder with its "
                        "tokenizer files (tokenizer.json, tokenizer_config.json)") from None


def _write_outputs(cfg: FilterConfig, out: Path, raw: list[dict], rates: list[dict]) -> None:
    # Each file is replaced whole (a temporary file renamed over it): never half-written.
    durable.replace_lines(out / "rates.jsonl", [json.dumps(r, ensure_ascii=False) + "\n" for r in rates])
    keep_rows = [{**row, **{k: rate[k] for k in ("pass_rate", "n_correct", "n_samples")}}
                 for row, rate in zip(raw, rates) if rate["kept"]]
    if cfg.type == "areal" and cfg.id2info_file().exists():
        # load_areal looks up the bare id of an "<id>@idx:<n>" query_id when the full one is absent.
        info = sources.read_id2info(str(cfg.id2info_file()))
        sub = {}
        for row in keep_rows:
            qid = str(row["query_id"])
            key = qid if qid in info else qid.split("@idx:")[0]
            sub[key] = info[key]
        durable.replace_lines(out / "id2info.json", [json.dumps(sub, ensure_ascii=False) + "\n"])
    durable.replace_lines(out / "filtered.jsonl",
                          [json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in keep_rows])


def run(cfg: FilterConfig, console: Console | None = None) -> dict:
    """Sample, grade, and write the rates and the filtered dataset; returns {"rates", "summary"}."""
    console = console or make_console()
    out = Path(cfg.output_path)
    # Every input is read and checked before the output folder is touched.
    rows = sources.load(cfg.dataset_config())
    raw = _raw_rows(cfg)
    if len(raw) != len(rows):  # load keeps every row in order; anything else would misalign the write-back
        raise UserError(f"{cfg.dataset}: {len(raw)} stored rows but {len(rows)} loaded; expected one row each")
    tok = _tokenizer(cfg.model_path)
    if cfg.apply_chat_template and not getattr(tok, "chat_template", None):
        raise UserError(f"--apply_chat_template: the tokenizer of {cfg.model_path} has no chat template; expected "
                        "a model with one (tokenizer_config.json: chat_template), or no --apply_chat_template")
    tokenized, _ = tokenize_rows(rows, tok, cfg.max_prompt_len, cfg.apply_chat_template, cfg.question_field)
    sampled = {r["id"] for r in tokenized}
    check_identity(out, cfg.identity(digest(rows)))
    path = out / "samples.jsonl"
    done = load_records(path)
    n_before = len(done)
    todo = [(k, r, i) for r in tokenized for i, k in enumerate(sample_keys(r["id"], cfg.num_samples))
            if k not in done]
    n_total = len(tokenized) * cfg.num_samples
    console.print(f"filter: {n_total} samples over {len(tokenized)} prompts, {n_total - len(todo)} already done, "
                  f"{len(todo)} to generate")
    if todo:
        by_key = {k: (r, i) for k, r, i in todo}

        def record(key: str, text: str, n_tokens: int, finish: str) -> dict:
            row, i = by_key[key]
            return {"key": key, "id": row["id"], "sample": i, "completion": text,
                    "extracted": extract_answer(text), "correct": grade_row(text, row), "tokens": n_tokens,
                    "finish_reason": finish}

        def store(recs: list[dict]) -> None:
            append_records(path, recs)
            done.update({r["key"]: r for r in recs})

        try:
            generate(cfg, tok, [(k, tuple(r["prompt_ids"]), False) for k, r, _ in todo], record, store, console)
        except Exception as e:  # an engine that fails to start or dies: one line, the traceback kept
            if (stop := interruption(e)) is not None:
                raise stop from None
            raise failed("filter", e, out, len(done) - n_before) from e
    rates = prompt_rates(rows, sampled, done, cfg.num_samples, cfg.keep_range)
    _write_outputs(cfg, out, raw, rates)
    (out / "error.log").unlink(missing_ok=True)  # an earlier failure's, now resumed past
    line = summary(rates, cfg.keep_range, cfg.max_prompt_len)
    console.print(line, markup=False)
    fmt = "areal" if cfg.type == "areal" else "jsonl"
    console.print(f"wrote {out}/filtered.jsonl (train with dataset.type={fmt}), rates.jsonl, samples.jsonl",
                  markup=False)
    return {"rates": rates, "summary": line}

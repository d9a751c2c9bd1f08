"""The evaluation run: questions -> vLLM generations -> graded per-sample records -> table.

Outputs under output_path:
  run_config.json            the settings that decide what a sample is (model, prompt_type,
                             sampling, seed); a re-run with different ones is refused
  <dataset>/samples.jsonl    one graded record a sample, appended chunk by chunk (fsynced)
  aggregate.json             the table's numbers per dataset (no timings: identical on re-run)
  results.md, results.csv    the table

A re-run skips every sample already in samples.jsonl, so an interrupted evaluation resumes
where it stopped and a finished one only rebuilds the table (no engine start); --overwrite
(overwrite=True) deletes the earlier records first and evaluates from scratch. The pieces that
make it so (check_identity, load_records, append_records, generate) also serve `areal-kit
filter` (eval/filter.py). The options are EvalConfig's (eval/options.py).

    areal-kit eval --model_path CKPT --output_path OUT --data_names math_500,aime24
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from areal_kit import adapters, durable
from areal_kit.console import make_console
from areal_kit.data.tokenizer import decode, load_tokenizer
from areal_kit.errors import RunFailed, UserError, describe
from areal_kit.eval import data as evdata
from areal_kit.eval import engine as evengine
from areal_kit.eval import report
from areal_kit.eval.engine import GenRequest
from areal_kit.eval.options import EvalConfig, FilterConfig
from areal_kit.interrupts import interruption
from areal_kit.reward.grading import grade_completion

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase


def clear_records(out: Path) -> int:
    """--overwrite: delete an earlier evaluation's settings and per-sample records in out (nothing
    else there), so that every sample is generated and graded anew; the records deleted."""
    n = 0
    for path in sorted(out.glob("*/samples.jsonl")):
        n += len(load_records(path))
        path.unlink()
    (out / "run_config.json").unlink(missing_ok=True)
    return n


def sample_seed(seed: int, key: str) -> int:
    """A per-sample seed that depends only on the run seed and the sample's key."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_identity(out: Path, ident: dict) -> None:
    """Refuse (UserError) an output folder whose run_config.json holds other settings; a new
    folder is made and the settings written. Shared by eval and filter: a sample stored there
    is reused only when everything it depends on is the same."""
    path = out / "run_config.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in ident.items() if old.get(k) != v]
        if diff:
            raise UserError(f"{out} holds samples made with other settings ({'; '.join(diff)}); "
                            "use another --output_path, or delete it to start over")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ident, indent=1) + "\n")


def load_records(path: Path) -> dict[str, dict]:
    """Records already written, by key. A torn last line (a crash mid-write) is cut off."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(raw))
    records = {}
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["key"]] = rec
    return records


def append_records(path: Path, records: list[dict]) -> None:
    """Append records to a jsonl file, on disk (fsynced) when this returns."""
    durable.append_lines(path, [json.dumps(r, ensure_ascii=False) + "\n" for r in records])


def _record(q: evdata.Question, key: str, mode: str, idx: int, text: str, n_tokens: int,
            finish: str, timeout_s: float) -> dict:
    pred, correct = grade_completion(text, [q.reference], timeout_s)
    return {"key": key, "dataset": q.dataset, "qid": q.qid, "mode": mode, "sample": idx,
            "prompt": q.prompt, "completion": text, "extracted": pred, "reference": q.reference,
            "correct": correct, "tokens": n_tokens, "finish_reason": finish}


def _model_max_len(model_path: str) -> int | None:
    if adapters.is_adapter_folder(model_path):
        model_path = adapters.adapter_base(model_path)
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg.get("max_position_embeddings")


def run(cfg: EvalConfig, console: Console | None = None) -> dict:
    """Evaluate; returns the aggregate (also written to output_path). Prints the table."""


    console = console or make_console()
    out = Path(cfg.output_path)
    questions = {n: evdata.load_questions(cfg.data_dir, n, cfg.prompt_type, cfg.max_questions)
                 for n in cfg.data_names}
    if cfg.overwrite and (cleared := clear_records(out)):
        console.print(f"--overwrite: deleted the {cleared} records of an earlier evaluation in {out}; evaluating from scratch",
                      markup=False)
    check_identity(out, cfg.identity())
    done = {}
    for n in cfg.data_names:
        (out / n).mkdir(parents=True, exist_ok=True)
        done[n] = load_records(out / n / "samples.jsonl")
    todo = [(q, k) for n in cfg.data_names for q in questions[n]
            for k in evdata.sample_keys(q, cfg) if k[0] not in done[n]]
    n_total = sum(len(evdata.sample_keys(q, cfg)) for qs in questions.values() for q in qs)
    console.print(f"eval: {n_total} samples over {len(cfg.data_names)} datasets, "
                  f"{n_total - len(todo)} already done, {len(todo)} to generate")
    if todo:
        try:
            _generate_all(cfg, todo, out, done, console)
        except Exception as e:  # an engine that fails to start or dies: one line, the traceback kept
            if (stop := interruption(e)) is not None:
                raise stop from None
            raise failed("eval", e, out, sum(map(len, done.values())) - (n_total - len(todo))) from e
    agg = report.aggregate(cfg, questions, done)
    report.write(out, agg)
    (out / "error.log").unlink(missing_ok=True)  # an earlier failure's, now resumed past
    console.print(report.rich_table(agg))
    console.print(f"wrote {out}/aggregate.json, results.md, results.csv, <dataset>/samples.jsonl", markup=False)
    return agg


def failed(what: str, e: Exception, out: Path, n_new: int) -> RunFailed:
    """The error for a failed generation of command `what`, its traceback written to OUT/error.log."""

    log = out / "error.log"
    log.write_text("".join(traceback.format_exception(e)), encoding="utf-8")
    kept = f"; the {n_new} sample(s) graded before it are kept, a re-run resumes after them" if n_new else ""
    return RunFailed(f"{what} failed: {describe(e)} (traceback in {log}{kept})")


def _generate_all(cfg: EvalConfig, todo: list[tuple[evdata.Question, tuple[str, str, int]]], out: Path,
                  done: dict[str, dict[str, dict]], console: Console) -> None:
    tok = load_tokenizer(cfg.model_path)
    ids = {}
    for q, _ in todo:
        if q.prompt not in ids:
            ids[q.prompt] = tuple(tok(q.prompt)["input_ids"])
    by_key = {key: (q, mode, idx) for q, (key, mode, idx) in todo}

    def record(key: str, text: str, n_tokens: int, finish: str) -> dict:
        q, mode, idx = by_key[key]
        return _record(q, key, mode, idx, text, n_tokens, finish, cfg.grade_timeout_s)

    prompts = [(key, ids[q.prompt], mode == "greedy") for q, (key, mode, idx) in todo]
    generate(cfg, tok, prompts, record, lambda recs: _store(recs, out, done), console)


def generate(cfg: EvalConfig | FilterConfig, tok: PreTrainedTokenizerBase, prompts: list[tuple[str, tuple[int, ...], bool]],
             make_record: Callable[[str, str, int, str], dict], store: Callable[[list[dict]], None],
             console: Console) -> None:
    """Generate each (key, prompt_ids, greedy) prompt on cfg's engines and record it: chunk by
    chunk, the completions decoded with `tok` become make_record(key, text, n_tokens,
    finish_reason) and go to store(records) before the next chunk starts, so a failure or a
    stop loses at most the chunk in flight. Shared by eval and filter; cfg needs model_path,
    max_gen_tokens, temperature, top_p, seed, tp, num_engines, chunk_size and enforce_eager.

    A sampled prompt's seed is sample_seed(cfg.seed, key), so a resumed run makes the samples an
    uninterrupted one would have. A prompt with no room for one generated token within the
    model's positions is recorded as an empty completion (finish_reason prompt_too_long)."""
    cap = _model_max_len(cfg.model_path)
    max_len = max(len(p) for _, p, _ in prompts) + cfg.max_gen_tokens
    max_len = min(max_len, cap) if cap else max_len
    requests, too_long = [], []
    for key, p, greedy in prompts:
        if len(p) >= max_len:  # no room for one generated token: recorded as unanswered
            too_long.append(make_record(key, "", 0, "prompt_too_long"))
            continue
        requests.append(GenRequest(key, tuple(p), 0.0 if greedy else cfg.temperature, cfg.top_p,
                                   min(cfg.max_gen_tokens, max_len - len(p)),
                                   None if greedy else sample_seed(cfg.seed, key)))
    if too_long:
        console.print(f"[yellow]{len(too_long)} samples have prompts longer than the model's "
                      f"{max_len} positions: recorded as wrong (finish_reason prompt_too_long)")
        store(too_long)
    if not requests:
        return
    t0 = time.time()
    engines = evengine.open_engines(cfg.model_path, max_len, cfg.seed, cfg.tp, cfg.num_engines, cfg.enforce_eager)
    console.print(f"{engines.num_engines} vLLM engine(s) ready in {time.time() - t0:.0f}s "
                  f"(max_model_len {max_len})")
    t1, n_tokens = time.time(), 0
    step = cfg.chunk_size * engines.num_engines
    cols = (*Progress.get_default_columns()[:2], MofNCompleteColumn(), BarColumn(), TimeElapsedColumn())
    try:
        with Progress(*cols, console=console, transient=True) as prog:
            task = prog.add_task("generating", total=len(requests))
            for i in range(0, len(requests), step):
                results = engines.generate(requests[i:i + step])
                recs = []
                for r in results:
                    text = decode(tok, r.token_ids, skip_special_tokens=True)
                    recs.append(make_record(r.key, text, len(r.token_ids), r.finish_reason))
                    n_tokens += len(r.token_ids)
                store(recs)
                prog.advance(task, len(results))
    finally:
        engines.close()
    dt = time.time() - t1
    console.print(f"generated {len(requests)} samples, {n_tokens} tokens in {dt:.1f}s "
                  f"({n_tokens / max(dt, 1e-9):.0f} tokens/s)")


def _store(recs: list[dict], out: Path, done: dict[str, dict[str, dict]]) -> None:
    by_ds: dict[str, list[dict]] = {}
    for r in recs:
        by_ds.setdefault(r["dataset"], []).append(r)
    for name, rs in by_ds.items():
        append_records(out / name / "samples.jsonl", rs)
        done[name].update({r["key"]: r for r in rs})



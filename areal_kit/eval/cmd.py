"""CLI commands `areal-kit eval` (evaluate checkpoints), `areal-kit filter` (keep training prompts by
pass rate) and `areal-kit grade` (check answers).

    areal-kit eval --model_path CKPT --output_path OUT --data_names math_500,aime24,amc23
    areal-kit eval --model_path RUN/checkpoints/root/tiny/run0/actor --output_path OUT   # each, compared
    areal-kit filter --model_path CKPT --dataset train.jsonl --num_samples 8 --keep 0.1-0.9 --output_path OUT
    areal-kit grade '\\frac{1}{2}' 0.5
    areal-kit grade --file pairs.jsonl        # rows {"pred": ..., "ref": ..., "expected": true}

Heavy imports (vllm, torch, math-verify) happen inside the commands. eval's and filter's options
that fill their run's config are declared on its fields (eval/options.py); the signatures below
are made of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from areal_kit.config.cluster_spec import DEFAULT_STORAGE
from areal_kit.console import make_console
from areal_kit.errors import ExitCode, UserError
from areal_kit.eval.options import DATA_NAMES, EVAL_OUT, EvalConfig, FilterConfig, Generation
from areal_kit.flags import build, command, params
from areal_kit.interrupts import stops_say_so
from areal_kit.options import Mirror, Storage

# eval's options, in the order --help lists them after the checkpoint and the output folder:
# EvalConfig's, with the ones filter takes too (Generation's) among them.
_EVAL = (params(EvalConfig, "prompt_type"), params(Generation, "max_gen_tokens num_samples"),
         params(EvalConfig, "n_sampling num_sample_nodes samples_per_node"), params(Generation, "temperature top_p"),
         params(EvalConfig, "greedy seed max_questions tp num_engines grade_timeout_s enforce_eager overwrite"))


@command(params(Generation, "model_path output_path"), *_EVAL, params(Storage), params(Mirror))
def eval_(
    data_names: str = typer.Option(",".join(DATA_NAMES), "--data_names", "--data-names",
                                   help="Comma-separated datasets from evaluation/manifest.yaml."),
    data_dir: str = typer.Option(None, "--data_dir", "--data-dir", envvar="AREAL_EVAL_DATA", show_envvar=True,
                                 help="Folder holding <name>/test.jsonl for each dataset (default: "
                                      "STORAGE/datasets/eval, where setup fetches them; a set missing "
                                      "there is fetched on first use)."),
    **given: Any,
) -> None:
    """Evaluate checkpoints with vLLM on math datasets and print the accuracy / pass@k table."""
    from areal_kit.eval import compare
    from areal_kit.eval import data as evdata
    from areal_kit.eval.evaluation import run

    model_path = list(given["model_path"])
    models = compare.expand(model_path)
    out = Path(given["output_path"] or EVAL_OUT)
    several = models != [Path(model_path[0])]  # more than one, or a folder of checkpoints
    if (out / ("run_config.json" if several else "compare.json")).exists():
        raise UserError(f"{out} holds the evaluation of {'one checkpoint' if several else 'several'}; "
                        "use another --output_path")
    names = evdata.parse_data_names(data_names)
    fetch_missing = data_dir is None  # into the storage's folder only, never into a folder the user named
    data_dir = data_dir or str(evdata.eval_sets_dir(build(Storage, given).storage or DEFAULT_STORAGE))
    mirror = build(Mirror, given).mirror or ""
    cfgs = [build(EvalConfig, given, model_path=str(m), output_path=str(out / m.name if several else out),
                  data_names=names, data_dir=data_dir)
            for m in models]
    console = make_console()
    for line in evdata.find_sets(data_dir, names, fetch_missing, mirror):  # the options are valid: fetch
        console.print(line, markup=False)
    with stops_say_so():  # the records graded so far are on disk: a re-run resumes after them
        aggs = []
        for i, cfg in enumerate(cfgs):
            if several:
                console.print(f"checkpoint {i + 1}/{len(cfgs)}: {cfg.model_path}", markup=False)
            aggs.append(run(cfg, console))
    if several:
        cmp = compare.table(aggs)
        compare.write(out, cmp)
        console.print(compare.rich_table(cmp))
        console.print(f"wrote {out}/compare.json, compare.md, compare.csv", markup=False)


@command(params(Generation, "model_path"),
         params(FilterConfig, "dataset type question_field answer_field id2info_path"),
         params(Generation, "output_path num_samples"), params(FilterConfig, "keep"),
         params(Generation, "max_gen_tokens temperature top_p"),
         params(FilterConfig, "seed apply_chat_template max_prompt_len tp num_engines"))
def filter_(**given: Any) -> None:
    """Sample every training prompt, record its pass rate, and keep the prompts within a range."""
    from areal_kit.eval.filter import run

    model_path = list(given["model_path"])  # repeatable for eval, which compares several
    if len(model_path) > 1:
        raise UserError(f"filter takes one --model_path, got {len(model_path)}; expected the checkpoint whose "
                        "pass rates decide")
    cfg = build(FilterConfig, given, model_path=model_path[0])
    with stops_say_so():  # the records graded so far are on disk: a re-run resumes after them
        run(cfg, make_console())


def _read_pairs(path: Path) -> list[dict]:
    if not path.exists():
        raise UserError(f"{path} not found; expected a jsonl file of {{\"pred\": ..., \"ref\": ...}} rows")
    from areal_kit.data.jsonl import iter_objects

    rows = []
    for lineno, row in iter_objects(path):
        if "pred" not in row or "ref" not in row:
            raise UserError(f"{path}:{lineno}: expected an object with \"pred\" and \"ref\" "
                            "(and optionally \"expected\": true/false)")
        if "expected" in row and not isinstance(row["expected"], bool):
            raise UserError(f"{path}:{lineno}: \"expected\" must be true or false")
        rows.append(row)
    return rows


def grade(
    pred: str | None = typer.Argument(None, help="Predicted answer, or a whole completion "
                                                    "(its last \\boxed{} is taken)."),
    ref: str | None = typer.Argument(None, help="Reference answer."),
    file: Path | None = typer.Option(None, "--file",
                                        help="jsonl of {pred, ref[, expected]} rows: one JSON "
                                             "verdict line each and an 'N passed, M failed' summary."),
    timeout: float = typer.Option(5.0, "--timeout", help="Seconds math-verify may spend on one answer."),
) -> int:
    """Check whether a predicted answer matches a reference, and show how each was parsed."""
    from areal_kit.reward import extract_answer, parsed_form
    from areal_kit.reward import grade as grade_answer

    console = make_console(highlight=False)

    def one(p: str, r: str) -> dict:
        # A completion is reduced to its last \boxed{}; a bare answer is graded as given
        # (the prose fallbacks of extract_answer would turn "\frac{1}{2}" into "2").
        p_ans = extract_answer(str(p), strict=True) or str(p)
        verdict = grade_answer(p_ans, str(r), timeout)
        return {"pred": p, "ref": r, "extracted": p_ans, "correct": bool(verdict),
                "pred_parsed": parsed_form(p_ans),
                "ref_parsed": parsed_form(str(r))}

    if file is not None:
        if pred is not None or ref is not None:
            raise UserError("give either PRED REF or --file, not both")
        rows = _read_pairs(file)
        passed = failed = n_correct = 0
        for i, row in enumerate(rows):
            res = one(row["pred"], row["ref"])
            line = {"row": i, "pred": row["pred"], "ref": row["ref"], "correct": res["correct"]}
            n_correct += res["correct"]
            if "expected" in row:
                line["expected"] = row["expected"]
                line["ok"] = res["correct"] == row["expected"]
                passed += line["ok"]
                failed += not line["ok"]
            console.out(json.dumps(line, ensure_ascii=False))
        if passed + failed:
            console.out(f"{passed} passed, {failed} failed")
        else:
            console.out(f"{len(rows)} graded: {n_correct} correct, {len(rows) - n_correct} wrong")
        return ExitCode.FAILED if failed else ExitCode.OK
    if pred is None or ref is None:
        raise UserError("grade needs PRED and REF (e.g. areal-kit grade '\\frac12' 0.5), or --file pairs.jsonl")
    res = one(pred, ref)
    console.out(f"verdict:   {'CORRECT' if res['correct'] else 'WRONG'}")
    console.out(f"pred:      {res['pred']!r} -> extracted {res['extracted']!r} -> parsed {res['pred_parsed']}")
    console.out(f"ref:       {res['ref']!r} -> parsed {res['ref_parsed']}")
    return ExitCode.OK

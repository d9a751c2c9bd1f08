"""The verdict on one answer, the same for `areal-kit eval`, `areal-kit filter` and the in-training
eval: the completion's final answer (reward/math_grader.extract_answer) graded by math-verify
against each of the row's references, correct when any matches.

A row's references are its `solutions` (AReaL's id2info format: whole solutions, whose last
\\boxed{} is the answer), else its `answer` (a gsm8k "#### N" line, or the answer itself).

    from areal_kit.reward.grading import grade_completion, grade_row
    grade_completion("so \\\\boxed{1/2}", ["0.5"])      # ("1/2", True)
    grade_row("... #### 18", {"answer": "#### 18"})   # True
"""

from __future__ import annotations

from areal_kit.reward.math_grader import extract_answer, grade, gsm8k_reference
from areal_kit.reward.registry import as_reference


def grade_completion(text: str, references: list[str], timeout_s: float = 5.0) -> tuple[str | None, bool]:
    """(extracted answer, correct)."""
    pred = extract_answer(text)
    return pred, bool(pred is not None and any(grade(pred, r, timeout_s) for r in references))


def references(row: dict) -> list[str]:
    """Final answers to grade against: each solution's last \\boxed{}, a gsm8k "#### N", or the answer."""
    refs = row.get("solutions")
    if refs is None:
        refs = [row.get("answer")]
    elif isinstance(refs, str):
        refs = [refs]
    out = []
    for r in refs:
        if r is None:
            continue
        r = gsm8k_reference(str(r)) if "####" in str(r) else as_reference(r)
        if r:
            out.append(r)
    return out


def grade_row(text: str, row: dict) -> bool:
    """Whether the completion answers the dataset row."""
    return grade_completion(text, references(row))[1]

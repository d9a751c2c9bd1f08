"""Math answer grading: extract a model's final answer and check it against a reference.

The grader used by training rewards, `areal-kit eval` and `areal-kit grade`, so that a score
means the same thing everywhere. Grading is math-verify (parse + verify) on the extracted
final answer, with three guarantees:

* it never hangs: each answer has a time budget (`timeout_s`); past it the verdict is False;
* it never raises: any error inside the parser or sympy is a False verdict;
* it works from any thread: math-verify's own timeout uses SIGALRM, which only works in
  the main thread, so calls from other threads (Ray actor threads, thread pools) are sent
  to a few worker processes that run math-verify in their own main thread (reward/pool.py).

Plain integers and decimals (most gsm8k, aime and amc answers) take a fast path that gives
the same verdict as math-verify in microseconds: the RL loop grades hundreds of samples a
step.

    python -m areal_kit.reward.math_grader PRED REF      # prints the verdict
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
import threading
from contextlib import AbstractContextManager
from decimal import Decimal, InvalidOperation
from functools import cache, lru_cache
from types import ModuleType
from typing import Any

from areal_kit.reward.alarm import alarm
from areal_kit.reward.pool import Pool

__all__ = ["extract_answer", "grade", "gsm8k_reference", "normalize", "parsed_form"]

# ---------------------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_SPACE_RE = re.compile(r"\\boxed +([^\s${}]+)")  # "\boxed 5" (no braces) as some models write
# "the final answer is X", "The answer is: X", "Answer: X" (the last one wins)
_ANSWER_IS_RE = re.compile(
    r"(?:final answer is|answer is|answer:)\s*:?\s*(.+?)(?:\n|$)", re.IGNORECASE
)
_GSM_RE = re.compile(r"####\s*([^\n]+)")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, braces balanced; None if none closes."""
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
        # unbalanced (a truncated answer): try the previous box
    m = None
    for m in _BOX_SPACE_RE.finditer(text):
        pass
    return m.group(1) if m else None


def _tidy(ans: str) -> str:
    """Strip what surrounds an answer in prose: spaces, $...$, a trailing period."""
    ans = ans.strip()
    for _ in range(2):
        ans = ans.strip().rstrip(".").strip()
        if len(ans) >= 2 and ans[0] == "$" and ans[-1] == "$":
            ans = ans.strip("$")
        ans = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", ans).strip()
    return ans


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The final answer in a model's output, or None.

    Order (the first that finds something wins; each takes the LAST occurrence, because
    models restate and correct themselves and the final statement is the answer):
      1. \\boxed{...} / \\fbox{...} with balanced braces (what every prompt_type asks for);
      2. a gsm8k-style "#### N" line (models trained on gsm8k references write it);
      3. "final answer is X" / "answer is X" / "Answer: X" up to the end of that line
         (Qwen2.5-Math's evaluation parser takes this fallback too);
      4. the last number in the text (also Qwen2.5-Math's last resort for unboxed output).
    strict=True stops after step 1 (for references whose answer is always boxed).
    """
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return _tidy(boxed)
    if strict:
        return None
    found = _GSM_RE.findall(text)
    if found:
        return _tidy(found[-1])
    found = _ANSWER_IS_RE.findall(text)
    if found and _tidy(found[-1]):
        return _tidy(found[-1])
    found = _NUMBER_RE.findall(text)
    if found:
        return found[-1].rstrip(",")
    return None


def gsm8k_reference(answer_field: str) -> str:
    """The number on a gsm8k answer's "#### N" line, thousands separators removed."""
    m = _GSM_RE.findall(str(answer_field))
    ans = m[-1] if m else str(answer_field)
    return ans.strip().replace(",", "").replace("$", "").rstrip(".")


# ---------------------------------------------------------------------------- grading

_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:(?:,|\{,\})\d{3})+(?:\.\d+)?")


def normalize(ans: str) -> str:
    """Cheap normalization applied before both the fast path and math-verify.

    "2,125" and "2{,}125" are the number 2125 (gsm8k references write thousands this way);
    without this math-verify reads them as the pair (2, 125).
    """
    ans = _tidy(str(ans))
    if _THOUSANDS.fullmatch(ans):
        ans = ans.replace("{,}", "").replace(",", "")
    return ans


def _fast_verdict(pred: str, ref: str) -> bool | None:
    """Verdict for two plain numbers, or None to let math-verify decide.

    Equal values are equal for math-verify too. Two integers that differ are different.
    Decimals that differ are left to math-verify, which rounds (float_rounding=6) and may
    call close values equal: the fast path never guesses.
    """
    if not (_PLAIN_NUMBER.fullmatch(pred) and _PLAIN_NUMBER.fullmatch(ref)):
        return None
    try:
        a, b = Decimal(pred), Decimal(ref)
    except InvalidOperation:
        return None
    if a == b:
        return True
    if "." not in pred and "." not in ref:
        return False
    # clearly different decimals (beyond any rounding math-verify applies)
    if abs(a - b) > Decimal("1e-3") * max(Decimal(1), abs(a), abs(b)):
        return False
    return None


class _Timeout(BaseException):
    """Raised by the alarm inside math-verify/sympy. A BaseException so that the parser's
    own `except Exception` blocks cannot swallow it and keep computing."""


def _alarm(seconds: float) -> AbstractContextManager[None]:
    """_Timeout after `seconds` (main thread only; see reward/alarm.py)."""
    return alarm(seconds, _Timeout)


@cache
def load() -> ModuleType:
    """math-verify, imported on first use. With sympy under it, it took half a second of every
    process that imported this module: the driver and each engine at start-up, though neither
    grades (a grade made off the main thread runs in the pool's processes). Called before any
    alarm: an import cut short by one would leave the module half made."""
    import math_verify

    # math-verify warns once that its timeouts are off: ours (_alarm) replaces them.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _mv_parse(text: str) -> list[Any]:  # math-verify's parses: sympy expressions and strings
    mv = load()
    # Wrap the bare answer in \boxed{} so the LaTeX extractor takes all of it (unwrapped
    # LaTeX without $...$ is not found); the Expr extractor covers plain "1/2", "3*x".
    # Our own alarm bounds the time, so math-verify's signal timeouts are switched off.
    return mv.parse(
        "\\boxed{" + text + "}",
        extraction_config=[mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()],
        parsing_timeout=None,
    )


def verify_in_main_thread(pred: str, ref: str, timeout_s: float) -> bool:
    mv = load()
    try:
        with _alarm(timeout_s):
            gold, target = _mv_parse(ref), _mv_parse(pred)
            if not gold or not target:
                return False
            return bool(mv.verify(gold, target, timeout_seconds=None))
    except _Timeout:
        return False
    except Exception:  # noqa: BLE001 - any parser/sympy failure is a wrong answer
        return False


@lru_cache(maxsize=65536)
def _grade_cached(pred: str, ref: str, timeout_s: float) -> bool:
    fast = _fast_verdict(pred, ref)
    if fast is not None:
        return fast
    if threading.current_thread() is threading.main_thread():
        return verify_in_main_thread(pred, ref, timeout_s)
    return verify_in_worker(pred, ref, timeout_s)


workers = Pool(size=2)  # its processes start at the first call from another thread


def verify_in_worker(pred: str, ref: str, timeout_s: float) -> bool:
    """verify_in_main_thread in a worker process; False on timeout or any failure."""
    status, verdict = workers.call("areal_kit.reward.math_grader:verify_in_main_thread", (pred, ref, timeout_s), timeout_s)
    return status == "ok" and bool(verdict)


atexit.register(workers.close)


def grade(pred: str, ref: str, timeout_s: float = 5.0) -> bool:
    """True when the extracted answer `pred` equals the reference answer `ref`.

    Both are final answers (use extract_answer / gsm8k_reference first). Never raises, never
    takes much longer than timeout_s; empty or unparsable input is False.
    """
    try:
        if pred is None or ref is None:
            return False
        p, r = normalize(pred), normalize(ref)
        if not p or not r:
            return False
        return _grade_cached(p, r, float(timeout_s))
    except Exception:  # noqa: BLE001
        return False


def parsed_form(answer: str, timeout_s: float = 5.0) -> list[str]:
    """How math-verify reads an answer (what `areal-kit grade` shows); [] if unparsable."""
    text = normalize(answer)
    if not text:
        return []
    load()
    try:
        if threading.current_thread() is threading.main_thread():
            with _alarm(timeout_s):
                return [str(x) for x in _mv_parse(text)]
        return [str(x) for x in _mv_parse(text)]
    except (_Timeout, Exception):  # noqa: BLE001
        return []


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m areal_kit.reward.math_grader PRED REF")
    print(grade(sys.argv[1], sys.argv[2]))

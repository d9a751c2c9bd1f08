"""The `tiny` preset's task: "a + b =" -> the sum (0 to 18, each equally often), digit by digit, then eos.

The toy vocabulary has a word per digit, so the answer is written the way its tokenizer spells
numbers, a digit a word: "7" for 3 + 4, "1 7" for 8 + 9. A one-digit sum is one token and a
two-digit sum two, so the policy must learn the length as well as the digits, stop with eos, and
give the second token credit apart from the first. Graded on the decoded text: exactly the sum's
digits and nothing else, ended by eos; a truncated answer (no eos) earns nothing.

    rows = toy_rows(3200, seed=1)    # [{"id": "toy-0", "question": "3 + 4 =", "answer": "7"}, ...]
"""

from __future__ import annotations

import random
import re

MAX_SUM = 18


def spell(n: int) -> str:
    """A number as the toy tokenizer writes it: its digits, a space apart ("1 7")."""
    return " ".join(str(n))


def toy_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        # The sum first, uniformly: with a and b uniform, 9 and 10 would be the answer five times as
        # often as 0 or 18, and a policy that says "9" to everything would be rewarded for it.
        total = rng.randrange(MAX_SUM + 1)
        a = rng.randint(max(0, total - 9), min(9, total))
        b = total - a
        rows.append({"id": f"toy-{i}", "question": f"{a} + {b} =", "answer": spell(a + b)})
    return rows


def toy_reward(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the answer, ended by eos, is exactly the sum's digits."""
    if sample.get("no_eos"):
        return 0.0
    return 1.0 if completion.split() == str(sample["answer"]).split() else 0.0


# The calculator task: two-digit sums, which a tiny model cannot learn to add in a run's time, and
# a calculator tool it can call. The tool kind's tokenizer (data/tiny_model.py) writes a call and
# the tool's reply as words of their own.
CALC_RANGE = (10, 99)
# A call and the tool's reply are written between these tags, as Hermes-style chat templates do.
CALL, END_CALL, REPLY, END_REPLY = "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"


def calc_question(a: int, b: int) -> str:
    return f"{spell(a)} + {spell(b)} ="


def tool_call(expression: str) -> str:
    return f"{CALL} {expression} {END_CALL}"


def tool_response(text: str) -> str:
    return f"{REPLY} {text} {END_REPLY}"


def calc_rows(n: int, seed: int = 0) -> list[dict]:
    """The calculator task's rows: "4 7 + 3 8 =" -> "8 5", both operands two digits."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(*CALC_RANGE), rng.randint(*CALC_RANGE)
        rows.append({"id": f"calc-{i}", "question": calc_question(a, b), "answer": spell(a + b)})
    return rows


def calculate(expression: str) -> str:
    """The calculator: "4 7 + 3 8" (or "47+38", as a byte-level tokenizer reads the call back) ->
    "8 5", a number as the toy tokenizer spells it; "?" for anything but two numbers and + or -."""
    m = re.fullmatch(r"(\d+)([+-])(\d+)", "".join(expression.split()))
    if not m:
        return "?"
    a, b = int(m[1]), int(m[3])
    return spell(a + b if m[2] == "+" else a - b)


def calc_reward(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the model's last turn, ended by eos, is exactly the sum's digits: a tool's reply
    earns nothing until the model writes it as its answer."""
    turns = [t["text"] for t in sample.get("turns") or () if t["role"] == "model"]
    return toy_reward(prompt, turns[-1] if turns else completion, sample)

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

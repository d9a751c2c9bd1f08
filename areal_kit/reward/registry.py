"""Reward functions by name: what `ppo.reward_fns: [math, gsm8k]` in a config refers to.

A reward function takes (prompt, completion, sample) and returns a float; `sample` is the
dataset row (its reference answer and anything else a reward needs). Built-ins:

  math   correct (1.0) when the completion's final answer matches sample["answer"], or any
         of the list sample["solutions"] (AReaL's id2info format); references that are whole
         solutions have their last \\boxed{} taken as the answer.
  gsm8k  correct when the final answer matches sample["answer"], which holds either the
         gsm8k reference text (its "#### N" line is used) or the number itself.

    from areal_kit.reward.registry import get_reward, register
    score = get_reward("math")(prompt, completion, {"answer": "42"})
"""

from __future__ import annotations

from areal_kit.api import RewardFn
from areal_kit.errors import UserError
from areal_kit.reward.math_grader import extract_answer, grade, gsm8k_reference

_REGISTRY: dict[str, RewardFn] = {}


def register(name: str, fn: RewardFn) -> RewardFn:
    """Register fn under name (replacing an earlier one of that name); returns fn."""
    if not name or not callable(fn):
        raise UserError(f"reward {name!r}: expected a non-empty name and a callable")
    _REGISTRY[name] = fn
    return fn


def get_reward(name: str) -> RewardFn:
    """The reward function registered as name; a UserError listing the known names if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(
            f"unknown reward {name!r}; known rewards: {', '.join(sorted(_REGISTRY))}"
        ) from None


def known_rewards() -> list[str]:
    return sorted(_REGISTRY)


def as_reference(ref: object) -> str | None:
    """A reference answer from a bare answer or a whole solution text (last \\boxed{})."""
    if ref is None:
        return None
    text = str(ref)
    if "\\boxed" in text or "\\fbox" in text:
        return extract_answer(text, strict=True)
    return text


def math_reward(prompt: str, completion: str, sample: dict) -> float:
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    refs = sample.get("solutions")
    if refs is None:
        refs = [sample.get("answer")]
    elif isinstance(refs, str):
        refs = [refs]
    for ref in refs:
        ref = as_reference(ref)
        if ref is not None and grade(pred, ref):
            return 1.0
    return 0.0


def gsm8k_reward(prompt: str, completion: str, sample: dict) -> float:
    pred = extract_answer(completion)
    ref = sample.get("answer")
    if pred is None or ref is None:
        return 0.0
    return 1.0 if grade(pred, gsm8k_reference(str(ref))) else 0.0


register("math", math_reward)
register("gsm8k", gsm8k_reward)

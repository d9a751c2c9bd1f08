"""Scoring samples with the configured rewards, so that a bad reward cannot hang or crash a run.

`RewardScorer(ppo).score(items)` sums every reward of ppo.reward_fns for each
(prompt, completion, sample). Built-in rewards (math, gsm8k, toy: bounded time, never raise)
run in this process. Plug-ins run in the worker pool of reward/pool.py (ppo.reward_workers
processes), with a per-call budget (ppo.reward_timeout_s). A call that raises, overruns, kills
its worker or returns something that is not a number gives that reward 0 for the sample, and is
counted by kind ("mine: ValueError", "mine: timeout") in `failures`; the caller logs each kind
once.

A reward returns a float, or a dict with "reward" and other numbers (averaged and logged as
reward/<key>).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from areal_kit.reward import plugins
from areal_kit.reward.pool import Pool

if TYPE_CHECKING:
    from areal_kit.config.schema import PPOConfig

CALL = "areal_kit.reward.plugins:call_reward"  # what a pool worker runs for one sample


def as_reward(value: object) -> tuple[float, dict]:
    """(reward, extra numbers) from what a reward returned; ValueError when it is neither."""
    extras = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without 'reward' (keys: {', '.join(map(str, value))[:80]})")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {type(value).__name__} {str(value)[:40]!r}, expected a finite number")
    return float(value), extras


class RewardScorer:
    def __init__(self, ppo: PPOConfig) -> None:
        self.specs = plugins.reward_specs(ppo)
        self.fns = {spec: plugins.load_reward(spec) for _, spec in self.specs}
        self.trusted = {spec for _, spec in self.specs if plugins.is_trusted(spec)}
        self.untrusted = [spec for _, spec in self.specs if spec not in self.trusted]
        self.timeout_s = float(ppo.reward_timeout_s)
        self.pool = Pool(int(ppo.reward_workers))
        self.failures: Counter = Counter()  # kind -> count since the last take_failures()
        self.first_error: dict[str, str] = {}  # kind -> the first message of that kind

    # ------------------------------------------------------------ failures
    def _fail(self, name: str, kind: str, message: str) -> None:
        key = f"{name}: {kind}"
        self.failures[key] += 1
        self.first_error.setdefault(key, f"{key}: {message}"[:300])

    def take_failures(self) -> dict[str, tuple[int, str]]:
        """{kind: (count, first message)} since the last call."""
        out = {k: (n, self.first_error[k]) for k, n in self.failures.items()}
        self.failures.clear()
        return out

    # ------------------------------------------------------------ scoring
    def score(self, items: list[tuple[str, str, dict]]) -> list[tuple[float, dict]]:
        """(summed reward, extra numbers) for each (prompt, completion, sample)."""
        names = {spec: name for name, spec in self.specs}
        totals = [0.0] * len(items)
        extras: list[dict] = [{} for _ in items]

        def add(i: int, spec: str, value: object) -> None:
            try:
                r, ex = as_reward(value)
            except ValueError as e:
                self._fail(names[spec], "bad return", str(e))
                return
            totals[i] += r
            extras[i].update(ex)

        for spec in self.trusted:
            for i, (p, c, s) in enumerate(items):
                try:
                    value = self.fns[spec](p, c, s)
                except Exception as e:  # noqa: BLE001 - counted, never fatal
                    self._fail(names[spec], type(e).__name__, str(e))
                    continue
                add(i, spec, value)
        for spec in self.untrusted:
            calls = [(spec, p, c, s) for p, c, s in items]
            for i, (status, got) in enumerate(self.pool.map(CALL, calls, self.timeout_s)):
                if status == "ok":
                    add(i, spec, got)
                else:
                    self._fail(names[spec], status, str(got))
        return list(zip(totals, extras))

    def close(self) -> None:
        self.pool.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing left to clean
            pass

"""The GPU acceptance suite's plain parts (no GPU, no Ray): which layouts a node of N GPUs runs,
each layout's settings beside the tiny preset, the one table of what was checked with timings
(printed at the end of `pytest tests/gpu`, for a bug report), and the eval figure recomputed
from its records. tests/unit/test_gpu_acceptance_helpers.py tests them on CPU.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from areal_kit.config.alloc import parse_allocation


@dataclass(frozen=True)
class Case:
    """One layout of the suite: its name, the GPUs it needs, its allocation and ZeRO stage."""

    name: str
    gpus: int
    allocation: str
    zero: int
    model: str = "small"  # "small": the BPE Qwen2 built by the test; "tiny": the tiny preset's own model
    shared: bool = False  # generation and training take turns on the same GPUs (vLLM sleep mode)
    engines: int = 1
    tp: int = 1
    stream: bool = False  # rollout.mode=stream, with answers long enough for an update to interrupt

    @property
    def used(self) -> int:
        """The GPUs its allocation takes (a node may have more: Ray places it on what is free)."""
        return parse_allocation(self.allocation).total_gpus

    def overrides(self, model_path: str, steps: int) -> list[str]:
        """Its settings beside the tiny preset (fileroot and tensorboard=false come on top)."""
        out = ["experiment_name=gpu_accept", f"trial_name={self.name}", f"actor.path={model_path}",
               "actor.dtype=auto", f"actor.zero_stage={self.zero}", f"n_gpus_per_node={self.used}",
               f"allocation_mode={self.allocation}", f"exp_ctrl.total_train_steps={steps}"]
        if self.model == "small":
            out.append("actor.lr=1e-2")  # two steps move every weight by about its size: a stale engine shows
        # Turns cannot overlap generation with training; the apart layouts test the async path.
        out.append(f"ppo.max_head_offpolicyness={0 if self.shared else 1}")
        if self.stream:
            out += ["rollout.mode=stream", f"ppo.gen.max_new_tokens={STREAM_TOKENS}"]
        return out


# One GPU: the tiny preset itself and the small model, each with generation and training taking
# turns on the GPU. 2+ GPUs: streaming engines, a weight update interrupting their generations. 3+ GPUs: the two ranks and an engine apart (ZeRO-2, ZeRO-3). 8 GPUs adds two
# engines (rank arithmetic of the sync group), an engine of tensor parallel 2, and the guide's
# shared layout over 4 GPUs (engines of TP 2 over trainer ranks).
STREAM_TOKENS = 32  # the interrupted answers' length (the engines leave room for it)
CASES = [
    Case("tiny_1gpu", 1, "d1p1m1", 0, model="tiny", shared=True),
    Case("stream_zero2", 2, "vllm.d1p1m1+d1p1m1", 2, stream=True),
    Case("shared_1gpu_zero2", 1, "d1p1m1", 2, shared=True),
    Case("zero2", 3, "vllm.d1p1m1+d2p1m1", 2),
    Case("zero3", 3, "vllm.d1p1m1+d2p1m1", 3),
    Case("two_engines_zero2", 8, "vllm.d2p1m1+d2p1m1", 2, engines=2),
    Case("tp2_zero3", 8, "vllm.d1p1m2+d2p1m1", 3, tp=2),
    Case("shared_tp2_zero2", 8, "actor_gen:d2p1m2,*:d4p1m1", 2, shared=True, engines=2, tp=2),
]


def cases_for(n_gpus: int) -> list[Case]:
    """The layouts a node of n_gpus runs."""
    return [c for c in CASES if c.gpus <= n_gpus]


@dataclass
class Row:
    case: str
    check: str
    seconds: float
    outcome: str  # ok | FAILED | skipped
    detail: str = ""


@dataclass
class Table:
    """What the suite checked, a row a check, in the order run."""

    rows: list[Row] = field(default_factory=list)
    header: str = ""

    @contextmanager
    def check(self, case: str, what: str):
        """Time the block; its row says ok, or FAILED with the first line of the error (re-raised).
        The block may set `detail` on the yielded dict."""
        info: dict = {"detail": ""}
        t0 = time.perf_counter()
        try:
            yield info
        except BaseException as e:
            skipped = type(e).__name__ == "Skipped"
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
            self.rows.append(Row(case, what, time.perf_counter() - t0, "skipped" if skipped else "FAILED", first))
            raise
        self.rows.append(Row(case, what, time.perf_counter() - t0, "ok", str(info["detail"])))

    def render(self) -> str:
        """A markdown table, whole lines, to paste into an issue."""
        lines = [self.header] if self.header else []
        lines += ["| case | check | seconds | outcome | detail |", "|---|---|---|---|---|"]
        lines += [f"| {r.case} | {r.check} | {r.seconds:.1f} | {r.outcome} | {r.detail.replace('|', '/')} |"
                  for r in self.rows]
        return "\n".join(lines)


TABLE = Table()


def greedy_acc_from(samples: Path) -> tuple[float, int]:
    """(greedy accuracy in percent, greedy records) from an eval's <dataset>/samples.jsonl, as
    aggregate.json must report it."""
    greedy = [r for r in map(json.loads, samples.read_text().splitlines()) if r.get("mode") == "greedy"]
    if not greedy:
        return 0.0, 0
    return 100.0 * sum(bool(r["correct"]) for r in greedy) / len(greedy), len(greedy)

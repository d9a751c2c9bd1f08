"""The GPU acceptance suite's plain parts (no GPU, no Ray): which layouts a node of N GPUs runs,
each layout's settings beside the tiny preset, the one table of what was checked with timings
(printed at the end of `pytest tests/gpu`, for a bug report), the eval figure recomputed from its
records, and the arithmetic the checks decide with: logprob gaps, a sync that must change them,
the memory an engine's sleep frees and its wake takes back, a trainer's reserved memory beside
the memory plan. tests/unit/test_gpu_acceptance_helpers.py tests them on CPU.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from areal_kit.config.alloc import parse_allocation
from areal_kit.rl import memory

# The GPU presets' sampling temperature (train_scripts/_gpu_base.yaml). Not 1: vLLM's processed
# logprobs divide the logits by it, as the trainer's do (rl/algo/functional.py), and prompt
# logprobs do not, so a check at 1.0 cannot tell the two modes apart.
TEMPERATURE = 0.6
# What torch's caching allocator reserves beyond what the memory plan counts tensor by tensor:
# blocks rounded to 512 B, segments of 2 MB (small blocks) and 20 MB (blocks under 10 MB).
ALLOCATOR_SLACK = 0.25 * memory.GB


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
        out.append(f"ppo.gen.temperature={TEMPERATURE}")
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


def logprob_gap(engine: list[list[float]], trainer: list[list[float]]) -> float:
    """The largest |engine - trainer| over the tokens of every answer (the answers in one order)."""
    if len(engine) != len(trainer) or not engine:
        raise ValueError(f"{len(engine)} engine answers against {len(trainer)} of the trainer")
    gaps = []
    for i, (e, t) in enumerate(zip(engine, trainer)):
        if len(e) != len(t):
            raise ValueError(f"answer {i}: the engine gave {len(e)} logprobs, the trainer {len(t)}")
        gaps += [abs(x - y) for x, y in zip(e, t)]
    return max(gaps)


def sync_failures(before: float, after: float, tolerance: float, factor: float = 10.0) -> list[str]:
    """What a weight sync failed to show: the engines' logprobs must miss the trainer's new weights
    by more than factor x tolerance before it (else the check could not see a sync that never
    happened) and agree within tolerance after it."""
    out = []
    if before <= factor * tolerance:
        out.append(f"before the sync the engines were already within {before:.3g} of the trainer's new weights "
                   f"(must be over {factor:g} x {tolerance:g}): the check cannot tell a sync from none")
    if after >= tolerance:
        out.append(f"after the sync the engines miss the trainer by {after:.3g} (tolerance {tolerance:g})")
    return out


def sleep_failures(free_awake: float, free_asleep: float, free_woken: float, total: float, utilization: float,
                   allowance: float = memory.SLEEP_RESIDUE) -> list[str]:
    """What one GPU's free memory (torch.cuda.mem_get_info) failed to show around an engine's sleep
    and wake: sleep must free at least the engine's share (total x gpu_memory_utilization) less
    what a sleeping engine keeps (allowance: the memory plan's SLEEP_RESIDUE), and wake_up must
    take at least as much back."""
    need = utilization * total - allowance
    share = (f"the engine's share {memory.gb(utilization * total)} ({utilization:g} x {memory.gb(total)}) - "
             f"{memory.gb(allowance)} kept asleep = {memory.gb(need)}")
    out = []
    if free_asleep - free_awake < need:
        out.append(f"sleep freed {memory.gb(free_asleep - free_awake)}, less than {share}")
    if free_asleep - free_woken < need:
        out.append(f"wake_up took back {memory.gb(free_asleep - free_woken)}, less than {share}")
    return out


def reserved_failures(peak: float, released: float, plan_total: float, plan_resident: float,
                      slack: float = ALLOCATOR_SLACK) -> list[str]:
    """What a trainer rank's reserved memory (torch.cuda.max_memory_reserved over its training,
    memory_reserved once it returned its cache) does beyond the memory plan's trainer GPU: the peak
    must stay within the plan's total (the training turn), what stays reserved within its resident
    states (the generation turn: GpuPlan.resident), each with slack for the allocator's rounding."""
    out = []
    if peak > plan_total + slack:
        out.append(f"the trainer reserved {memory.gb(peak)} at its peak, more than the plan's "
                   f"{memory.gb(plan_total)} + {memory.gb(slack)} slack")
    if released > plan_resident + slack:
        out.append(f"the trainer kept {memory.gb(released)} reserved after returning its cache, more than the "
                   f"plan's resident states {memory.gb(plan_resident)} + {memory.gb(slack)} slack")
    return out

"""The log lines users and tools grep: for each kind, its writer and its parser.

The two lines below are a contract (users grep "Epoch" and "task_reward"); keep them exact:

    Epoch 1/1 step 6/19 (global step 6) finishes. Average #tokens per batch is 111847. #End to end# execution time: *2299.448*s. Total time consumption: 13720.729s. Estimated remaining time: 29350.673s.
    RPC name actor_train returns {'ppo_approx_kl': ..., 'actor_loss': ..., 'task_reward': ..., ...}

The same numbers go to metrics.jsonl, one JSON object a step, for `areal-kit plot` and tools.

Each kind of line users or tools grep has its writer and its parser here (epoch_line / parse_epoch, ...):
the run writes with the one, `areal-kit logs` and setup's wait for a run read with the other. Where a
run's files are and what writes them (train.log, metrics.jsonl, tensorboard, wandb) is runlog.py.
"""

from __future__ import annotations

import ast
import math
import re
import time
from dataclasses import dataclass
from typing import Any

RPC_KEYS = ("ppo_approx_kl", "actor_loss", "actor_clip_ratio", "importance_weight", "task_reward",
            "kl_reward", "final_reward", "advantage", "avg_seq_len", "avg_prompt_len", "n_tokens",
            "n_valid_tokens", "n_seqs", "no_eos_ratio")


# ------------------------------------------------------------------ the lines users and tools grep
# A train.log line is the logger's time and level, then the message; a parser takes the line, with or without
# them, and gives None for another kind. _STAMP reads the same in re and grep -E (setup greps on the head).
TIME_FORMAT = "%Y%m%d-%H:%M:%S"
_WHEN = "[0-9]{8}-[0-9]{2}:[0-9]{2}:[0-9]{2}"
_STAMP = f"{_WHEN} [A-Z]+ "


def _line(body: str) -> re.Pattern:
    return re.compile(f"^(?:{_STAMP})?{body}$")


def line_time(line: str) -> float | None:
    """When the logger wrote this line (local time, to the second); None for a line without its stamp."""
    m = re.match(f"({_WHEN}) [A-Z]+ ", line)
    return time.mktime(time.strptime(m[1], TIME_FORMAT)) if m else None


def grep_pattern(*heads: str) -> str:
    """grep -E's (and re's) pattern of the lines whose message starts with one of heads (the *_HEAD below)."""
    return "|".join(f"^{_ere(h)}" if h == ERROR_HEAD else f"^({_STAMP})?{_ere(h)}" for h in heads)


def _ere(text: str) -> str:
    """text matched literally by grep -E and re (re.escape's backslash before a space upsets grep)."""
    return re.sub(r"([.\[\](){}*+?^$|\\])", r"\\\1", text)


@dataclass(frozen=True)
class RunStart:
    name: str  # experiment/trial
    total_steps: int
    steps_per_epoch: int
    n_prompts: int
    n_dropped: int  # prompts longer than max_prompt_len
    log_dir: str


RUN_HEAD = "Run "  # run_line's, parse_failed's and parse_stopped's messages start so
_RUN = _line(r"Run (\S+): (\d+) steps, (\d+) per epoch, (\d+) prompts(?: \((\d+) dropped: longer than "
             r"max_prompt_len\))?; logs in (.*)")


def run_line(name: str, total_steps: int, steps_per_epoch: int, n_prompts: int, n_dropped: int, log_dir: str) -> str:
    """The first line of every launch (a new launch's lines start over from it)."""
    return (f"Run {name}: {total_steps} steps, {steps_per_epoch} per epoch, {n_prompts} prompts"
            + (f" ({n_dropped} dropped: longer than max_prompt_len)" if n_dropped else "") + f"; logs in {log_dir}")


def parse_run(line: str) -> RunStart | None:
    return (m := _RUN.match(line)) and RunStart(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5] or 0), m[6])


@dataclass(frozen=True)
class Ready:
    seconds: float  # from the attempt's start to its workers up
    detail: str  # the trainer ranks, rollout engines and weight sync


READY_HEAD = "Workers ready in "
_READY = _line(r"Workers ready in (\d+\.\d)s: (.*)\.")


def ready_line(seconds: float, detail: str) -> str:
    """Trainers and engines up: generation is next."""
    return f"Workers ready in {seconds:.1f}s: {detail}."


def parse_ready(line: str) -> Ready | None:
    return (m := _READY.match(line)) and Ready(float(m[1]), m[2])


@dataclass(frozen=True)
class Epoch:
    epoch: int
    n_epochs: int
    step: int
    steps_per_epoch: int
    global_step: int
    avg_tokens: int
    e2e: float  # seconds, to the millisecond as written
    total: float
    eta: float | None  # None for the first two steps


EPOCH_HEAD = "Epoch "
_EPOCH = _line(r"Epoch (\d+)/(\d+) step (\d+)/(\d+) \(global step (\d+)\) finishes\. Average #tokens per batch is "
               r"(\d+)\. #End to end# execution time: \*([\d.]+)\*s\. Total time consumption: ([\d.]+)s\."
               r"(?: Estimated remaining time: ([\d.]+)s\.)?")


def epoch_line(epoch: int, n_epochs: int, step: int, steps_per_epoch: int, global_step: int,
               avg_tokens: float, e2e: float, total: float, eta: float | None) -> str:
    line = (f"Epoch {epoch}/{n_epochs} step {step}/{steps_per_epoch} (global step {global_step}) finishes. "
            f"Average #tokens per batch is {round(avg_tokens)}. "
            f"#End to end# execution time: *{e2e:.3f}*s. Total time consumption: {total:.3f}s.")
    if eta is not None:
        line += f" Estimated remaining time: {eta:.3f}s."
    return line


def parse_epoch(line: str) -> Epoch | None:
    if not (m := _EPOCH.match(line)):
        return None
    return Epoch(int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]),
                 float(m[7]), float(m[8]), None if m[9] is None else float(m[9]))


RPC_HEAD = "RPC name actor_train returns "
_RPC = _line(r"RPC name actor_train returns (\{.*\})")


def rpc_line(stats: dict) -> str:
    ordered = {k: stats[k] for k in RPC_KEYS if k in stats}
    ordered.update({k: v for k, v in stats.items() if k not in ordered})
    return f"RPC name actor_train returns {ordered}"


def parse_rpc(line: str) -> dict | None:
    """The step's statistics, in the line's order (nan and inf included)."""
    if not (m := _RPC.match(line)):
        return None
    try:
        node = ast.parse(m[1], mode="eval").body
        if not isinstance(node, ast.Dict) or None in node.keys:  # a dict's repr: a dict literal, no ** in it
            return None
        return {ast.literal_eval(k): _number(v) for k, v in zip(node.keys, node.values) if k is not None}
    except (SyntaxError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _number(node: ast.expr) -> Any:  # what the line holds: a number mostly, any literal
    """A literal, or nan / inf as repr writes them (literal_eval reads neither)."""
    inner = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else None
    name = getattr(node if inner is None else inner, "id", None)
    return (1 if inner is None else -1) * {"nan": math.nan, "inf": math.inf}[name] if name else ast.literal_eval(node)


@dataclass(frozen=True)
class Finished:
    steps: int
    task_reward: float  # the last step's (nan when it had none)


FINISHED_HEAD = "Training finished: "
_FINISHED = _line(r"Training finished: (\d+) steps, final task_reward (\S+)\.")


def finished_line(steps: int, task_reward: float) -> str:
    return f"Training finished: {steps} steps, final task_reward {task_reward:.4f}."


def parse_finished(line: str) -> Finished | None:
    return (m := _FINISHED.match(line)) and Finished(int(m[1]), float(m[2]))


_FAILED = _line("Run failed: (.*)")


def failed_line(error: str) -> str:
    """The run's end on an error (errors.describe's one line); its traceback follows in train.log."""
    return f"Run failed: {error}"


def parse_failed(line: str) -> str | None:
    return (m := _FAILED.match(line)) and m[1]


@dataclass(frozen=True)
class Stopped:
    signame: str  # Ctrl-C or SIGTERM
    global_step: int = 0  # with checkpoint: the step the run stopped after
    checkpoint: str = ""  # the recover checkpoint written as it stopped ("": none)


_STOPPED = _line(r"Run interrupted \(([^)]*)\)(?: after global step (\d+), with its recover checkpoint (.*))?; "
                 r"the same command resumes it from (?:there|the last recover checkpoint)\.")


def stopped_line(signame: str, global_step: int = 0, checkpoint: str = "") -> str:
    """A stop by a signal; the same command resumes the run."""
    if checkpoint:
        return (f"Run interrupted ({signame}) after global step {global_step}, with its recover checkpoint "
                f"{checkpoint}; the same command resumes it from there.")
    return f"Run interrupted ({signame}); the same command resumes it from the last recover checkpoint."


def parse_stopped(line: str) -> Stopped | None:
    return (m := _STOPPED.match(line)) and Stopped(m[1], int(m[2] or 0), m[3] or "")


AFTER_SIGTERM_HEAD = "After SIGTERM "
_AFTER_SIGTERM = _line(r"After SIGTERM the step did not finish \((.*)\); no recover checkpoint of it\.")


def after_sigterm_line(error: str) -> str:
    """The step a SIGTERM asked to finish failed instead (the stop goes on, without a relaunch)."""
    return f"After SIGTERM the step did not finish ({error}); no recover checkpoint of it."


def parse_after_sigterm(line: str) -> str | None:
    return (m := _AFTER_SIGTERM.match(line)) and m[1]


@dataclass(frozen=True)
class Relaunch:
    cause: str  # "[kind[ in global step N]: ]error"
    attempt: int
    retries: int


RELAUNCH_HEAD = "Worker failure ("
_RELAUNCH = _line(r"Worker failure \((.*)\); relaunching from the last recover checkpoint \(retry (\d+)/(\d+)\)\.")


def relaunch_line(cause: str, attempt: int, retries: int) -> str:
    return f"Worker failure ({cause}); relaunching from the last recover checkpoint (retry {attempt}/{retries})."


def parse_relaunch(line: str) -> Relaunch | None:
    return (m := _RELAUNCH.match(line)) and Relaunch(m[1], int(m[2]), int(m[3]))


@dataclass(frozen=True)
class Resume:
    path: str  # the recover checkpoint
    global_step: int  # the checkpoint's; the run goes on at the next
    epoch: int
    epoch_step: int
    written: str  # "%Y-%m-%d %H:%M:%S" or "at an unknown time"
    total_steps: int


RESUME_HEAD = "Will recover from: "
_RESUME = _line(r"Will recover from: (.*) \(global step (\d+), epoch (\d+) step (\d+), written (.*)\); resuming at "
                r"global step \d+ of (\d+)\.")


def resume_line(path: str, global_step: int, epoch: int, epoch_step: int, written: str, total_steps: int) -> str:
    return (f"Will recover from: {path} (global step {global_step}, epoch {epoch} step {epoch_step}, written "
            f"{written}); resuming at global step {global_step + 1} of {total_steps}.")


def parse_resume(line: str) -> Resume | None:
    return (m := _RESUME.match(line)) and Resume(m[1], int(m[2]), int(m[3]), int(m[4]), m[5], int(m[6]))


# The CLI's one error line (stderr; a driver started by setup writes it into the same log).
ERROR_HEAD = "error: "


def error_line(message: str) -> str:
    return f"{ERROR_HEAD}{message}"


def parse_error(line: str) -> str | None:
    return line[len(ERROR_HEAD):] if line.startswith(ERROR_HEAD) else None

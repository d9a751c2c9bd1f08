"""A run's folders and the files it writes: train.log (the lines of logs.py, with the console),
metrics.jsonl (one JSON object a step, for `areal-kit plot` and tools), the sample dumps,
tensorboard and, optionally, wandb; and the step timer behind the ETA.

    paths = run_paths("./areal_runs", "tiny", "run0")
    log = RunLogger(paths); log.info(logs.epoch_line(...)); log.step(1, {"task_reward": 0.1}); log.close()
"""

from __future__ import annotations

import getpass
import itertools
import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from areal_kit import durable
from areal_kit.logs import TIME_FORMAT

# samples.index: one record per dump, appended after its rows are: (global_step, byte offset of its
# first row in samples.jsonl, bytes of its rows, number of rows), little-endian int64s.
INDEX_RECORD = struct.Struct("<qqqq")


@dataclass(frozen=True)
class RunPaths:
    log_dir: str  # train.log, metrics.jsonl, tensorboard/
    recover_dir: str  # recover checkpoints
    ckpt_dir: str  # persistent HF saves: actor/epoch{e}epochstep{s}globalstep{g}/

    @property
    def log_file(self) -> str:
        return os.path.join(self.log_dir, "train.log")

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, "metrics.jsonl")

    @property
    def samples_file(self) -> str:
        """A few groups' prompts, answers, rewards and advantages, every exp_ctrl.dump_samples_every steps."""
        return os.path.join(self.log_dir, "samples.jsonl")

    @property
    def samples_index_file(self) -> str:
        """Where each step's rows of samples.jsonl lie (INDEX_RECORD), so a reader seeks to a step."""
        return os.path.join(self.log_dir, "samples.index")

    @property
    def timeline_file(self) -> str:
        """Each step's spans, wall-clock start and end, per process (RunLogger.timeline): `areal-kit view`'s lanes."""
        return os.path.join(self.log_dir, "timeline.jsonl")


def run_paths(fileroot: str, experiment: str, trial: str, user: str | None = None) -> RunPaths:
    user = user or os.environ.get("AREAL_USER") or getpass.getuser()
    tail = os.path.join(user, experiment, trial)
    return RunPaths(os.path.join(fileroot, "logs", tail), os.path.join(fileroot, "recover", tail),
                    os.path.join(fileroot, "checkpoints", tail))


class StepTimer:
    """End-to-end step times; the ETA averages steps after the first two (they include warm-up)."""

    def __init__(self, state: dict | None = None):
        s = state or {}
        self.times: list[float] = list(s.get("times", []))
        self.total: float = s.get("total", 0.0)

    def add(self, seconds: float) -> None:
        self.times.append(seconds)
        self.total += seconds

    def eta(self, remaining_steps: int) -> float | None:
        if len(self.times) < 3:
            return None
        steady = self.times[2:]
        return sum(steady) / len(steady) * remaining_steps

    def state_dict(self) -> dict:
        return {"times": self.times[-1000:], "total": self.total}


class RunLogger:
    """train.log + console lines, metrics.jsonl rows, tensorboard scalars, optional wandb."""

    def __init__(self, paths: RunPaths, tensorboard: bool = True, wandb_project: str = "",
                 run_name: str = "", console: bool = True):
        os.makedirs(paths.log_dir, exist_ok=True)
        self.paths = paths
        self.log = logging.getLogger(f"areal_kit.run.{id(self)}")
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", TIME_FORMAT)
        fh = logging.FileHandler(paths.log_file)
        fh.setFormatter(fmt)
        self.log.addHandler(fh)
        # Tracebacks go to train.log only: the terminal gets the CLI's one error line.
        self.file_log = logging.getLogger(f"{self.log.name}.file")
        self.file_log.propagate = False
        self.file_log.addHandler(fh)
        if console:
            ch = logging.StreamHandler(sys.stdout)
            ch.setFormatter(fmt)
            self.log.addHandler(ch)
        self.metrics = open(paths.metrics_file, "a", buffering=1)  # noqa: SIM115 (open for the run; close() shuts it)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(paths.log_dir, "tensorboard"))
            except ImportError:  # tensorboard is optional at run time
                self.tb = None
        self.wandb: Any = None  # the wandb Run, once started
        self.wandb_project, self.run_name = wandb_project, run_name

    def resume_at(self, global_step: int, wandb_id: str = "") -> str:
        """The run goes on after global_step (0: from the start): steps after it will be logged
        again, so their metrics.jsonl rows go (rewritten atomically) and tensorboard drops their
        events, leaving every step once however often the run resumed. wandb continues the run
        wandb_id (a recover checkpoint keeps it) or starts one; returns its id ("" without wandb)."""
        self.metrics.close()
        keep_steps_through(self.paths.metrics_file, global_step)
        if not cut_samples_after(self.paths.samples_file, self.paths.samples_index_file, global_step):
            keep_steps_through(self.paths.samples_file, global_step)
            if os.path.exists(self.paths.samples_index_file):  # its offsets were of the file before; `view` rebuilds it
                os.remove(self.paths.samples_index_file)
        keep_steps_through(self.paths.timeline_file, global_step)
        self.metrics = open(self.paths.metrics_file, "a", buffering=1)  # noqa: SIM115 (open for the run)
        if self.tb is not None:
            log_dir = self.tb.log_dir
            self.tb.close()
            self.tb = type(self.tb)(log_dir, purge_step=global_step + 1)
        if self.wandb_project and self.wandb is None:
            import wandb  # the key comes from WANDB_API_KEY; never logged

            # resume="allow": the same run goes on after a resume (wandb itself skips steps it
            # already has, so a step redone after a kill is not logged twice).
            self.wandb = wandb.init(project=self.wandb_project, name=self.run_name, dir=self.paths.log_dir,
                                    id=wandb_id or None, resume="allow")
        return self.wandb.id if self.wandb is not None else ""

    def info(self, msg: str) -> None:
        self.log.info(msg)

    def warning(self, msg: str) -> None:
        self.log.warning(msg)

    def failure(self, msg: str, exc: BaseException) -> None:
        """msg and the full traceback of exc, into train.log only."""
        self.file_log.error(msg, exc_info=exc)

    def step(self, global_step: int, row: dict) -> None:
        row = {"global_step": global_step, "time": time.time(), **row}
        self.metrics.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if self.tb is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(k, v, global_step)
        if self.wandb is not None:
            self.wandb.log(row, step=global_step)

    def samples(self, global_step: int, rows: list[dict]) -> None:
        """Rollout samples for people to read (`areal-kit logs RUN --samples`)."""
        data = "".join(json.dumps({"global_step": global_step, **r}) + "\n" for r in rows).encode()
        with open(self.paths.samples_file, "ab") as f:
            start = f.seek(0, os.SEEK_END)
            f.write(data)
        if rows:  # after the rows: an index record never points past what was written
            with open(self.paths.samples_index_file, "ab") as f:
                f.write(INDEX_RECORD.pack(global_step, start, len(data), len(rows)))

    def timeline(self, global_step: int, spans: list[tuple[str, str, float, float]]) -> None:
        """One line of timeline.jsonl: the step's spans as [lane, what, start, end] (wall-clock
        seconds, 3 decimals), e.g. ["engine 0", "generate", ...], ["trainer", "train step", ...]."""
        row = {"global_step": global_step, "spans": [[lane, what, round(a, 3), round(b, 3)] for lane, what, a, b in spans]}
        with open(self.paths.timeline_file, "a") as f:
            f.write(json.dumps(row) + "\n")

    def config(self, options: list[dict], origin: dict | None = None) -> None:
        """config.json in the log folder: every option of the run as `--show-args --json` lists it
        (key, value, default, help), and where the values came from (config/loader.py's origin: the
        preset, what it set, the overrides), for `areal-kit view`'s run page; rewritten at each start."""
        durable.write_json(os.path.join(self.paths.log_dir, "config.json"),
                           {"time": time.time(), "options": options, **({"origin": origin} if origin else {})})

    def close(self) -> None:
        self.metrics.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        for lg in (self.log, self.file_log):
            for h in list(lg.handlers):
                h.close()
                lg.removeHandler(h)


def token_fields(tokens: list[str], logprobs: list[float], loss_mask: list[int] | None,
                 versions: list[int] | None, trainer: dict[str, list[float | None]] | None = None) -> dict:
    """A dumped sample's per-token fields (samples.jsonl, `areal-kit view`'s token view): each output
    token's text, its sampling logprob (4 decimals), its loss mask (1 = trained on; absent: all 1),
    its weight version (absent: all the sample's `version`), and what the trainer computed for it
    (trainer: its fields by name, 4 decimals, null where a field has no value for a token)."""
    out: dict = {"tokens": tokens, "logprobs": [round(x, 4) for x in logprobs]}
    if loss_mask is not None:
        out["loss_mask"] = list(loss_mask)
    if versions is not None:
        out["versions"] = list(versions)
    for name, values in (trainer or {}).items():
        out[name] = [None if v is None else round(v, 4) for v in values]
    return out


def keep_steps_through(path: str, global_step: int) -> None:
    """metrics.jsonl without the rows after global_step (and without a torn last line)."""
    if not os.path.exists(path):
        return
    rows = [r for r in read_metrics(path) if r.get("global_step", 0) <= global_step]
    durable.replace_lines(path, [json.dumps(r) + "\n" for r in rows])


def cut_samples_after(samples_file: str, index_file: str, global_step: int) -> bool:
    """samples.jsonl without the dumps after global_step, cut where samples.index says the first of
    them starts (the file truncated there, the index rewritten without their records), so that a
    resume neither parses the whole file nor leaves `view` to scan it again. False (nothing done)
    where the index does not tell it exactly: missing, or not covering the file from its start to its
    end record after record (rows a crash left unindexed), or a record not at a row of its step."""
    try:
        size = os.path.getsize(samples_file)
        with open(index_file, "rb") as f:
            data = f.read()
    except OSError:
        return False
    recs: list[tuple[int, ...]] = []
    for i in range(0, len(data) - INDEX_RECORD.size + 1, INDEX_RECORD.size):
        rec = INDEX_RECORD.unpack_from(data, i)
        if not recs or rec != recs[-1]:  # a record written twice (by the run and by `view`'s scan) counts once
            recs.append(rec)
    pos = 0
    for _, offset, length, _ in recs:
        if offset != pos:
            return False
        pos += length
    if not recs or pos != size or any(a[0] > b[0] for a, b in itertools.pairwise(recs)):
        return False  # rows the index does not cover, or dumps out of step order
    later = [r for r in recs if r[0] > global_step]
    kept = [r for r in recs if r[0] <= global_step]
    with open(samples_file, "rb") as f:
        for step, offset, _, _ in recs[:1] + later[:1]:
            f.seek(offset)
            if not f.read(40).startswith(b'{"global_step": %d,' % step):
                return False
    if later:  # the index first: a crash before the cut leaves it short, never past the file
        durable.replace_bytes(index_file, b"".join(INDEX_RECORD.pack(*r) for r in kept))
        os.truncate(samples_file, later[0][1])
    return True


def tail_lines(path: str, nbytes: int) -> list[str] | None:
    """The lines of a log's or metrics file's last nbytes (the first may be partial); None if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl rows; a torn last line (a crash mid-write) is skipped."""
    rows: list[dict] = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows

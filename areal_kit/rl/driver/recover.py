"""Recover checkpoints: a crashed or killed run resumes where it stopped, or says why it cannot.

A checkpoint is a folder `{fileroot}/recover/{user}/{exp}/{trial}/globalstep{g}/` holding
    engine/deepspeed/  DeepSpeed checkpoint of every trainer rank (model, optimizer, LR scheduler)
    engine/rng_rank{r}.pt  python, numpy, torch RNG of that rank
    rng_driver.pt      the driver's RNG states
    state.json         step counters, data-loader position and ids used this epoch, sampling-seed
                       state, timer and last metrics, and the run's signature; written LAST
It is written as `.tmp-globalstep{g}/`, every file and folder fsynced, then renamed: a folder
without the dot prefix is complete by construction, so a crash mid-write (even SIGKILL) leaves
the previous checkpoint as the newest complete one. Older ones are deleted only after the rename.

When: after global step 2, then whenever exp_ctrl.ckpt_freq_steps / ckpt_freq_epochs /
ckpt_freq_secs is due, and after the final step (so a finished run can be extended).
recover_mode: auto (resume a matching checkpoint), resume (a checkpoint must exist), fault
(start over on first launch, resume only on relaunches after a failure), disabled.
A checkpoint that does not match the run (model, batch size, group size, ZeRO stage, seed,
dataset) stops the run with one line naming each difference, unless --fresh. The layout may
change (nodes, GPUs, allocation_mode): the trainers load the checkpoint in DeepSpeed's universal
format when their number changed.

Starting over never deletes a run's progress unless asked in so many words: --fresh (and
recover_mode=fault's first launch) sets the checkpoints aside (store.set_aside) and the newest
set-aside folder is kept; --fresh --discard deletes them. So every message that refuses to
resume may advise --fresh. A run that started and then failed to load or write a checkpoint is
RunFailed (exit 1, the "Run failed" line in train.log), never bad input: the run had started.

The Checkpointer (checkpointer.py) owns them: its load() resumes, before each launch attempt,
from what plan() decides here; it calls restore once the workers run, and write when a
checkpoint is due. Folder-level helpers are in store.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray.exceptions import RayTaskError

from areal_kit import logs
from areal_kit.config.alloc import parse_allocation
from areal_kit.durable import fsync_dir, fsync_tree, write_json
from areal_kit.errors import RunFailed, UserError, describe
from areal_kit.rl.checkpoint import rng
from areal_kit.rl.checkpoint.store import (
    FORMAT,
    PREFIX,
    SET_ASIDE_PREFIX,
    STATE_FILE,
    TMP_PREFIX,
    Checkpoint,
    file_sizes,
    last_metrics_row,
    latest,
    list_checkpoints,
    prune_set_asides,
    remove_tmp,
    set_asides,
    torn,
    torn_folders,
    torn_newer,
    tree_bytes,
)
from areal_kit.rl.driver.job import Job, RunState
from areal_kit.rl.hallway import RecoverLoad

if TYPE_CHECKING:
    from areal_kit.rl.driver.groups import TrainerGroup
    from areal_kit.runlog import RunLogger

DRIVER_RNG = "rng_driver.pt"

# ------------------------------------------------------------------ signature
# What must be equal for a checkpoint to continue this run, with the override that sets it
# (None: not a single setting). Learning rate, steps, save frequency may change on resume, and so
# may the layout (nodes, GPUs, allocation_mode: how many trainer ranks and engines): the batch
# and the math stay those of the checkpoint, and the trainers load it in DeepSpeed's universal
# format when their number changed. The ZeRO stage must stay (DeepSpeed's universal checkpoint
# does not turn ZeRO-3 shards into a ZeRO-2 model state).
SIGNATURE_KEYS = {
    "actor.path": "actor.path",
    "model": None,
    "dataset.train_bs_n_seqs": "dataset.train_bs_n_seqs",
    "ppo.group_size": "ppo.group_size",
    "actor.zero_stage": "actor.zero_stage",
    "seed": "seed",
    "dataset.type": "dataset.type",
    "dataset.path": "dataset.path",
    "dataset.shuffle": "dataset.shuffle",
    "dataset prompts": None,
    "dataset.mix": None,
    "actor.lora": None,
}


def model_fingerprint(model_path: str) -> str:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return "unknown"
    arch = ",".join(c.get("architectures") or [c.get("model_type", "?")])
    return (f"{arch} hidden {c.get('hidden_size')} layers {c.get('num_hidden_layers')} "
            f"vocab {c.get('vocab_size')}")


def signature(job: Job) -> dict:
    cfg = job.cfg
    return {
        "actor.path": cfg.actor.path, "model": model_fingerprint(job.model_path),
        "dataset.train_bs_n_seqs": cfg.dataset.train_bs_n_seqs, "ppo.group_size": cfg.ppo.group_size,
        "n_nodes": cfg.n_nodes, "n_gpus_per_node": cfg.n_gpus_per_node,
        "allocation_mode": cfg.allocation_mode, "actor.zero_stage": cfg.actor.zero_stage, "seed": cfg.seed,
        "dataset.type": cfg.dataset.type, "dataset.path": cfg.dataset.path,
        "dataset.shuffle": cfg.dataset.shuffle, "dataset prompts": len(job.loader.rows),
        # Absent without a mix, so checkpoints written before dataset.mix existed still match.
        **({"dataset.mix": ", ".join(f"{m['name']}={m['path']} x{m['weight']:g}" for m in cfg.dataset.mix)}
           if cfg.dataset.mix else {}),
        # Under LoRA the checkpoint holds the adapter alone: its shape must be this run's.
        **({"actor.lora": f"rank {cfg.actor.lora.rank}, alpha {cfg.actor.lora.alpha:g}, "
                          f"target_modules {cfg.actor.lora.target_modules}"} if cfg.actor.lora.rank else {}),
    }


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    return [(k, saved.get(k), current.get(k)) for k in SIGNATURE_KEYS if saved.get(k) != current.get(k)]


def start_over(path: str) -> str:
    """How to start over without losing the checkpoint at path: what every refusal to resume it says."""
    return (f"--fresh to start over (it sets this checkpoint aside in {os.path.dirname(path)}/"
            f"{SET_ASIDE_PREFIX}<time>/, deleting nothing)")


def mismatch_message(ck: Checkpoint, diffs: list[tuple[str, object, object]]) -> str:
    what = "; ".join(f"{k} was {old!r}, now {new!r}" for k, old, new in diffs)
    fixes = [f"{SIGNATURE_KEYS[k]}={_override_value(old)}" for k, old, _ in diffs if SIGNATURE_KEYS.get(k)]
    other = [k for k, _, _ in diffs if not SIGNATURE_KEYS.get(k)]
    how = f"the checkpoint is kept as it is; re-run with {start_over(ck.path)}"
    if fixes or other:
        same = " ".join(fixes) + (" and " if fixes and other else "") + \
            (f"the same {' and '.join(other)}" if other else "")
        how += f", or with {same} to resume it"
    return (f"the recover checkpoint {ck.path} (global step {ck.global_step}) does not match this run: "
            f"{what}. {how[0].upper()}{how[1:]}")


def _override_value(v: object) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


# ------------------------------------------------------------------ start: which state
@dataclass(frozen=True)
class Plan:
    """What a launch does with the recover folder (Checkpointer.load carries it out)."""

    resume: Checkpoint | None = None  # the checkpoint it continues; None: it starts at global step 1
    start_over: str = ""  # why it starts over from existing checkpoints (--fresh, recover_mode=fault); "": it does not
    discard: bool = False  # with start_over: delete them (--fresh --discard); else they are set aside
    torn: tuple[tuple[Checkpoint, str], ...] = ()  # newer checkpoints passed over as torn (moved aside), and why

    @property
    def batches(self) -> int:
        """Prompt batches the resumed steps took (0 for a start)."""
        return batches_taken(self.resume) if self.resume else 0


def batches_taken(ck: Checkpoint) -> int:
    """Prompt batches the checkpoint's steps took: more than its global step under dynamic sampling."""
    return ck.state.get("batches", ck.global_step)


def plan(job: Job, attempt: int, fresh: bool, log: RunLogger, discard: bool = False) -> Plan:
    """Which checkpoint this launch continues, as recover_mode, --fresh (--discard) and the attempt
    (0: the first launch, more: a relaunch after a worker failure) decide. It logs a decision to
    resume, raises UserError for a checkpoint that does not match the run, and changes nothing on
    disk: a start over is carried out (and said) by the Checkpointer."""
    rdir, mode = job.paths.recover_dir, job.cfg.recover_mode
    ck = latest(rdir)
    if mode == "disabled":
        if ck is not None and attempt == 0:
            log.info(f"recover_mode=disabled: not resuming the recover checkpoint {ck.path} "
                     f"(global step {ck.global_step}); starting at global step 1.")
        return Plan()
    if attempt == 0 and (fresh or mode == "fault"):
        if discard:  # set-aside folders go too, checkpoint or not: asked for in so many words
            return Plan(start_over="--fresh --discard", discard=True)
        if ck is None:
            return Plan()
        return Plan(start_over="--fresh" if fresh else "recover_mode=fault (resume only after a failure)")
    passed = tuple(torn_newer(rdir))
    if passed and ck is None:
        newest, why = passed[0]
        raise UserError(f"the recover checkpoint {newest.path} is torn ({why}) and no earlier whole one is kept; "
                        f"it is kept as it is: restore the file from a copy, or re-run with {start_over(newest.path)}")
    if ck is None:
        if mode == "resume" and attempt == 0:
            kept = set_asides(rdir)
            aside = (f" (one set aside by a start over is in {kept[-1]}: move its globalstep folder back into "
                     f"{rdir} to resume it)" if kept else "")
            raise UserError(f"recover_mode=resume but there is no recover checkpoint in {rdir}{aside}; expected a "
                            "run that reached global step 2, or use recover_mode=auto to start over")
        if attempt > 0:
            log.warning("No recover checkpoint yet (the first is written after global step 2); "
                        "relaunching from global step 1.")
        return Plan()
    _check(job, ck, attempt)
    return Plan(ck, torn=passed)


def _check(job: Job, ck: Checkpoint, attempt: int) -> None:
    """UserError unless the checkpoint continues this run: its format, signature and prompt order,
    and, on a first launch, steps left to train."""
    cfg = job.cfg
    if ck.state.get("format") != FORMAT:
        raise UserError(f"the recover checkpoint {ck.path} has format {ck.state.get('format')!r}, this version "
                        f"reads {FORMAT}; the checkpoint is kept as it is: resume it with the version that wrote it, "
                        f"or re-run with {start_over(ck.path)}")
    diffs = differences(ck.state["signature"], signature(job))
    expected = job.loader.state_at(batches_taken(ck))
    if not diffs and expected["used_ids"] != ck.state["loader"]["used_ids"]:
        diffs = [("dataset order", "the checkpoint's prompts", "different prompts at the same position")]
    if diffs:
        raise UserError(mismatch_message(ck, diffs))
    g = ck.global_step
    if g >= job.total_steps and attempt == 0:
        done = _final_save(job, g)
        if done:
            raise UserError(f"{cfg.experiment_name}/{cfg.trial_name} already finished its {job.total_steps} steps "
                            f"(recover checkpoint {ck.path}, model saved in {done}); raise "
                            f"exp_ctrl.total_train_steps or total_train_epochs to continue it, or use {start_over(ck.path)}")


def run_state(ck: Checkpoint) -> RunState:
    """The loop's state as the checkpoint recorded it."""
    s = ck.state
    return RunState(global_step=ck.global_step, version=s["version"], batches=batches_taken(ck), loader=s["loader"],
                    timer=s["timer"], last_save_time=0.0, last_ckpt_time=time.time(), recover_path=ck.path,
                    wandb_id=s.get("wandb_id", ""), pending=[list(p) for p in s.get("pending", [])])


def say_resuming(job: Job, ck: Checkpoint, attempt: int, log: RunLogger) -> None:
    """The resume's log line (users grep for it), and on a first launch a changed layout's."""
    g, loader = ck.global_step, ck.state["loader"]
    log.info(logs.resume_line(ck.path, g, loader["epoch"] + 1, loader["position"], _ago(ck.state.get("time")),
                              job.total_steps))
    if attempt == 0:
        _log_layout_change(ck, job, log)


def _final_save(job: Job, g: int) -> str | None:
    actor = os.path.join(job.paths.ckpt_dir, "actor")
    if os.path.isdir(actor):
        for name in os.listdir(actor):
            if name.endswith(f"{PREFIX}{g}") and os.path.exists(os.path.join(actor, name, "config.json")):
                return os.path.join(actor, name)
    return None


def write_driver_info(job: Job, attempt: int) -> None:
    """driver.json in the log folder: which process runs this run (`areal-kit logs` checks it)."""
    try:
        os.makedirs(job.paths.log_dir, exist_ok=True)
        tmp = os.path.join(job.paths.log_dir, ".driver.json.tmp")
        write_json(tmp, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                         "attempt": attempt, "total_steps": job.total_steps,
                         "recover_dir": job.paths.recover_dir, "ckpt_dir": job.paths.ckpt_dir})
        os.replace(tmp, os.path.join(job.paths.log_dir, "driver.json"))
    except OSError:
        pass  # informational only


def _ago(t: float | None) -> str:
    if not t:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# ------------------------------------------------------------------ start: workers
def restore(path: str, trainers: TrainerGroup) -> RecoverLoad:
    """Load the checkpoint into every trainer rank: the weight version it holds, how many ranks
    wrote it, whether it went through DeepSpeed's universal format, and the load time."""
    engine = os.path.join(path, "engine")
    try:
        return trainers.load_recover(engine)
    except RayTaskError as e:  # a rank's error (out of memory, a full disk, a torn file), wrapped by Ray
        # The run has started (Ray, its workers): a failure now is the run's, exit 1, never bad input.
        # Raised from e: the relaunch loop sees the cause, and retries an out-of-memory within its bound.
        raise RunFailed(f"loading the recover checkpoint {path} failed ({describe(e)}); the checkpoint is kept as "
                        f"it is: re-run the same command to try again, or with {start_over(path)}") from e


# ------------------------------------------------------------------ after a step
def write(job: Job, state: RunState, timer_state: dict, trainers: TrainerGroup, log: RunLogger) -> str:
    """Write the recover checkpoint of state.global_step atomically; returns its path."""
    g = state.global_step
    rdir = job.paths.recover_dir
    final = os.path.join(rdir, f"{PREFIX}{g}")
    if os.path.exists(os.path.join(final, STATE_FILE)):
        return final  # this step is already saved (nothing changed since)
    t0 = time.time()
    tmp = os.path.join(rdir, f"{TMP_PREFIX}{PREFIX}{g}")
    try:
        os.makedirs(rdir, exist_ok=True)
        remove_tmp(rdir)
        os.makedirs(tmp)
        # Every rank joins: DeepSpeed saves each rank's shard; each rank fsyncs what it wrote.
        trainers.save_recover(os.path.join(tmp, "engine"))
        rng.save(os.path.join(tmp, DRIVER_RNG))
        test_pause(job.paths.log_dir, "before_commit", g)
        # Each file's size as written: a file that later comes up short makes it torn (store.torn).
        write_json(os.path.join(tmp, STATE_FILE), {**_state_record(job, state, timer_state), "files": file_sizes(tmp)})
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_dir(rdir)
    except (OSError, RayTaskError) as e:  # here, or a rank's, wrapped by Ray
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest(rdir)
        kept = f"the previous one ({prev.path}) is intact" if prev else "there is no earlier one"
        # A run that trained and then could not save failed (exit 1, its "Run failed" line): not bad input.
        raise RunFailed(f"writing the recover checkpoint {final} failed ({describe(e)}{_free(rdir)}); {kept}. Free "
                        "space or fix permissions on fileroot, then re-run the same command to resume") from e
    # The newest whole one before this stays: a resume falls back to it should this one be torn on
    # disk later (a lost write, a copy cut short), retraining the steps since. Older ones go.
    cks = list_checkpoints(rdir)
    before = [ck for ck in cks if ck.path != final and ck.global_step < g and not torn(ck)][-1:]
    for old in cks:
        if old.path != final and old not in before:
            shutil.rmtree(old.path, ignore_errors=True)
    for path in torn_folders(rdir):  # passed over by a resume; the run has written past it now
        shutil.rmtree(path, ignore_errors=True)
    # The run has a checkpoint of its own now: set-aside folders older than the newest can go.
    gone = prune_set_asides(rdir, keep=1)
    if gone:
        log.info(f"Deleted {len(gone)} older set-aside folder(s) ({', '.join(os.path.basename(g) for g in gone)}): "
                 f"this run has a recover checkpoint of its own; the newest set-aside, {set_asides(rdir)[-1]}, is kept.")
    size = tree_bytes(final)
    log.info("Dumped recover info to file.")
    log.info(f"Recover checkpoint {final}: global step {g}, {size / 1e6:.1f} MB in {time.time() - t0:.2f}s.")
    return final


def _free(path: str) -> str:
    """`, N MB free on its filesystem`: torch's own error for a full disk seldom says so."""
    try:
        st = os.statvfs(path)
    except OSError:
        return ""
    return f", {st.f_bavail * st.f_frsize / 1e6:.1f} MB free on its filesystem"


def _log_layout_change(ck: Checkpoint, job: Job, log: RunLogger) -> None:
    """One line when the run resumes on another layout than the one that wrote the checkpoint."""
    was, now = ck.state["signature"].get("allocation_mode"), job.cfg.allocation_mode
    if was is None or was == now:
        return
    a, b = parse_allocation(was), parse_allocation(now)

    def plural(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    log.info(f"Resuming on {plural(b.train_gpus, 'trainer rank')} and {plural(b.gen.dp, 'rollout engine')} "
             f"({now}), written by {plural(a.train_gpus, 'trainer rank')} and {plural(a.gen.dp, 'rollout engine')} "
             f"({was}): the batch and the optimizer state carry over.")


def _state_record(job: Job, state: RunState, timer_state: dict) -> dict:
    cfg, g, b = job.cfg, state.global_step, state.batches
    # The loader may be ahead of training (max_head_offpolicyness > 0 queues batches): record the
    # position after the batches the trained steps took; the order is a pure function of (seed, epoch).
    return {
        "format": FORMAT, "time": time.time(), "global_step": g, "version": state.version, "batches": b,
        "pending": list(state.pending),
        "loader": job.loader.state_at(b), "timer": timer_state,
        # Sampling seeds are batch.sample_seed(seed, batch index, prompt index): the batch index is the state.
        "sampling": {"seed": cfg.seed, "next_step_index": b},
        "metrics": {"last_row": last_metrics_row(job.paths.metrics_file, g)},
        "total_steps": job.total_steps, "signature": signature(job),
        "experiment": f"{cfg.experiment_name}/{cfg.trial_name}",
        "wandb_id": state.wandb_id,
    }


# ------------------------------------------------------------------ test hook
_PAUSED: set = set()


def test_pause(log_dir: str, point: str, global_step: int) -> None:
    """AREAL_TEST_PAUSE=point:step holds the driver at that point of that global step (once per
    process) until the marker file PAUSED-point-step in the log folder is removed. Integration
    tests use it to kill a worker, or the driver mid-write, at an exact moment."""
    spec = os.environ.get("AREAL_TEST_PAUSE", "")
    if spec != f"{point}:{global_step}" or spec in _PAUSED:
        return
    _PAUSED.add(spec)
    marker = os.path.join(log_dir, f"PAUSED-{point}-{global_step}")
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.time() + 900
    while os.path.exists(marker) and time.time() < deadline:
        time.sleep(0.1)

"""Resume, and when the run saves what: Hugging Face folders and recover checkpoints, one due rule.

    ckpt = Checkpointer(job, log)
    state = ckpt.load(fresh, discard)    # before any worker starts: the run state to continue
    ckpt.connect(state, timer, trainers) # once the workers run
    ckpt.restore(weights)                # if state.resumed: trainer state from the checkpoint, weights to engines
    ckpt.after_step(epoch, epoch_step)   # each step: an HF save and/or a recover checkpoint, if due
    ckpt.dump()                          # a recover checkpoint now (a requested stop)
    ckpt.final_save()                    # the model at the end of the run

exp_ctrl.save_freq_{steps,epochs,secs} time the HF saves (not after the last step: final_save
writes that one); exp_ctrl.ckpt_freq_{steps,epochs,secs} the recover checkpoints, which are also
written after global step 2 (a crash early in a long run loses little) and after the last step
(a finished run can be extended).

Starting over (--fresh, recover_mode=fault's first launch) sets the checkpoints aside
(store.set_aside) rather than deleting them; only --fresh --discard deletes.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING

from areal_kit import runlog
from areal_kit.checkpoints import save_dir
from areal_kit.rl.checkpoint import hf, rng
from areal_kit.rl.checkpoint.store import (
    Checkpoint,
    latest,
    list_checkpoints,
    move_torn,
    remove_tmp,
    set_aside,
    set_asides,
)
from areal_kit.rl.driver import recover
from areal_kit.rl.driver.job import Job, RunState
from areal_kit.rl.driver.schedule import Every

if TYPE_CHECKING:  # the worker groups and the weight sync import Ray and torch
    from areal_kit.rl.driver.groups import TrainerGroup
    from areal_kit.rl.driver.weight_sync import WeightSync


class Checkpointer:
    def __init__(self, job: Job, log: runlog.RunLogger) -> None:
        self.job, self.log = job, log
        ec = job.cfg.exp_ctrl
        self.saves = Every(ec.save_freq_steps, ec.save_freq_epochs, ec.save_freq_secs)
        self.checkpoints = Every(ec.ckpt_freq_steps, ec.ckpt_freq_epochs, ec.ckpt_freq_secs)
        self.recover_enabled = job.cfg.recover_mode != "disabled"
        # From connect(), once the workers run: the loop's run state, its step timer, the trainers.
        self.state: RunState
        self.timer: runlog.StepTimer
        self.trainers: TrainerGroup

    # ------------------------------------------------------------ resume, before any worker starts
    def load(self, fresh: bool = False, discard: bool = False) -> RunState:
        """The run state this launch attempt continues: the newest recover checkpoint's, or a new
        run's (global step 1), as recover_mode, --fresh (--discard) and the attempt decide.
        Everything it changes is one of the steps below, in this order; a checkpoint that does not
        match the run raises UserError at recover.plan, before any is moved."""
        attempt = self.count_attempt()
        self.record_driver(attempt)
        self.prune_torn()
        plan = recover.plan(self.job, attempt, fresh, self.log, discard)
        if plan.start_over and plan.discard:
            self.prune_all(plan.start_over)
        elif plan.start_over:
            self.set_aside(plan.start_over)
        if plan.resume is not None:  # torn ones newer than the newest whole one: passed over
            for ck, why in plan.torn:
                self.pass_over(ck, why, plan.resume)
        self.seek_loader(plan.batches)
        if plan.resume is None:
            return RunState()
        self.restore_rng(plan.resume)
        recover.say_resuming(self.job, plan.resume, attempt, self.log)
        return recover.run_state(plan.resume)

    def count_attempt(self) -> int:
        """This launch attempt's number, counted: 0 the first, more a relaunch after a worker failure."""
        attempt = self.job.recover_attempts
        self.job.recover_attempts += 1
        return attempt

    def record_driver(self, attempt: int) -> None:
        """driver.json in the log folder: which process runs this run (`areal-kit logs` reads it)."""
        recover.write_driver_info(self.job, attempt)

    def prune_torn(self) -> None:
        """Delete a checkpoint whose write a crash cut short: it is never complete."""
        remove_tmp(self.job.paths.recover_dir)

    def pass_over(self, ck: Checkpoint, why: str, resume: Checkpoint) -> None:
        """A torn checkpoint is moved out of the resumable names (kept until the run writes past it);
        the run resumes from the newest whole one instead, training the steps since once more."""
        dest = move_torn(ck)
        self.log.warning(f"The recover checkpoint {ck.path} is torn ({why}): moved to {dest}; resuming from the "
                         f"newest whole one, {resume.path}: global steps {resume.global_step + 1}-{ck.global_step} "
                         "are trained again.")

    def set_aside(self, why: str) -> None:
        """Move the recover checkpoints into a set-aside folder, with a copy of the run's metrics and
        samples of now: the run starts over (--fresh, recover_mode=fault's first launch), nothing lost."""
        paths = self.job.paths
        ck = latest(paths.recover_dir)
        dest = set_aside(paths.recover_dir, [paths.metrics_file, paths.samples_file])
        if ck is None or dest is None:
            return
        self.log.info(f"{why}: starting at global step 1; the recover checkpoint {ck.path} (global step "
                      f"{ck.global_step}) is set aside in {dest}, not deleted (the newest set-aside is kept; "
                      "--fresh --discard deletes instead).")

    def prune_all(self, why: str = "--fresh --discard") -> None:
        """Delete every recover checkpoint and every set-aside folder: the run starts over, and the
        user asked for exactly that (--fresh --discard)."""
        rdir = self.job.paths.recover_dir
        gone = [ck.path for ck in list_checkpoints(rdir)] + set_asides(rdir)
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        if gone:
            self.log.info(f"{why}: deleted {', '.join(gone)}; starting at global step 1.")

    def seek_loader(self, batches: int) -> None:
        """Put the prompt loader after `batches` batches. A failed attempt may have left it ahead of
        training (queued batches), so its position always comes from the trained steps."""
        self.job.loader.seek(batches)

    def restore_rng(self, ck: Checkpoint) -> None:
        """The driver's random state as the checkpoint saved it."""
        rng.load(os.path.join(ck.path, recover.DRIVER_RNG))

    # ------------------------------------------------------------ once the workers run
    def connect(self, state: RunState, timer: runlog.StepTimer, trainers: TrainerGroup) -> None:
        """The state the loop advances and its step timer (what a checkpoint records), and the
        trainer group that writes and loads the trainers' part."""
        self.state, self.timer, self.trainers = state, timer, trainers

    def after_step(self, epoch: int, epoch_step: int) -> None:
        st, total = self.state, self.job.total_steps
        g, now = st.global_step, time.time()
        end_of_epoch = epoch_step + 1 == self.job.loader.steps_per_epoch
        st.last_save_time = st.last_save_time or now
        if g < total and self.saves.due(g, epoch, end_of_epoch, now - st.last_save_time):
            self.save_model(epoch, epoch_step)
            st.last_save_time = now
        recover.test_pause(self.job.paths.log_dir, "after_step", g)
        if not self.recover_enabled:
            return
        st.last_ckpt_time = st.last_ckpt_time or now
        if g == 2 or g >= total or self.checkpoints.due(g, epoch, end_of_epoch, now - st.last_ckpt_time):
            self.dump()
            st.last_ckpt_time = now

    def save_model(self, epoch: int, epoch_step: int) -> str:
        path = save_dir(self.job.paths.ckpt_dir, epoch, epoch_step, self.state.global_step)
        hf.save(self.trainers, path, self.job.cfg.exp_ctrl.keep_last_n)
        self.log.info(f"Saved model to {path}")
        return path

    def final_save(self) -> str:
        loader = self.job.loader
        return self.save_model(loader.epoch, max(loader.position - 1, 0))

    def dump(self) -> str:
        """The recover checkpoint of the current global step; its path."""
        return recover.write(self.job, self.state, self.timer.state_dict(), self.trainers, self.log)

    def restore(self, weights: WeightSync) -> None:
        """Trainer state (model, optimizer, LR scheduler, RNG) from the checkpoint the run state was
        read from; the engines start from the base model, so they get its weights before sampling."""
        t0 = time.time()
        path = self.state.recover_path
        got = recover.restore(path, self.trainers)
        weights.push(got.version, wait_engines=True)
        how = (f" (written by {got.ranks_written} ranks: DeepSpeed's universal format, loaded in "
               f"{got.load_time:.1f}s)" if got.universal else "")
        self.log.info(f"Restored trainer state (model, optimizer, LR scheduler, RNG) from {path}/engine{how} and "
                      f"synced weight version {got.version} to the rollout engines in {time.time() - t0:.1f}s.")

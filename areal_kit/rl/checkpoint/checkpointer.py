"""When the run saves, and what: Hugging Face folders and recover checkpoints, one due rule.

    ckpt = Checkpointer(job, state, timer, log, trainers)
    ckpt.after_step(epoch, epoch_step)   # each step: an HF save and/or a recover checkpoint, if due
    ckpt.dump()                          # a recover checkpoint now (a requested stop)
    ckpt.final_save()                    # the model at the end of the run
    ckpt.restore(weights)                # at start: trainer state from the checkpoint, weights to engines

exp_ctrl.save_freq_{steps,epochs,secs} time the HF saves (not after the last step: final_save
writes that one); exp_ctrl.ckpt_freq_{steps,epochs,secs} the recover checkpoints, which are also
written after global step 2 (a crash early in a long run loses little) and after the last step
(a finished run can be extended).
"""

from __future__ import annotations

import time

from areal_kit.rl.checkpoint import hf, recover
from areal_kit.rl.schedule import Every


class Checkpointer:
    def __init__(self, job, state, timer, log, trainers):
        self.job, self.state, self.timer, self.log, self.trainers = job, state, timer, log, trainers
        ec = job.cfg.exp_ctrl
        self.saves = Every(ec.save_freq_steps, ec.save_freq_epochs, ec.save_freq_secs)
        self.checkpoints = Every(ec.ckpt_freq_steps, ec.ckpt_freq_epochs, ec.ckpt_freq_secs)
        self.recover_enabled = job.cfg.recover_mode != "disabled"

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
        path = hf.save_dir(self.job.paths.ckpt_dir, epoch, epoch_step, self.state.global_step)
        hf.save(self.trainers, path, self.job.cfg.exp_ctrl.keep_last_n)
        self.log.info(f"Saved model to {path}")
        return path

    def final_save(self) -> str:
        loader = self.job.loader
        return self.save_model(loader.epoch, max(loader.position - 1, 0))

    def dump(self) -> str:
        """The recover checkpoint of the current global step; its path."""
        return recover.write(self.job, self.state, self.timer.state_dict(), self.trainers, self.log)

    def restore(self, weights) -> None:
        """Trainer state (model, optimizer, LR scheduler, RNG) from the checkpoint the run state was
        read from; the engines start from the base model, so they get its weights before sampling."""
        t0 = time.time()
        path = self.state.recover_path
        got = recover.restore(path, self.trainers)
        weights.push(got["version"], wait_engines=True)
        how = (f" (written by {got['ranks_written']} ranks: DeepSpeed's universal format, loaded in "
               f"{got['load_time']:.1f}s)" if got["universal"] else "")
        self.log.info(f"Restored trainer state (model, optimizer, LR scheduler, RNG) from {path}/engine{how} and "
                      f"synced weight version {got['version']} to the rollout engines in {time.time() - t0:.1f}s.")

"""The master loop: rollout -> reward -> advantages -> train -> weight sync, step after step.

One driver process owns the data order, the step counters and the logs; Ray actors do the work
(workers/). Which prompts the engines generate when, and which answers a step trains on within
the staleness bound (ppo.max_head_offpolicyness), is the rollout's: whole batches queued ahead of
training, or under rollout.mode=stream one group at a time (rl/driver/rollout.py).

    from areal_kit.config.loader import load_config
    from areal_kit.rl.driver.job import prepare
    from areal_kit.rl.driver.controller import Controller, start_ray
    job = prepare(load_config("tiny"))
    start_ray(job.cfg)
    ctrl = Controller(job, log)
    ctrl.start(); outcome = ctrl.run(); ctrl.stop()      # outcome.ending is Ending.FINISHED

rl/driver/launch.py adds what a run from the command line needs: the run state from the recover checkpoint
(Checkpointer.load), SIGTERM between steps (should_stop), relaunches after a worker death.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from areal_kit import logs, runlog
from areal_kit.config.loader import describe_options, origin
from areal_kit.rl import sharing
from areal_kit.rl.algo.batch import Shaped, episode_stats, episodes, shape_rewards, step_stats
from areal_kit.rl.common import heap
from areal_kit.rl.driver import groups, raystart
from areal_kit.rl.driver.checkpointer import Checkpointer
from areal_kit.rl.driver.job import Job, RunState
from areal_kit.rl.driver.rollout import Rollout, make_rollout
from areal_kit.rl.driver.schedule import Every
from areal_kit.rl.driver.turns import Turns
from areal_kit.rl.driver.validation import Validator
from areal_kit.rl.driver.weight_sync import WeightSync
from areal_kit.rl.hallway import TokenTrace
from areal_kit.rl.sample import Gathered, Generated, Sample, trainer_rows
from areal_kit.rl.weight_sync import mode

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig


class CannotLearn(RuntimeError):
    """The run cannot learn (a non-finite loss, rewards that all fail): stop, do not relaunch."""


class Ending(enum.Enum):
    FINISHED = "finished"  # every step trained, the final model saved
    STOPPED = "stopped"  # should_stop() asked, and the loop stopped between two steps


@dataclass(frozen=True)
class Outcome:
    """Why Controller.run returned, after which step, and with which recover checkpoint."""

    ending: Ending
    global_step: int  # steps finished
    checkpoint: str = ""  # STOPPED: the recover checkpoint of global_step ("" under recover_mode=disabled)
    last: dict = field(default_factory=dict)  # the last step's metrics row ({} when no step ran)


class Controller:
    def __init__(self, job: Job, log: runlog.RunLogger, state: RunState | None = None,
                 progress: Callable[[int, int, dict], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, checkpoints: Checkpointer | None = None) -> None:
        self.job, self.cfg, self.log = job, job.cfg, log
        self.state = state or RunState()
        self.timer = runlog.StepTimer(self.state.timer)
        self.progress = progress
        # Asked after each step: True stops the loop there, after a recover checkpoint (rl/driver/launch.py: SIGTERM).
        self.should_stop = should_stop or (lambda: False)
        # The one that loaded `state`, when it came from a recover checkpoint (rl/driver/launch.py).
        self.checkpoints = checkpoints or Checkpointer(job, log)
        self.workers: groups.Workers | None = None  # from start() to stop()
        # Set by start(), the rollout by run() (it continues the run state); the loop runs in between.
        self.weights: WeightSync
        self.turns: Turns
        self.validator: Validator
        self.rollout: Rollout
        self.sample_dumps = Every(steps=job.cfg.exp_ctrl.dump_samples_every)
        self._failure_kinds: set[tuple[str, str]] = set()  # (field, kind) of the failures already logged
        self._failed_steps = 0  # steps in a row in which every sample's reward failed
        self._first_failure = ""  # the first reward error of that streak

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the workers on the Ray cluster that start_ray joined, and connect their weight sync."""
        if not ray.is_initialized():
            raise RuntimeError("Ray is not started: call controller.start_ray(cfg) before Controller.start()")
        t0 = time.time()
        cache = os.path.join(self.cfg.fileroot, "cache")
        w = self.workers = groups.create(self.cfg, self.job.model_path, cache, self.job.total_steps,
                                         os.path.join(self.job.paths.log_dir, "stacks"))
        setup = w.setup()
        self.weights = WeightSync(mode.choose(self.cfg), w.trainers, w.engines)
        self.turns = Turns(w.engines, sharing.shares_gpus(self.cfg), self.cfg.actor.lora, trainers=w.trainers)
        how = self.weights.connect()
        self.checkpoints.connect(self.state, self.timer, w.trainers)
        self.validator = Validator(self.cfg.exp_ctrl, self.cfg.ppo.gen, self.cfg.seed, self.job.eval_rows, w.engines,
                                   self.log, self.job.total_steps)
        self.log.config(describe_options(self.cfg), origin(self.cfg))  # config.json: `areal-kit view`'s run page
        heap.freeze()
        self.log.info(logs.ready_line(time.time() - t0, f"{len(w.trainers)} trainer rank(s) (setup "
                                      f"{setup['trainer_setup']:.1f}s, attention {w.trainers.attention()}), "
                                      f"{len(w.engines)} rollout engine(s) (setup {setup['rollout_setup']:.1f}s), "
                                      f"weight sync {self.cfg.weight_sync}: {how}"))

    def restore(self) -> None:
        """Continue from the recover checkpoint the run state was loaded from."""
        self.checkpoints.restore(self.weights)

    def dead_workers(self, timeout_s: float = 10) -> int:
        """How many of this attempt's actors are dead (a busy one, still running a call, is alive)."""
        return self.workers.dead(timeout_s) if self.workers else 0

    @property
    def running(self) -> groups.Workers:
        """The workers, between start() and stop()."""
        if self.workers is None:
            raise RuntimeError("the workers are not running: Controller.start() first")
        return self.workers

    def stop(self) -> None:
        if self.workers:
            self.workers.kill()
        self.workers = None

    # ------------------------------------------------------------ the loop
    def run(self) -> Outcome:
        """Train to the last step, or until should_stop() asks after a step: that step's recover
        checkpoint is written first (unless recover is disabled), so a re-run loses nothing."""
        st, total = self.state, self.job.total_steps
        c = self.cfg
        self.rollout = make_rollout(c.ppo, c.rollout, c.dataset, c.seed, self.job, self.running, self.weights, st,
                                    self.log)

        last = {}
        while st.global_step < total:
            last = self._step()
            if self.should_stop() and st.global_step < total:
                checkpoint = self.checkpoints.dump() if self.checkpoints.recover_enabled else ""
                return Outcome(Ending.STOPPED, st.global_step, checkpoint, last)
        self.weights.wait()
        self.checkpoints.final_save()
        return Outcome(Ending.FINISHED, st.global_step, last=last)

    def _step(self) -> dict:
        """One global step: gather, shape, train, sync, log, checkpoint if due; its metrics row."""
        st = self.state
        t_step = time.time()
        got = self.rollout.gather()
        t_got = time.time()
        self._check_rewards(got.samples, got.outs)
        shaped = shape_rewards(got.train, self.cfg.ppo)
        rows = trainer_rows(shaped.train)
        dump = self.sample_dumps.due(st.global_step + 1)
        dumped = self._dumped(shaped.samples) if dump else []
        # The dumped samples' per-token values from the trainer, asked by their place in its rows.
        wanted = set(dumped) if self.cfg.exp_ctrl.dump_sample_tokens else set()
        trace = [k for k, i in enumerate(shaped.trained) if i in wanted]
        self.turns.before_train()  # engines on the trainer's GPUs release them (shared GPUs)
        t_train = time.time()
        reply = self.running.trainers.train_step(rows, trace)
        stats = reply.stats
        train_time = time.time() - t_train
        self._check_loss(stats)  # before the engines get the new weights
        st.version += 1
        t_sync = time.time()
        sync_time = self.turns.after_train(lambda: self.weights.push(st.version, wait_engines=self.turns.active))
        st.global_step += 1
        self.rollout.after_push()
        row = self._step_row(got, shaped, stats)
        row.update(train_time=train_time, sync_time=sync_time, e2e_time=time.time() - t_step)
        row.update(self.turns.seconds)
        self.timer.add(row["e2e_time"])
        spans = self._spans(got, t_step, t_got, t_train, train_time, t_sync, sync_time, stats)
        if self.validator.due(st.global_step):
            t_eval = time.time()
            row.update(self.validator.run(st.global_step))
            spans.append(("driver", "eval", t_eval, time.time()))
        self._log_step(got.epoch, got.epoch_step, row)
        if dump:
            by_sample = {shaped.trained[k]: t for k, t in reply.traces.items()}
            self.log.samples(st.global_step, self._readable([(shaped.samples[i], by_sample.get(i)) for i in dumped]))
        if not self._failed_steps:  # a checkpoint in a failing streak would be resumed into it
            t_ckpt, before = time.time(), (st.last_save_time, st.last_ckpt_time)
            self.checkpoints.after_step(got.epoch, got.epoch_step)
            what = [name for name, b, a in zip(("model save", "recover checkpoint"), before,
                                               (st.last_save_time, st.last_ckpt_time)) if b and a != b]
            if what:
                spans.append(("driver", " + ".join(what), t_ckpt, time.time()))
        self.log.timeline(st.global_step, spans)
        return row

    def _spans(self, got: Gathered, t_step: float, t_got: float, t_train: float, train_time: float, t_sync: float,
               sync_time: float, stats: dict | None = None) -> list[tuple[str, str, float, float]]:
        """The step's timeline (timeline.jsonl, `areal-kit view`'s lanes): the driver's wait for the
        rollout and the weight sync, each engine reply's generation and reward (the engine's clock),
        the trainer's train step and, from its stats, its parts in the order the trainer runs them
        (reference logprobs, proximal logprobs, then forward/backward/optimizer: the rest, the
        call's overhead included); wall-clock start and end."""
        spans = [("driver", "wait for the rollout", t_step, t_got)]
        for o in got.outs:
            gen_end = o.done - o.reward_time
            spans += [(f"engine {o.engine}", "generate", gen_end - o.gen_time, gen_end),
                      (f"engine {o.engine}", "reward", gen_end, o.done)]
        spans.append(("trainer", "train step", t_train, t_train + train_time))
        at = t_train
        for what, key in (("reference logprobs", "ref_logp_time"), ("proximal logprobs", "prox_logp_time")):
            took = float((stats or {}).get(key) or 0.0)
            if took > 0:
                spans.append(("trainer parts", what, at, at + took))
                at += took
        if at > t_train:
            spans.append(("trainer parts", "forward/backward/optimizer", at, max(at, t_train + train_time)))
        spans.append(("driver", "weight sync", t_sync, t_sync + sync_time))
        return spans

    def _check_rewards(self, samples: list[Sample], outs: list[Generated]) -> None:
        """Count the steps in a row whose every sample's reward failed; stop at the configured count."""
        failed = sum(count for o in outs for count, _ in o.reward_failures.values())
        if failed < len(episodes(samples)):  # rewards grade episodes, not their segments
            self._failed_steps, self._first_failure = 0, ""
            return
        if not self._failed_steps:
            self._first_failure = next((first for o in outs for _, first in o.reward_failures.values()), "")
        self._failed_steps += 1
        limit = self.cfg.exp_ctrl.stop_after_failed_reward_steps
        if limit and self._failed_steps >= limit:
            raise CannotLearn(f"every sample's reward failed in {self._failed_steps} steps in a row, up to global "
                              f"step {self.state.global_step + 1} (first error: {self._first_failure}); the last "
                              "recover checkpoint is from before them")

    def _check_loss(self, stats: dict) -> None:
        """A non-finite loss, or a non-finite gradient under a finite loss (the forward can stay finite
        through the norms while the backward overflows): the optimizer step just taken wrote NaN
        weights, so stop before the engines or a recover checkpoint take them."""
        for what, key in (("loss", "actor_loss"), ("gradient norm", "grad_norm")):
            v = stats.get(key)
            if v is not None and not math.isfinite(v):
                raise CannotLearn(f"the {what} is {v} at global step {self.state.global_step + 1}; the last recover "
                                  "checkpoint is from before it (a lower actor.lr, or a check of the rewards, may help)")

    def _step_row(self, got: Gathered, shaped: Shaped, stats: dict) -> dict:
        st, outs = self.state, got.outs
        # The means are sums, so their last digit depends on the order: a step that shaped every
        # sample it generated reports them in shaping's order, one of dynamic sampling as they came.
        samples = shaped.samples if got.picked is None else got.samples
        row = step_stats(samples, shaped, stats)
        row.update(gen_time=got.gen_time, reward_time=max(o.reward_time for o in outs),
                   load_time=max((x.get("load_time", 0.0) for x in got.loads), default=0.0),
                   send_wait_time=stats.get("send_wait_time", 0.0),
                   epoch=got.epoch + 1, epoch_step=got.epoch_step + 1, version=st.version,
                   ref_logp_time=stats.get("ref_logp_time", 0.0), prox_logp_time=stats.get("prox_logp_time", 0.0),
                   staleness=got.stale, wait_time=got.wait_time)
        if self.cfg.ppo.dynamic_sampling:
            row.update({"dynamic/rounds": got.rounds, "dynamic/dropped_groups": got.dropped,
                        "dynamic/kept_groups": got.kept})
        if self.cfg.ppo.workflow or self.cfg.agent.fn:  # single-turn answers: one turn, no call, no tool tokens
            row.update(episode_stats(samples, sum(o.failed_calls for o in outs)))
        row.update(self._plugin_stats(outs))
        row.update(got.metrics)
        return row

    def _dumped(self, samples: list[Sample]) -> list[int]:
        """The samples a dump writes (their index): those of the first dump_samples_groups groups."""
        n = self.cfg.exp_ctrl.dump_samples_groups
        groups = set(list(dict.fromkeys((s.id, s.group) for s in samples))[:n])
        return [i for i, s in enumerate(samples) if (s.id, s.group) in groups]

    def _readable(self, dumped: list[tuple[Sample, TokenTrace | None]]) -> list[dict]:
        """The dumped samples as text (special tokens shown: an answer's eos matters), with what the
        trainer saw: task_reward and seq_reward (the shaped reward the trainer credits to the last
        token; group-normalized for GRPO), and per token, unless dump_sample_tokens is off, what the
        trainer computed for a sample it trained on (its TokenTrace; none for a group it skipped)."""
        tok = self.job.tokenizer
        return [{"id": s.id, "group": s.group, "prompt": tok.decode(s.prompt_ids), "answer": tok.decode(s.output_ids),
                 "task_reward": s.task_reward, "seq_reward": s.seq_reward, "no_eos": s.no_eos,
                 "n_tokens": len(s.output_ids), "version": s.version, "final_reward": s.final_reward,
                 "tool_calls": s.tool_calls, "turns": s.turns,
                 **({} if s.episode is None else {"episode": s.episode}),  # one segment of it
                 **(runlog.token_fields(tok.batch_decode([[t] for t in s.output_ids]), s.logprobs, s.loss_mask,
                                        s.versions, trainer_fields(s, trace))
                    if self.cfg.exp_ctrl.dump_sample_tokens else {})}
                for s, trace in dumped]

    def _plugin_stats(self, outs: list[Generated]) -> dict:
        """reward_failures and agent/dropped (counts this step; each new kind logged once) and reward/* means."""
        out = {"reward_failures": self._failures(outs, "reward_failures", "Reward failure ({}); those samples get "
                                                 "reward 0. Further failures of this kind are counted in "
                                                 "reward_failures, not logged.")}
        if self.cfg.agent.fn:
            out["agent/dropped"] = self._failures(outs, "agent_drops", "Agent episode dropped and run again ({}). "
                                                  "Further drops of this kind are counted in agent/dropped, "
                                                  "not logged.")
        keys = {k for o in outs for k in o.reward_extras}
        for k in keys:
            vals = [o.reward_extras[k] for o in outs if k in o.reward_extras]
            out[k] = sum(vals) / len(vals)
        return out

    def _failures(self, outs: list[Generated], field: str, warning: str) -> int:
        """The count of one field's failures ({kind: (count, first message)}) over outs; a kind not
        seen before is logged with its first message."""
        n = 0
        for o in outs:
            for kind, (count, first) in getattr(o, field).items():
                n += count
                if (field, kind) not in self._failure_kinds:
                    self._failure_kinds.add((field, kind))
                    self.log.warning(warning.format(first))
        return n

    def _log_step(self, epoch: int, epoch_step: int, row: dict) -> None:
        job, st = self.job, self.state
        rpc = {k: row[k] for k in logs.RPC_KEYS if k in row}
        rpc.update({k: row[k] for k in ("perc_zero_adv", "entropy", "grad_norm", "staleness") if k in row})
        self.log.info(logs.rpc_line(_round(rpc)))
        eta = self.timer.eta(job.total_steps - st.global_step)
        # Dynamic sampling reads prompts faster than steps go: it may read on past the last epoch.
        self.log.info(logs.epoch_line(epoch + 1, max(job.n_epochs, epoch + 1), epoch_step + 1,
                                      job.loader.steps_per_epoch, st.global_step, row["n_tokens"], row["e2e_time"],
                                      self.timer.total, eta))
        self.log.step(st.global_step, row)
        if self.progress is not None:
            self.progress(st.global_step, job.total_steps, row)


def start_ray(cfg: TrainConfig) -> None:
    """Join (or start) the Ray cluster the run's workers go on; before Controller.start."""
    raystart.start_ray(cfg)


def trainer_fields(s: Sample, trace: TokenTrace | None) -> dict[str, list[float | None]]:
    """A dumped sample's trainer fields, per output token: trainer_logprob (before the step's
    update), ratio = exp(trainer_logprob - the sampling logprob) (null on a token the model did
    not sample: a workflow's inserted tokens, loss mask 0, have no sampling logprob), entropy, and
    ref_kl = trainer_logprob - the reference's (with a reference model only)."""
    if trace is None:
        return {}
    mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.output_ids)
    # A token the sampler found far likelier than the trainer (or the reverse) is what a ratio shows;
    # the cap only keeps exp from overflowing.
    ratio: list[float | None] = [math.exp(min(lp - b, 80.0)) if m else None
                                 for lp, b, m in zip(trace.logprobs, s.logprobs, mask)]
    out: dict[str, list[float | None]] = {"trainer_logprob": list(trace.logprobs), "ratio": ratio,
                                          "entropy": list(trace.entropy)}
    if trace.ref_kl is not None:
        out["ref_kl"] = list(trace.ref_kl)
    return out


def _round(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}

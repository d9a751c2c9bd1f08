"""The master loop: rollout -> reward -> advantages -> train -> weight sync, step after step.

One driver process owns the data order, the step counters and the logs; Ray actors do the work
(areal_kit/rl/workers/groups.py). With ppo.max_head_offpolicyness = k, generation of the next k batches
is already queued on the engines while the trainer trains, and a batch is only trained on while
its weights are at most k versions old (k = 0: strictly on-policy).

    from areal_kit.config.loader import load_config
    from areal_kit.rl.controller import run
    run(load_config("tiny"))
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

from areal_kit import logs
from areal_kit.data.tokenizer import load_tokenizer
from areal_kit.errors import UserError
from areal_kit.rl import validation
from areal_kit.rl.algo import batch as B
from areal_kit.rl.plan import weight_sync_dir


@dataclass
class RunState:
    """Everything the loop needs to continue; recover checkpoints persist it."""

    global_step: int = 0  # steps finished
    version: int = 0  # weight updates applied (= global_step after each sync)
    loader: dict = field(default_factory=dict)
    timer: dict = field(default_factory=dict)
    last_save_time: float = 0.0
    last_ckpt_time: float = 0.0
    recover_path: str = ""  # the recover checkpoint this state was read from (rl/checkpoint/recover.py)


@dataclass
class Job:
    """What a run needs before any actor starts (all input validated here)."""

    cfg: object
    paths: logs.RunPaths
    model_path: str
    loader: object  # data.prompts.PromptLoader
    total_steps: int
    n_dropped: int
    recover_attempts: int = 0  # launch attempts so far (rl/checkpoint/recover.py: fault mode, relaunch messages)
    eval_rows: list = field(default_factory=list)  # the in-training eval split, tokenized (rl/validation.py)

    @property
    def n_epochs(self) -> int:
        return self.cfg.exp_ctrl.total_train_epochs


def resolve_model(cfg) -> str:
    path = cfg.actor.path
    if path.startswith("tiny://"):
        from areal_kit.data.tiny_model import TinySpec, build

        kind = path.removeprefix("tiny://") or "toy"
        return build(os.path.join(cfg.fileroot, "models", f"tiny-{kind}"), TinySpec(kind=kind, seed=cfg.seed))
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"actor.path={path} is not a model folder (no config.json there); expected a "
                        "Hugging Face model folder or tiny://toy")
    return path


def prepare(cfg) -> Job:
    from areal_kit.data.prompts import PromptLoader, load_rows, tokenize_rows
    from areal_kit.data.sources import split_eval
    from areal_kit.reward.plugins import reward_specs
    from areal_kit.rl.workers.workflow import load as load_workflow

    paths = logs.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name)
    model_path = resolve_model(cfg)
    rows = load_rows(cfg)
    # Plug-ins import here, so a bad path is a one-line error before any worker starts.
    reward_specs(cfg.ppo)
    load_workflow(cfg.ppo.workflow)
    rows, eval_rows = split_eval(rows, cfg.dataset, cfg.seed)
    B.check_rows(rows + eval_rows, cfg.ppo.reward_fns)
    tok = load_tokenizer(model_path)  # refuses, in one line, a tokenizer that cannot read itself
    d = cfg.dataset
    rows, dropped = tokenize_rows(rows, tok, d.max_prompt_len, d.apply_chat_template, d.question_field)
    if eval_rows:
        eval_rows, _ = tokenize_rows(eval_rows, tok, d.max_prompt_len, d.apply_chat_template, d.question_field)
    loader = PromptLoader(rows, d.train_bs_n_seqs, seed=cfg.seed, shuffle=d.shuffle)
    total = cfg.exp_ctrl.total_train_epochs * loader.steps_per_epoch
    if cfg.exp_ctrl.total_train_steps:
        total = min(total, cfg.exp_ctrl.total_train_steps)
    return Job(cfg, paths, model_path, loader, total, dropped, eval_rows=eval_rows)


class Controller:
    def __init__(self, job: Job, log: logs.RunLogger, state: RunState | None = None, progress=None,
                 stop_request=None):
        self.job, self.cfg, self.log = job, job.cfg, log
        self.state = state or RunState()
        self.timer = logs.StepTimer(self.state.timer)
        self.progress = progress
        # Checked after each step: None, or the Interrupted to raise after a recover checkpoint (rl/launch.py).
        self.stop_request = stop_request or (lambda: None)
        self.workers = None
        self._failure_kinds: set[str] = set()  # reward failure kinds already logged
        self._receiving: list = []  # engines' weight loads of the last sync, still running
        self._shared = False  # engines on this node take weights through shared memory

    # ------------------------------------------------------------ lifecycle
    def start_ray(self) -> None:
        """Join (or start) the Ray cluster; start() does it too, when it was not done."""
        from areal_kit.rl.workers import groups

        groups.start_ray(self.cfg, _slots(self.cfg))

    def start(self) -> None:
        from areal_kit.rl.workers import groups

        t0 = time.time()
        self.start_ray()
        cache = os.path.join(self.cfg.fileroot, "cache")
        self.workers = groups.create(self.cfg, self.job.model_path, cache, self.job.total_steps)
        setup = groups.setup(self.workers)
        how = "save + reload"
        if self.cfg.weight_sync != "disk":
            self._shared, how = groups.init_weight_sync(self.workers, shared=self.cfg.weight_sync == "auto")
        import ray

        attention = ray.get(self.workers.trainers[0].attention.remote())
        self.log.info(f"Workers ready in {time.time() - t0:.1f}s: {len(self.workers.trainers)} trainer rank(s) "
                      f"(setup {setup['trainer_setup']:.1f}s, attention {attention}), {len(self.workers.rollouts)} "
                      f"rollout engine(s) (setup {setup['rollout_setup']:.1f}s), weight sync {self.cfg.weight_sync}: "
                      f"{how}.")

    def dead_workers(self, timeout_s: float = 10) -> int:
        """How many of this attempt's actors are dead (a busy one, still running a call, is alive)."""
        import ray

        actors = (self.workers.trainers + self.workers.rollouts) if self.workers else []
        refs = [a.__ray_ready__.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        dead = 0
        for r in ready:
            try:
                ray.get(r)
            except ray.exceptions.RayActorError:
                dead += 1
        return dead

    def stop(self) -> None:
        import ray

        for a in (self.workers.trainers + self.workers.rollouts) if self.workers else []:
            ray.kill(a)
        self.workers = None

    # ------------------------------------------------------------ the loop
    def _dispatch(self) -> tuple:
        """Queue generation of the next batch on every engine (rows split evenly)."""
        loader = self.job.loader
        epoch, epoch_step, rows = loader.next_batch()
        step_index = self._dispatched
        self._dispatched += 1
        rows = [{**r, "seed": B.sample_seed(self.cfg.seed, step_index, i)} for i, r in enumerate(rows)]
        engines = self.workers.rollouts
        chunks = [rows[i::len(engines)] for i in range(len(engines))]
        futs = [e.generate.remote(c) for e, c in zip(engines, chunks) if c]
        # Engines run calls in order, so these loads finish before this generation starts; the
        # loop checks them when it takes the batch, so a failed load never feeds training.
        return epoch, epoch_step, futs, self._receiving

    def run(self) -> dict:
        import ray

        cfg, job, st = self.cfg, self.job, self.state
        k = cfg.ppo.max_head_offpolicyness
        self._dispatched = st.global_step
        pending: deque = deque()
        last = {}
        while st.global_step < job.total_steps:
            t_step = time.time()
            while len(pending) <= k and self._dispatched < job.total_steps:
                pending.append(self._dispatch())
            epoch, epoch_step, futs, loads_before = pending.popleft()
            t_wait = time.time()
            got = _get_each(loads_before + futs)  # a failed send or load surfaces at once
            loads, outs = got[:len(loads_before)], got[len(loads_before):]
            wait_time = time.time() - t_wait
            samples = [s for o in outs for s in o["samples"]]
            stale = st.version - min(s["version"] for s in samples)
            if stale > k:  # the queueing above makes this impossible; guard the invariant anyway
                raise RuntimeError(f"sample staleness {stale} exceeds max_head_offpolicyness {k}")
            shaped = B.shape_rewards(samples, cfg.ppo)
            train_samples = shaped.pop("_train_samples")
            ref = ray.put(train_samples)
            t_train = time.time()
            stats = ray.get([t.train_step.remote(ref) for t in self.workers.trainers])[0]
            train_time = time.time() - t_train
            st.version += 1
            sync_time = self._sync()
            st.global_step += 1
            e2e = time.time() - t_step
            self.timer.add(e2e)
            row = B.step_stats(samples, shaped, stats)
            row.update(gen_time=max(o["gen_time"] for o in outs), reward_time=max(o["reward_time"] for o in outs),
                       wait_time=wait_time, train_time=train_time, sync_time=sync_time, e2e_time=e2e,
                       load_time=max((x.get("load_time", 0.0) for x in loads), default=0.0),
                       send_wait_time=stats.get("send_wait_time", 0.0),
                       staleness=stale, epoch=epoch + 1, epoch_step=epoch_step + 1, version=st.version,
                       ref_logp_time=stats.get("ref_logp_time", 0.0),
                       prox_logp_time=stats.get("prox_logp_time", 0.0))
            row.update(self._plugin_stats(outs))
            if self.job.eval_rows and validation.due(cfg, st.global_step, job.total_steps):
                row.update(validation.run(self, st.global_step))
            self._log_step(epoch, epoch_step, row)
            last = row
            self._after_step(epoch, epoch_step)
            if (stop := self.stop_request()) is not None and st.global_step < job.total_steps:
                self._stop_here(stop)
        ray.get(self._receiving)
        self._final_save()
        return last

    def _plugin_stats(self, outs: list[dict]) -> dict:
        """reward_failures (count this step; each new kind logged once) and reward/* means."""
        seen = self._failure_kinds
        n = 0
        for o in outs:
            for kind, (count, first) in o.get("reward_failures", {}).items():
                n += count
                if kind not in seen:
                    seen.add(kind)
                    self.log.warning(f"Reward failure ({first}); those samples get reward 0. Further "
                                     f"failures of this kind are counted in reward_failures, not logged.")
        out = {"reward_failures": n}
        keys = {k for o in outs for k in o.get("reward_extras", {})}
        for k in keys:
            vals = [o["reward_extras"][k] for o in outs if k in o.get("reward_extras", {})]
            out[k] = sum(vals) / len(vals)
        return out

    def _sync(self, wait_engines: bool = False) -> float:
        """New weights to every engine; seconds until the trainer is free again.

        The trainer waits for its side only (the weights staged, or the folder saved): the send
        and the engines' loads run while it goes on to its next step, whose optimizer step waits
        for the send. Engines run calls in order, so a load queued behind a generation waits for
        it, and the next generation waits for the load.
        """
        import ray

        t0 = time.time()
        w = self.workers
        v = self.state.version
        if self.cfg.weight_sync != "disk":
            shared = self._shared and self.cfg.weight_sync == "auto"
            ray.get([t.stage_weights.remote() for t in w.trainers])
            # get_version queues behind an engine's pending generations: the send starts once every
            # engine is free to receive, on the trainer's second thread while it trains on. No one
            # waits inside the collective during a generation (a long one would meet its timeout).
            # With shared memory the trainer writes into the engines' parameters from then on:
            # safe, as each engine's next call is the receive_weights queued here.
            free = [r.get_version.remote() for r in w.rollouts]
            send = w.trainers[0].send_weights.options(concurrency_group="weights").remote(*free, shared=shared)
            self._receiving = [send] + [r.receive_weights.remote(v, shared) for r in w.rollouts]
        else:
            path = weight_sync_dir(self.cfg)
            ray.get([t.save_hf.remote(path) for t in w.trainers])
            self._receiving = [r.load_from_disk.remote(path, v) for r in w.rollouts]
        if wait_engines:
            ray.get(self._receiving)
        return time.time() - t0

    def _log_step(self, epoch: int, epoch_step: int, row: dict) -> None:
        job, st = self.job, self.state
        rpc = {k: row[k] for k in logs.RPC_KEYS if k in row}
        rpc.update({k: row[k] for k in ("perc_zero_adv", "entropy", "grad_norm", "staleness") if k in row})
        self.log.info(logs.rpc_line(_round(rpc)))
        eta = self.timer.eta(job.total_steps - st.global_step)
        self.log.info(logs.epoch_line(epoch + 1, job.n_epochs, epoch_step + 1, job.loader.steps_per_epoch,
                                      st.global_step, row["n_tokens"], row["e2e_time"], self.timer.total, eta))
        self.log.step(st.global_step, row)
        if self.progress is not None:
            self.progress(st.global_step, job.total_steps, row)

    # ------------------------------------------------------------ saves
    def _after_step(self, epoch: int, epoch_step: int) -> None:
        from areal_kit.rl.checkpoint import hf

        ec, st = self.cfg.exp_ctrl, self.state
        end_of_epoch = epoch_step + 1 == self.job.loader.steps_per_epoch
        now = time.time()
        if not st.last_save_time:
            st.last_save_time = now
        due = ((ec.save_freq_steps and st.global_step % ec.save_freq_steps == 0)
               or (ec.save_freq_epochs and end_of_epoch and (epoch + 1) % ec.save_freq_epochs == 0)
               or (ec.save_freq_secs and now - st.last_save_time >= ec.save_freq_secs))
        if due and st.global_step < self.job.total_steps:
            hf.save_model(self, epoch, epoch_step)
            st.last_save_time = now
        hf.maybe_dump_recover(self, epoch, epoch_step, end_of_epoch)

    def _stop_here(self, stop) -> None:
        """Stop between steps, as asked: the recover checkpoint of this step first (unless recover
        is disabled), so a re-run loses nothing."""
        from areal_kit.rl.checkpoint import recover

        if self.cfg.recover_mode != "disabled":
            stop.global_step, stop.checkpoint = self.state.global_step, recover.dump(self)
        raise stop

    def _final_save(self) -> None:
        from areal_kit.rl.checkpoint import hf

        loader = self.job.loader
        hf.save_model(self, loader.epoch, max(loader.position - 1, 0))


def _get_each(refs: list) -> list:
    """ray.get, raising the first error as soon as it is in: a plain ray.get of a list can sit on
    a generation stuck behind a load whose sender already failed."""
    import ray

    left = list(refs)
    while left:
        done, left = ray.wait(left, num_returns=1)
        ray.get(done)
    return ray.get(refs)


def _slots(cfg) -> int:
    from areal_kit.config.alloc import parse_allocation

    # One Ray slot per trainer rank and per engine GPU: colocated roles share GPUs, not slots.
    a = parse_allocation(cfg.allocation_mode)
    return a.gen_gpus + a.train_gpus


def _round(d: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}

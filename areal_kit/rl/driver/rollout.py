"""The controller's side of rollouts: which prompts go to the engines when, and which answers a step
trains on. One interface, two modes (rollout.mode); the controller never asks which it has.

Batch mode (BatchRollout): whole batches are queued on the engines, generation of the next k batches
(k = ppo.max_head_offpolicyness) already queued while the trainer trains, and a batch is only
trained on while its weights are at most k versions old (k = 0: strictly on-policy). Under
ppo.dynamic_sampling a step takes further batches from the same queue until it holds a batch's worth
of informative groups; a step taking more batches only makes the queued ones fresher, so the bound holds.

Stream mode (StreamRollout): prompts go to the engines one group at a time as capacity allows, and a
step trains on the first groups to finish. Staleness is bounded per sample, as AReaL bounds it. At
most (1 + k) x train_bs_n_seqs prompts are in flight or finished and not yet trained, and a step at
weight version v trains only on groups whose first token was sampled at version v - k or later: a
group too stale (a long answer that outlived k updates; the engines abort it at that update) is
generated again from its prompt, never trained. Each group runs at the priority of the version it
was first submitted at, so when the engines' slots run short the oldest groups (one generated again
included) run first and make the bound. A group that finished too stale more than
rollout.max_restarts times is held: generated before any other, and the step that is its last
chance within the bound waits for it, so no prompt is regenerated forever (a long answer would
otherwise never be trained). k = 0 is synchronous: a batch in flight, trained when all of it is in.
The engines get new prompts as soon as a step's weights are pushed (after_push). Under
ppo.dynamic_sampling the groups whose answers all got the same task reward are dropped and more are
taken from the stream (at most dynamic_sampling_max_rounds batches' worth more).

The bound itself is rl/staleness.py's. Both keep the run state a recover checkpoint records current:
batches (those the finished steps took, or under streaming those taken from the loader) and, under
streaming, pending: the prompts taken but not trained (in flight, finished, or waiting), which a
resumed run generates again first, so no prompt is lost or trained twice.

    rollout = make_rollout(cfg.ppo, cfg.rollout, cfg.dataset, cfg.seed, job, workers, weights, state, log)
    got = rollout.gather()       # a rl.sample.Gathered: the step's groups, loads, staleness
    ...                          # train, push the new weights
    rollout.after_push()
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray

from areal_kit.rl.algo.batch import informative_groups, sample_seed
from areal_kit.rl.sample import Gathered, Generated, Sample
from areal_kit.rl.staleness import Staleness

if TYPE_CHECKING:
    from areal_kit.config.dataset import DatasetConfig
    from areal_kit.config.rollout import RolloutConfig
    from areal_kit.config.schema import PPOConfig
    from areal_kit.rl.driver.groups import Workers
    from areal_kit.rl.driver.job import Job, RunState
    from areal_kit.rl.driver.weight_sync import WeightSync
    from areal_kit.runlog import RunLogger


class Rollout(ABC):
    """What the controller asks of the rollout, either mode. Both keep the run state's batches (and
    pending) what a recover checkpoint written after after_push must record. Each reads its config
    sections: ppo (the staleness bound, dynamic sampling), rollout (the mode; stream's max_restarts),
    dataset (train_bs_n_seqs, a step's groups) and the run's seed (each prompt's sample seed)."""

    def __init__(self, ppo: PPOConfig, rollout: RolloutConfig, dataset: DatasetConfig, seed: int, job: Job,
                 workers: Workers, weights: WeightSync, state: RunState,
                 log: RunLogger | None = None) -> None:
        self.job, self.workers, self.weights, self.state, self.log = job, workers, weights, state, log
        self.ppo, self.seed = ppo, seed
        self.max_restarts = rollout.max_restarts  # stream mode: regenerations before a group is held
        self.staleness = Staleness.of(ppo)
        self.need = dataset.train_bs_n_seqs

    @abstractmethod
    def gather(self) -> Gathered:
        """The next step's samples, with the weight loads it waited for."""

    @abstractmethod
    def after_push(self) -> None:
        """A step's new weights are pushed (state.version and global_step count it)."""


def make_rollout(ppo: PPOConfig, rollout: RolloutConfig, dataset: DatasetConfig, seed: int, job: Job,
                 workers: Workers, weights: WeightSync, state: RunState, log: RunLogger | None) -> Rollout:
    """The rollout of rollout.mode, continuing `state` (a resumed run's batches and pending)."""
    kind = StreamRollout if rollout.mode == "stream" else BatchRollout
    return kind(ppo, rollout, dataset, seed, job, workers, weights, state, log)


# ------------------------------------------------------------------ batch mode
@dataclass
class Batch:
    """One batch of prompts' generation, queued on the engines."""

    epoch: int
    epoch_step: int
    handles: list  # the engines' generate calls
    loads: list  # the weight loads queued before them: a failed load must never feed training


class BatchRollout(Rollout):
    def __init__(self, ppo: PPOConfig, rollout: RolloutConfig, dataset: DatasetConfig, seed: int, job: Job,
                 workers: Workers, weights: WeightSync, state: RunState,
                 log: RunLogger | None = None) -> None:
        super().__init__(ppo, rollout, dataset, seed, job, workers, weights, state, log)
        self.queue: deque[Batch] = deque()
        self.dispatched = state.batches  # batches submitted to the engines: the next one's sample seeds
        self._short_logged = False  # a dynamic-sampling step that could not fill its batch was logged

    def after_push(self) -> None:
        """Nothing: the engines run their queued load before the next queued generation."""

    def gather(self) -> Gathered:
        """The step's samples: one batch, or under ppo.dynamic_sampling as many batches as it takes
        (up to dynamic_sampling_max_rounds more) to hold train_bs_n_seqs informative groups."""
        p, need = self.ppo, self.need
        got: Gathered | None = None
        keep: list[list[Sample]] = []  # the informative groups so far
        first: list[Sample] = []
        while True:
            self._fill()
            batch = self.queue.popleft()
            self.state.batches += 1
            outs, loads, stale, wait_time = self._collect(batch)
            samples = [s for o in outs for s in o.samples]
            gen_time = max(o.gen_time for o in outs)
            if got is None:
                got = Gathered(batch.epoch, batch.epoch_step, outs, loads, samples, stale, wait_time, gen_time)
                first = samples
            else:
                got.outs, got.loads, got.samples = got.outs + outs, got.loads + loads, got.samples + samples
                got.stale, got.rounds = max(got.stale, stale), got.rounds + 1
                got.wait_time, got.gen_time = got.wait_time + wait_time, got.gen_time + gen_time
            if not p.dynamic_sampling:
                return got
            informative, dropped = informative_groups(samples)
            keep, got.dropped = keep + informative, got.dropped + dropped
            if len(keep) >= need or got.rounds >= p.dynamic_sampling_max_rounds:
                break
        got.kept = min(len(keep), need)
        if keep:
            # Fresh group numbers: the same prompt may come twice (an epoch boundary between rounds).
            got.picked = [replace(s, group=i) for i, g in enumerate(keep[:need]) for s in g]
        elif got.rounds:  # not one informative group: the step trains on its first batch
            got.picked = first
        if len(keep) < need and not self._short_logged and self.log is not None:  # built without a log: unsaid
            self._short_logged = True
            self.log.warning(f"Dynamic sampling: global step {self.state.global_step + 1} has {len(keep)} of {need} "
                             f"informative groups after {got.rounds} extra round(s) "
                             "(ppo.dynamic_sampling_max_rounds); it trains on "
                             f"{'them' if keep else 'its first batch'}. "
                             "Further short steps are counted in dynamic/kept_groups, not logged.")
        return got

    def _fill(self) -> None:
        """Queue generations as far ahead of training as the staleness bound lets them run, never
        more than the steps left to train can take (a step takes at least one)."""
        left = self.job.total_steps - self.state.global_step
        while len(self.queue) < self.staleness.batches_in_flight and len(self.queue) < left:
            epoch, epoch_step, rows = self.job.loader.next_batch()
            rows = [{**r, "seed": sample_seed(self.seed, self.dispatched, i)} for i, r in enumerate(rows)]
            self.dispatched += 1
            # Engines run calls in order, so the loads queued so far finish before this generation starts.
            self.queue.append(Batch(epoch, epoch_step, self.workers.engines.submit(rows), self.weights.in_flight))

    def _collect(self, batch: Batch) -> tuple[list[Generated], list[dict], int, float]:
        """The batch's generations and the weight loads before them (a failed one surfaces at once)."""
        t0 = time.time()
        got = self.workers.watchdog.wait("generate", batch.loads + batch.handles)
        loads, outs = got[:len(batch.loads)], got[len(batch.loads):]
        oldest = min(s.version for o in outs for s in o.samples)
        if self.staleness.too_stale(oldest, at=self.state.version):
            # The queueing in _fill makes this impossible; guard the invariant anyway.
            raise RuntimeError(f"sample staleness {self.state.version - oldest} exceeds max_head_offpolicyness "
                               f"{self.staleness.k}")
        return outs, loads, self.state.version - oldest, time.time() - t0


# ------------------------------------------------------------------ stream mode
@dataclass
class Prompt:
    """One prompt taken from the loader: which batch of the run and which row of it."""

    batch: int
    index: int
    epoch: int
    epoch_step: int
    row: dict
    ticket: int | None = None  # the weight version at its first submission: its engine priority
    attempt: int = 0  # the weight version at its latest submission
    restarts: int = 0  # how often it finished too stale and was generated again


class StreamRollout(Rollout):
    def __init__(self, ppo: PPOConfig, rollout: RolloutConfig, dataset: DatasetConfig, seed: int, job: Job,
                 workers: Workers, weights: WeightSync, state: RunState,
                 log: RunLogger | None = None) -> None:
        super().__init__(ppo, rollout, dataset, seed, job, workers, weights, state, log)
        self.capacity = self.staleness.batches_in_flight * self.need
        self.waiting: deque[Prompt] = deque(self._prompt(b, i) for b, i in state.pending)
        self.flight: dict = {}  # object ref -> (Prompt, engine index)
        self.finished: deque[tuple[Prompt, Generated]] = deque()
        self.load = [0] * len(workers.engines)  # groups in flight per engine

    def _prompt(self, batch: int, index: int, taken: tuple | None = None) -> Prompt:
        """Row `index` of the run's batch `batch` (`taken`: that batch as next_batch gave it)."""
        epoch, step, rows = taken or self.job.loader.batch_at(batch)
        row = {**rows[index], "seed": sample_seed(self.seed, batch, index)}
        return Prompt(batch, index, epoch, step, row)

    # ------------------------------------------------------------ submitting
    def fill(self, taken: int = 0) -> None:
        """Submit prompts while fewer than the capacity are in flight or finished and untrained
        (`taken`: those this step already holds), never more than the steps left to train can take."""
        left = (self.job.total_steps - self.state.global_step) * self.need
        cap = self.capacity if self.ppo.dynamic_sampling else min(self.capacity, left)
        while len(self.flight) + len(self.finished) + taken < cap:
            if not self.waiting:
                self._take_batch()
            p = self.waiting.popleft()
            p.attempt = self.state.version
            if p.ticket is None:
                p.ticket = p.attempt
            engine = min(range(len(self.load)), key=self.load.__getitem__)
            priority = -1 if self._held(p) else p.ticket  # a held group before every other
            self.flight[self.workers.engines.submit_group(p.row, engine, priority)] = (p, engine)
            self.load[engine] += 1

    def after_push(self) -> None:
        """The step's groups no longer count, so the engines get their successors now, not at the
        next gather; a checkpoint written now names them pending. Nothing after the last step."""
        if self.state.global_step >= self.job.total_steps:
            return
        self.fill()
        self._record_pending()

    def _take_batch(self) -> None:
        b = self.state.batches
        taken = self.job.loader.next_batch()  # keeps the loader's epoch and used ids current
        self.state.batches += 1
        self.waiting.extend(self._prompt(b, i, taken) for i in range(len(taken[2])))

    # ------------------------------------------------------------ taking
    def _next(self) -> tuple[Prompt, Generated]:
        """The next finished group, waiting for one under the watchdog's bound for a group."""
        if not self.finished:
            dog = self.workers.watchdog
            t0, bound = time.monotonic(), dog.bound("stream")
            refs = list(self.flight)
            done, _ = ray.wait(refs, num_returns=1, timeout=bound)
            if not done and bound is not None:  # timed out (without a bound ray.wait waits for one)
                dog.hang("stream", refs, time.monotonic() - t0, bound)
            dog.record("stream", time.monotonic() - t0)
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref, out in zip(done, ray.get(done)):  # a failed generation raises here
                p, engine = self.flight.pop(ref)
                dog.forget(ref)
                self.load[engine] -= 1
                self.finished.append((p, out))
        return self.finished.popleft()

    def _held(self, prompt: Prompt) -> bool:
        """Regenerated more than rollout.max_restarts times: generated first, and waited for by the
        step that is its last chance."""
        return prompt.restarts > self.max_restarts

    def _due(self, prompt: Prompt) -> bool:
        """A held group whose last chance within the bound is this step."""
        return self._held(prompt) and self.staleness.last_chance(prompt.attempt, at=self.state.version)

    def _waiting_for_held(self) -> bool:
        return any(self._due(q) for q, _ in [*self.flight.values(), *self.finished])

    def gather(self) -> Gathered:
        """The step's groups: the first train_bs_n_seqs to finish fresh enough (under dynamic
        sampling: informative), and every held group whose last chance this step is, waited for;
        in the order they were taken from the loader. Then the last push's loads: streaming engines
        take weights while they generate, so it must be loaded everywhere before the next push
        pauses them (and a failed load stops the run here)."""
        t0, version, p = time.time(), self.state.version, self.ppo
        limit = self.need * (1 + (p.dynamic_sampling_max_rounds if p.dynamic_sampling else 0))
        taken: list[tuple[Prompt, Generated]] = []
        keep: list[tuple[Prompt, Generated]] = []
        later: list[tuple[Prompt, Generated]] = []  # finished, set aside for the next step
        dropped, restarted = 0, 0
        while (len(keep) < self.need and len(taken) < limit) or self._waiting_for_held():
            self.fill(len(keep) + len(later))  # those set aside for the next step count too
            prompt, out = self._next()
            if self.staleness.too_stale(min(s.version for s in out.samples), at=version):
                prompt.restarts += 1  # began too long ago: generate it again
                self.waiting.appendleft(prompt)
                restarted += 1
                continue
            if len(keep) >= self.need:  # full: waiting for a held group only
                if not self._due(prompt):
                    later.append((prompt, out))
                    continue
                room = [i for i, (q, _) in enumerate(keep) if not self._due(q)]
                if room:  # the newest kept group makes room, and is trained next step
                    later.append(keep.pop(room[-1]))
            taken.append((prompt, out))
            if not p.dynamic_sampling or informative_groups(out.samples)[0]:
                keep.append((prompt, out))
            else:
                dropped += 1
        self.finished.extendleft(reversed(later))
        taken = [po for po in taken if all(po is not x for x in later)]
        if not keep:  # not one informative group: train on what came
            keep = taken[:self.need]
        keep.sort(key=lambda po: (po[0].batch, po[0].index))
        self._record_pending()
        got = self._gathered(taken, keep, dropped, restarted, time.time() - t0)
        got.loads = self.weights.wait()
        got.metrics["stream/aborted"] = sum(x.get("aborted", 0) for x in got.loads)
        return got

    def _record_pending(self) -> None:
        """What a recover checkpoint written now must generate again: every prompt not trained."""
        rest = [p for p, _ in self.flight.values()] + [p for p, _ in self.finished] + list(self.waiting)
        self.state.pending = sorted([p.batch, p.index] for p in rest)

    def _gathered(self, taken: list[tuple[Prompt, Generated]], keep: list[tuple[Prompt, Generated]], dropped: int,
                  restarted: int, wait_time: float) -> Gathered:
        # The step is named after the newest batch it trains on: where the loader stands, give or
        # take the capacity (an older prompt may come late, restarted).
        first = max((p for p, _ in keep), key=lambda p: (p.batch, p.index))
        outs = [out for _, out in taken]
        samples = [s for out in outs for s in out.samples]
        train = [replace(s, group=i) for i, (_, out) in enumerate(keep) for s in out.samples]
        got = Gathered(first.epoch, first.epoch_step, outs, [], samples,
                       stale=max(self.state.version - s.version for s in train), wait_time=wait_time,
                       gen_time=max(o.gen_time for o in outs), picked=train)
        if self.ppo.dynamic_sampling:
            got.rounds = max(0, -(-len(taken) // self.need) - 1)
            got.dropped, got.kept = dropped, len(keep)
        got.metrics = self._metrics(train, restarted, held=sum(self._held(q) for q, _ in keep))
        return got

    def _metrics(self, train: list, restarted: int, held: int) -> dict:
        v = self.state.version
        seq = [v - s.version for s in train]
        tok = [v - x for s in train for x in (s.versions or [s.version] * len(s.output_ids))]
        occupancy = [x for x in self.workers.engines.occupancy() if x is not None]
        return {"stream/interrupted": sum(s.interrupted for s in train), "stream/restarted": restarted,
                "stream/held": held,
                "stream/staleness_min": min(seq), "stream/staleness_mean": statistics.fmean(seq),
                "stream/staleness_max": max(seq), "stream/token_staleness_min": min(tok),
                "stream/token_staleness_mean": statistics.fmean(tok), "stream/token_staleness_max": max(tok),
                "stream/occupancy": statistics.fmean(occupancy) if occupancy else 0.0,
                "stream/in_flight": len(self.flight)}

"""Streaming rollout, the controller's side: prompts go to the engines one group at a time as
capacity allows, and a step trains on the first groups to finish (rollout.mode=stream).

Staleness is bounded per sample, as AReaL bounds it. At most (1 + k) x train_bs_n_seqs prompts
(k = ppo.max_head_offpolicyness) are in flight or finished and not yet trained, and a step at
weight version v trains only on groups whose first token was sampled at version v - k or later:
a group too stale (a long answer that outlived k updates; the engines abort it at that update) is
generated again from its prompt, never trained. Each group runs at the priority of the version it
was first submitted at, so when the engines' slots run short the oldest groups (one generated again
included) run first and make the bound. A group that finished too stale more than
rollout.max_restarts times is held: generated before any other, and the step that is its last
chance within the bound waits for it, so no prompt is regenerated forever (a long answer would
otherwise never be trained). k = 0 is synchronous: a batch in flight, trained
when all of it is in. The engines get new prompts as soon as a step's weights are pushed (refill).

Under ppo.dynamic_sampling the groups whose answers all got the same task reward are dropped and
more are taken from the stream (at most dynamic_sampling_max_rounds batches' worth more).

A recover checkpoint records which prompts were taken from the loader but not trained (in flight,
finished, or waiting); a resumed run generates them again first, so no prompt is lost or trained twice.

    stream = Stream(cfg, job, workers, state)
    got = stream.gather()        # a rl.sample.Gathered, as the batch-mode queue gives
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, replace

import ray

from areal_kit.rl.algo.batch import informative_groups, sample_seed
from areal_kit.rl.sample import Batch, Gathered, Generated


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


class Stream:
    def __init__(self, cfg, job, workers, state):
        self.cfg, self.job, self.workers, self.state = cfg, job, workers, state
        self.k, self.need = cfg.ppo.max_head_offpolicyness, cfg.dataset.train_bs_n_seqs
        self.capacity = (1 + self.k) * self.need
        self.waiting: deque[Prompt] = deque(self._prompt(b, i) for b, i in state.pending)
        self.flight: dict = {}  # object ref -> (Prompt, engine index)
        self.finished: deque[tuple[Prompt, Generated]] = deque()
        self.load = [0] * len(workers.engines)  # groups in flight per engine

    def _prompt(self, batch: int, index: int, taken: tuple | None = None) -> Prompt:
        """Row `index` of the run's batch `batch` (`taken`: that batch as next_batch gave it)."""
        epoch, step, rows = taken or self.job.loader.batch_at(batch)
        row = {**rows[index], "seed": sample_seed(self.cfg.seed, batch, index)}
        return Prompt(batch, index, epoch, step, row)

    # ------------------------------------------------------------ submitting
    def fill(self, taken: int = 0) -> None:
        """Submit prompts while fewer than the capacity are in flight or finished and untrained
        (`taken`: those this step already holds), never more than the steps left to train can take."""
        left = (self.job.total_steps - self.state.global_step) * self.need
        cap = self.capacity if self.cfg.ppo.dynamic_sampling else min(self.capacity, left)
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

    def refill(self) -> None:
        """After a step's weights are pushed: its groups no longer count, so the engines get their
        successors now, not at the next gather; a checkpoint written now names them pending."""
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
            if not done:
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
        return prompt.restarts > self.cfg.rollout.max_restarts

    def _due(self, prompt: Prompt) -> bool:
        """A held group whose last chance within the bound is this step."""
        return self._held(prompt) and prompt.attempt <= self.state.version - self.k

    def _waiting_for_held(self) -> bool:
        return any(self._due(q) for q, _ in [*self.flight.values(), *self.finished])

    def gather(self) -> Gathered:
        """The step's groups: the first train_bs_n_seqs to finish fresh enough (under dynamic
        sampling: informative), and every held group whose last chance this step is, waited for;
        in the order they were taken from the loader."""
        t0, version, p = time.time(), self.state.version, self.cfg.ppo
        limit = self.need * (1 + (p.dynamic_sampling_max_rounds if p.dynamic_sampling else 0))
        taken, keep, later, dropped, restarted = [], [], [], 0, 0
        while (len(keep) < self.need and len(taken) < limit) or self._waiting_for_held():
            self.fill(len(keep) + len(later))  # those set aside for the next step count too
            prompt, out = self._next()
            if version - min(s.version for s in out.samples) > self.k:  # began too long ago: generate it again
                prompt.restarts += 1
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
        return self._gathered(taken, keep, dropped, restarted, time.time() - t0)

    def _record_pending(self) -> None:
        """What a recover checkpoint written now must generate again: every prompt not trained."""
        rest = [p for p, _ in self.flight.values()] + [p for p, _ in self.finished] + list(self.waiting)
        self.state.pending = sorted([p.batch, p.index] for p in rest)

    def _gathered(self, taken, keep, dropped: int, restarted: int, wait_time: float) -> Gathered:
        # The step is named after the newest batch it trains on: where the loader stands, give or
        # take the capacity (an older prompt may come late, restarted).
        first = max((p for p, _ in keep), key=lambda p: (p.batch, p.index))
        outs = [out for _, out in taken]
        samples = [s for out in outs for s in out.samples]
        train = [replace(s, group=i) for i, (_, out) in enumerate(keep) for s in out.samples]
        got = Gathered(Batch(first.epoch, first.epoch_step, [], []), outs, [], samples,
                       stale=max(self.state.version - s.version for s in train), wait_time=wait_time,
                       gen_time=max(o.gen_time for o in outs), picked=train)
        if self.cfg.ppo.dynamic_sampling:
            got.rounds = max(0, -(-len(taken) // self.need) - 1)
            got.dropped, got.kept = dropped, len(keep)
        got.stream = self._metrics(train, restarted, held=sum(self._held(q) for q, _ in keep))
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

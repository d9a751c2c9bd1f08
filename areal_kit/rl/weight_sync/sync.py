"""The weight sync, driven from the loop: after every step, the new weights reach every engine.

Both ends live in this package: the trainer's (sender.py, a mixin of the trainer worker), the
engine's (receiver.py, and vllm_ext.py inside vLLM's worker processes), and the transport they
share (transport.py: a standalone process group, bucketed broadcasts, shared-memory regions).
WeightSync is the only part the loop sees:

    sync = WeightSync(cfg, trainers, engines)
    how = sync.connect()          # once: join the group (and map shared memory on one CPU node)
    sync.push(version)            # after each step; queues the sync, waits for nothing
    loads = sync.in_flight        # the engines' loads still running (the next generation waits for them)

weight_sync=disk saves a Hugging Face folder instead and the engines reload it. On shared CUDA GPUs
auto is ipc (colocated.py: each rank hands the engine worker on its GPU a buffer), with disk as
the fallback `connect` chooses when an engine cannot map it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import ray

from areal_kit import hardware
from areal_kit.config.rollout import streaming
from areal_kit.rl import lora
from areal_kit.rl.weight_sync import colocated, ipc

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig
    from areal_kit.rl.actor_groups import Engines as EngineGroup
    from areal_kit.rl.actor_groups import Trainers as TrainerGroup


class WeightSync:
    def __init__(self, cfg: TrainConfig, trainers: TrainerGroup, engines: EngineGroup) -> None:
        self.cfg, self.trainers, self.engines = cfg, trainers, engines
        self.mode = colocated.sync_mode(cfg)  # the one place that chooses
        self.shared = False  # engines on the trainer's node take weights through shared memory
        self.in_flight: list = []  # the send and the engines' loads of the last push, still running

    def connect(self) -> str:
        """Join trainer rank 0 and every engine worker into the sync group; how weights will travel."""
        if self.mode == "ipc":
            why = colocated.probe(self.trainers, self.engines)
            how = ipc.medium(hardware.detect().is_cpu)
            if not why:
                return f"{how}, each trainer rank's buffer to the engine worker on its device"
            self.mode = "disk"
            return f"save + reload ({how} cannot serve this layout: {why})"
        if self.mode == "disk":
            return "save + reload"
        # A LoRA adapter is megabytes, and no engine parameter of its own: it is broadcast.
        adapter = lora.sends_adapter(self.cfg)
        self.shared, how = _connect(self.trainers, self.engines, shared=self.mode == "auto" and not adapter)
        return f"LoRA adapter only, {how}" if adapter else how

    def push(self, version: int, wait_engines: bool = False) -> float:
        """New weights to every engine; seconds the driver spent on it.

        Nothing here waits for the trainer: its calls run in order, so the staging of the weights
        queued here runs before its next step, and the send waits for the staging. The send and
        the engines' loads run while the trainer goes on to its next step, whose optimizer step
        waits for the send. Engines run calls in order, so a load queued behind a generation waits
        for it, and the next generation waits for the load. weight_sync=disk saves the folder first.
        """

        t0 = time.time()
        trainers, engines = self.trainers.actors, self.engines.actors
        if self.mode == "ipc":
            # The loop waits for every chunk (the buffer is refilled only once each engine read it);
            # on shared GPUs the trainer waits for the sync anyway (turns.after_train).
            self.in_flight = colocated.push(self.trainers, self.engines, version)
        elif self.mode != "disk":
            shared = self.shared and self.mode == "auto"
            staged = [t.stage_weights.remote() for t in trainers]  # every rank: ZeRO-3 gathers
            # ready_for_weights queues behind a batch engine's pending generations (a streaming
            # engine pauses its own): the send starts once the weights are staged and every engine
            # is free to receive, on the trainer's second thread while it trains on, and so does
            # every engine's receive, not as soon as its own generation ends. No one waits inside
            # the collective for a generation, the slowest engine's included: the group's timeout
            # bounds the transfer. With shared memory the trainer writes into the engines'
            # parameters from then on: safe, as each engine's next call is the receive_weights
            # queued here, or its generations are paused.
            paused = [e.ready_for_weights.remote() for e in engines]
            ready = [*staged, *paused]
            send = trainers[0].send_weights.options(concurrency_group="weights").remote(*ready, shared=shared)
            loads = [e.receive_weights.remote(version, *ready, shared=shared) for e in engines]
            self.in_flight = self.trainers.watchdog.label([send] + loads, [self.trainers.names[0]] + self.engines.names)
            if streaming(self.cfg):
                # The prompts submitted from now on must wait for the new weights, as a batch
                # engine's next generation waits for its queued load: the engines pause first.
                self.trainers.watchdog.wait("pause", self.trainers.watchdog.label(paused, self.engines.names))
        else:
            path = weight_sync_dir(self.cfg)
            # Under LoRA the adapter folder, or the merged model (actor.lora.sync); else the model.
            self.trainers.save_hf(path, merged=not lora.sends_adapter(self.cfg))
            loads = [e.load_from_disk.remote(path, version) for e in engines]
            self.in_flight = self.trainers.watchdog.label(loads, self.engines.names)
        if wait_engines:
            self.wait()
        return time.time() - t0

    def wait(self) -> list[dict]:
        """Until the last push is loaded everywhere; what each load reported."""
        return self.trainers.watchdog.wait("weight sync", self.in_flight)


def weight_sync_dir(cfg: TrainConfig) -> str:
    """Where weight_sync=disk saves the weights each step (the engines reload them from there)."""
    return os.path.join(cfg.fileroot, "cache", "weight_sync", cfg.experiment_name, cfg.trial_name)


def _connect(trainers: TrainerGroup, engines: EngineGroup, shared: bool = False) -> tuple[bool, str]:
    """Join trainer rank 0 and every rollout worker into the standalone sync group; with shared,
    try shared memory for CPU engines on the trainer's node (`share_memory`). Returns whether
    that worked and how the weights will travel, for the log."""

    backend = hardware.detect().dist_backend
    # Every rank joins the plan's gather (ZeRO-3); rank 0 returns it.
    plan = ray.get([t.sync_plan.remote() for t in trainers.actors])[0]
    host, port = ray.get(trainers.actors[0].address.remote())
    world = 1 + len(engines.actors) * engines.tp
    futs = [trainers.actors[0].init_sync.remote(host, port, world, backend, plan)]
    futs += [r.init_sync.remote(host, port, 1 + i * engines.tp, world, backend, plan)
             for i, r in enumerate(engines.actors)]
    ray.get(futs)
    how = f"broadcast over {backend}"
    if not (shared and backend == "gloo"):
        return False, how
    n, why = _share_memory(trainers, engines)
    if not n:
        return False, f"{how} ({why})"
    total = sum(len(b) for b in plan)
    return True, f"shared memory for {n} of {total} tensors" + (f", the rest {how}" if n < total else "")


def _share_memory(trainers: TrainerGroup, engines: EngineGroup) -> tuple[int, str]:
    """Engines on the trainer's node put their parameters in memory the trainer maps, and it
    writes new weights straight into them: no socket, no receive copy. Only when every engine
    can (a mixed sync would still have to broadcast those bytes). Returns (tensors shared, why
    none)."""

    regions = [r for rs in ray.get([r.share_weights.remote() for r in engines.actors]) for r in rs]
    why = [r["why"] for r in regions if "why" in r]
    if why:
        return 0, why[0]
    names = sorted(set.intersection(*(set(r["places"]) for r in regions)))
    if not names:
        return 0, "no tensor has a place in every engine"
    try:
        ray.get(trainers.actors[0].open_shared.remote(regions, names))
    except ray.exceptions.RayTaskError as e:
        return 0, str(e.cause)
    ray.get([r.use_shared.remote(names) for r in engines.actors])
    return len(names), ""

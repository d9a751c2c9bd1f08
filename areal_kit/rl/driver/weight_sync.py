"""The weight sync, driven from the loop: after every step, the new weights reach every engine.

Each process's half lives on its side: the driver's here, the trainer rank's in
rl/trainer/weight_send.py, the engine actor's in rl/engine/weight_receive.py, and the part inside
vLLM's worker processes in rl/vllm_worker/extension.py. What they share is rl/weight_sync/: the
wire (transport.py: a standalone process group, bucketed broadcasts, shared-memory regions), the
IPC buffers' format (ipc.py) and the choice of how weights travel (mode.py).
WeightSync is the only part the loop sees:

    sync = WeightSync(mode.choose(cfg), trainers, engines)   # the run's mode, LoRA, rollout mode, folder
    how = sync.connect()          # once: join the group (and map shared memory on one CPU node)
    sync.push(version)            # after each step; queues the sync, waits for nothing
    loads = sync.in_flight        # the engines' loads still running (the next generation waits for them)

weight_sync=disk saves a Hugging Face folder instead and the engines reload it. On shared CUDA GPUs
auto is ipc: every trainer rank stages the whole model (ZeRO-3 gathers it on every rank), copies
it a chunk at a time into one buffer it exports once (CUDA IPC), and the engine worker on the same
GPU maps that buffer and loads the chunk's views straight into its parameters: no file, no host
copy, no NCCL group (NCCL takes no two ranks of one communicator on one GPU). On CPU
weight_sync=ipc runs the same calls over the same process boundaries, each buffer a shared-memory
region. `connect` probes first (`ipc_probe`): where an engine worker sits on a device without a
trainer rank, or cannot load a chunk at a time (a quantized model reloads whole), the run falls
back to disk and says why. The buffer lives only through a sync (the ranks' `ipc_end` frees it):
the sync runs with the engines' weights awake and their KV cache asleep, so it never sits beside
the generation turn the memory plan checks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray
from ray import ObjectRef

from areal_kit import hardware
from areal_kit.rl import lora
from areal_kit.rl.driver.groups import EngineGroup, TrainerGroup
from areal_kit.rl.engine.worker import RolloutWorker
from areal_kit.rl.trainer.worker import TrainerWorker
from areal_kit.rl.weight_sync import ipc

if TYPE_CHECKING:
    from areal_kit.rl.weight_sync.mode import SyncChoice


class WeightSync:
    def __init__(self, choice: SyncChoice, trainers: TrainerGroup, engines: EngineGroup) -> None:
        self.choice, self.trainers, self.engines = choice, trainers, engines
        self.mode = choice.mode  # mode.sync_mode's, the one place that chooses; connect may fall back to disk
        self.shared = False  # engines on the trainer's node take weights through shared memory
        # The send and the engines' loads of the last push, still running.
        self.in_flight: list[ObjectRef[dict[str, float]]] = []

    def connect(self) -> str:
        """Join trainer rank 0 and every engine worker into the sync group; how weights will travel."""
        if self.mode == "ipc":
            why = ipc_probe(self.trainers, self.engines)
            how = ipc.medium(hardware.detect().is_cpu)
            if not why:
                return f"{how}, each trainer rank's buffer to the engine worker on its device"
            self.mode = "disk"
            return f"save + reload ({how} cannot serve this layout: {why})"
        if self.mode == "disk":
            return "save + reload"
        # A LoRA adapter is megabytes, and no engine parameter of its own: it is broadcast.
        adapter = lora.sends_adapter(self.choice.lora)
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
        trainers, engines = self.trainers, self.engines
        if self.mode == "ipc":
            # The loop waits for every chunk (the buffer is refilled only once each engine read it);
            # on shared GPUs the trainer waits for the sync anyway (turns.after_train).
            self.in_flight = ipc_push(self.trainers, self.engines, version)
        elif self.mode != "disk":
            shared = self.shared and self.mode == "auto"
            staged = trainers.each(TrainerWorker.stage_weights)  # every rank: ZeRO-3 gathers
            # ready_for_weights queues behind a batch engine's pending generations (a streaming
            # engine pauses its own): the send starts once the weights are staged and every engine
            # is free to receive, on the trainer's second thread while it trains on, and so does
            # every engine's receive, not as soon as its own generation ends. No one waits inside
            # the collective for a generation, the slowest engine's included: the group's timeout
            # bounds the transfer. With shared memory the trainer writes into the engines'
            # parameters from then on: safe, as each engine's next call is the receive_weights
            # queued here, or its generations are paused.
            paused = engines.each(RolloutWorker.ready_for_weights)
            ready = [*staged, *paused]
            send = trainers.on_thread(0, "weights", TrainerWorker.send_weights, *ready, shared=shared)
            self.in_flight = [send, *engines.each(RolloutWorker.receive_weights, version, *ready, shared=shared)]
            if self.choice.streaming:
                # The prompts submitted from now on must wait for the new weights, as a batch
                # engine's next generation waits for its queued load: the engines pause first.
                trainers.watchdog.wait("pause", paused)
        else:
            path = self.choice.folder
            # Under LoRA the adapter folder, or the merged model (actor.lora.sync); else the model.
            self.trainers.save_hf(path, merged=not lora.sends_adapter(self.choice.lora))
            self.in_flight = engines.each(RolloutWorker.load_from_disk, path, version)
        if wait_engines:
            self.wait()
        return time.time() - t0

    def wait(self) -> list[dict[str, float]]:
        """Until the last push is loaded everywhere; what each load reported."""
        return self.trainers.watchdog.wait("weight sync", self.in_flight)


def _connect(trainers: TrainerGroup, engines: EngineGroup, shared: bool = False) -> tuple[bool, str]:
    """Join trainer rank 0 and every rollout worker into the standalone sync group; with shared,
    try shared memory for CPU engines on the trainer's node (`share_memory`). Returns whether
    that worked and how the weights will travel, for the log."""

    backend = hardware.detect().dist_backend
    # Every rank joins the plan's gather (ZeRO-3); rank 0 returns it.
    plan = ray.get(trainers.each(TrainerWorker.sync_plan))[0]
    assert plan is not None, "rank 0 plans the sync"
    host, port = ray.get(trainers.one(0, TrainerWorker.address))
    world = 1 + len(engines) * engines.tp
    ray.get([trainers.one(0, TrainerWorker.init_sync, host, port, world, backend, plan),
             *[engines.one(i, RolloutWorker.init_sync, host, port, 1 + i * engines.tp, world, backend, plan)
               for i in range(len(engines))]])
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

    regions = [r for rs in ray.get(engines.each(RolloutWorker.share_weights)) for r in rs]
    why = [r["why"] for r in regions if "why" in r]
    if why:
        return 0, why[0]
    names = sorted(set.intersection(*(set(r["places"]) for r in regions)))
    if not names:
        return 0, "no tensor has a place in every engine"
    try:
        ray.get(trainers.one(0, TrainerWorker.open_shared, regions, names))
    except ray.exceptions.RayTaskError as e:
        return 0, str(e.cause)
    ray.get(engines.each(RolloutWorker.use_shared, names))
    return len(names), ""


def ipc_probe(trainers: TrainerGroup, engines: EngineGroup) -> str:
    """'' when every engine worker can map the buffer of the trainer rank on its device; else why
    not (the fallback's log line). Each side reports its device's key (ipc.trainer_key); an engine
    worker also says why it cannot load a chunk at a time."""
    dog = trainers.watchdog
    trainer_keys = dog.wait("ipc probe", trainers.each(TrainerWorker.ipc_key))
    workers = [w for ws in dog.wait("ipc probe", engines.each(RolloutWorker.ipc_probe)) for w in ws]
    why = [w.why for w in workers if w.why]
    return why[0] if why else ipc.unreachable([w.uuid for w in workers], trainer_keys)


def ipc_push(trainers: TrainerGroup, engines: EngineGroup, version: int) -> list[ObjectRef[dict[str, float]]]:
    """The chunk loop: every rank fills chunk i of its buffer, every engine loads it, until done;
    then the ranks free the buffer. Returns the engines' last calls (their load reports)."""
    dog = trainers.watchdog
    starts = dog.wait("ipc start", trainers.each(TrainerWorker.ipc_start))
    handles = ipc.merge([s.handles for s in starts])
    n = starts[0].chunks
    loads: list[ObjectRef[dict[str, float]]] = []
    try:
        for i in range(n):
            filled = dog.wait("ipc chunk", trainers.each(TrainerWorker.ipc_fill, i))
            loads = engines.each(RolloutWorker.receive_ipc, version, handles, filled[0], i == 0, i == n - 1)
            dog.wait("ipc chunk", loads)  # read before the next fill
    finally:
        dog.wait("ipc end", trainers.each(TrainerWorker.ipc_end))
    return loads

"""Start Ray, place trainer and rollout actors by the allocation mode, wire the sync group.

GPU: a trainer rank takes one GPU, a rollout engine takes `tp` GPUs on one node. CPU: every "GPU"
of the allocation is a worker slot of one logical CPU, so `vllm.d2p1m1+d1p1m1` on a laptop gives
two vLLM engines and one DeepSpeed rank, the same actors a GPU cluster would get. Every worker's
place is reserved (rl/driver/placement.py) before the first one starts.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import ObjectRef

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.rollout import streaming
from areal_kit.errors import UserError
from areal_kit.procs import stat_fields
from areal_kit.rl.common.stacks import StackDumps
from areal_kit.rl.driver import placement
from areal_kit.rl.driver.client import Group
from areal_kit.rl.driver.watchdog import Watchdog
from areal_kit.rl.engine.worker import RolloutWorker
from areal_kit.rl.hallway import RecoverLoad, TrainReply
from areal_kit.rl.sample import Generated, TrainerRow
from areal_kit.rl.trainer.worker import TrainerWorker
from areal_kit.rl.weight_sync import ipc

if TYPE_CHECKING:
    from areal_kit.config.schema import TrainConfig


def worker_env(cfg: TrainConfig, cache_root: str) -> dict[str, str]:
    env = hardware.worker_env(cache_root)
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    env["PYTHONHASHSEED"] = str(cfg.seed)
    return env


def shard_batch(samples: list[TrainerRow], world: int) -> list[list[TrainerRow]]:
    """Each trainer rank's samples: round-robin over the samples sorted by answer length, longest
    first, so every rank gets a similar token count."""
    return [[samples[i] for i in idx] for idx in shard_indices(samples, world)]


def shard_indices(samples: list[TrainerRow], world: int) -> list[list[int]]:
    """Which samples (their index in the batch) each rank's shard holds, in the shard's order."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].output_ids))
    return [order[rank::world] for rank in range(world)]


class TrainerGroup(Group[TrainerWorker]):
    """The DeepSpeed ranks of the actor. Every call goes to every rank (their collectives need
    all of them) and returns rank 0's answer."""

    def __init__(self, actors: list[Any], watchdog: Watchdog) -> None:
        super().__init__(actors, watchdog, "trainer rank")

    def attention(self) -> str:
        return ray.get(self.one(0, TrainerWorker.attention))

    def train_step(self, samples: list[TrainerRow], trace: list[int] | None = None) -> TrainReply:
        """One step on the batch: each rank gets its own shard, one object in the store each, so
        no rank unpickles the samples of the others. trace: the samples (their index in the batch)
        whose per-token values the reply carries, each from the rank that trained it, by that index."""
        shards = shard_indices(samples, len(self))
        want = set(trace or ())
        refs = []
        for r, idx in enumerate(shards):
            mine = [j for j, i in enumerate(idx) if i in want]
            refs.append(self.one(r, TrainerWorker.train_step, [samples[i] for i in idx], mine or None))
        replies = self.watchdog.wait("train_step", refs)
        traces = {idx[j]: t for idx, reply in zip(shards, replies) for j, t in reply.traces.items()}
        return TrainReply(replies[0].stats, traces)

    def save_hf(self, path: str, merged: bool | None = None) -> None:
        """merged: under LoRA, the merged model rather than the adapter (None: actor.lora.save_merged)."""
        self.all(TrainerWorker.save_hf, path, merged)

    def save_recover(self, path: str) -> None:
        self.all(TrainerWorker.save_recover, path)

    def load_recover(self, path: str) -> RecoverLoad:
        """Every rank loads; rank 0's report."""
        return self.all(TrainerWorker.load_recover, path)[0]


class EngineGroup(Group[RolloutWorker]):
    """The rollout engines: rows are split evenly over them; generations are queued, not waited."""

    def __init__(self, actors: list[Any], watchdog: Watchdog, tp: int = 1) -> None:
        super().__init__(actors, watchdog, "rollout engine")
        self.tp = tp  # devices (vLLM workers) of each engine

    def _split(self, rows: list[dict]) -> list[tuple[int, list[dict]]]:
        n = len(self.actors)
        return [(i, rows[i::n]) for i in range(n) if rows[i::n]]

    def submit(self, rows: list[dict]) -> list[ObjectRef[Generated]]:
        """Queue a generation of every row; the handles to wait on with the watchdog."""
        return [self.one(i, RolloutWorker.generate, chunk) for i, chunk in self._split(rows)]

    def submit_group(self, row: dict, engine: int, priority: int = 0) -> ObjectRef[Generated]:
        """Streaming: queue one prompt's group on one engine (lower priority runs first); the handle to wait on."""
        return self.one(engine, RolloutWorker.generate, [row], priority)

    def occupancy(self) -> list[float | None]:
        """Streaming: each engine's mean share of busy slots since the last call."""
        return ray.get(self.each(RolloutWorker.occupancy), timeout=60)

    def evaluate(self, rows: list[dict], max_new_tokens: int, n_samples: int = 0) -> list[dict]:
        refs = [self.one(i, RolloutWorker.evaluate, chunk, max_new_tokens, n_samples) for i, chunk in self._split(rows)]
        return [r for part in self.watchdog.wait("evaluate", refs) for r in part]


@dataclass
class Workers:
    trainers: TrainerGroup
    engines: EngineGroup
    watchdog: Watchdog
    places: placement.Reservation | None = None
    engine_setups: list[ObjectRef[float]] | None = None  # the engines' setup calls, when create() made them already
    overhead_cores: list[int] | None = None  # cpu_cores=split: the trainer ranks' cores (see pin_overhead)
    unpin: dict[int, set[int]] = field(default_factory=dict)  # what pin_overhead changed: tid -> its cores before

    def actors(self) -> list[Any]:
        return self.trainers.actors + self.engines.actors

    def setup(self) -> dict[str, float]:
        """Start every trainer rank and engine in parallel; seconds the slowest of each took. Then
        every worker can dump its stacks for the watchdog. On shared GPUs the engines first: vLLM
        sizes its KV cache from the memory its GPU gains while it profiles, which a trainer rank
        loading beside it at the same time would make wrong."""
        if self.places is not None and self.places.layout.shared:
            te = self.watchdog.wait("setup", self.engines.each(RolloutWorker.setup))
            tt = self.watchdog.wait("setup", self.trainers.each(TrainerWorker.setup))
            t = tt + te
        else:
            engines = self.engine_setups or self.engines.each(RolloutWorker.setup)
            t = self.watchdog.wait("setup", self.trainers.each(TrainerWorker.setup) + engines)
        where = [g.one(i, StackDumps.arm_stacks, self.watchdog.stacks_dir, name)
                 for g in (self.trainers, self.engines) for i, name in enumerate(g.names)]
        pids = self.watchdog.arm(dict(zip(self.trainers.names + self.engines.names, ray.get(where, timeout=120),
                                          strict=True)))
        if self.overhead_cores:
            self.unpin = pin_overhead(self.overhead_cores, pids)
        n = len(self.trainers)
        return {"trainer_setup": max(t[:n]), "rollout_setup": max(t[n:])}

    def dead(self, timeout_s: float = 10) -> int:
        """How many actors are dead (a busy one, still running a call, is alive)."""

        refs = [a.__ray_ready__.remote() for a in self.actors()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        dead = 0
        for r in ready:
            try:
                ray.get(r)
            except ray.exceptions.RayActorError:
                dead += 1
        return dead

    def kill(self) -> None:
        for a in self.actors():
            ray.kill(a)
        # The driver and Ray's daemons get their cores back: a relaunch's new workers start from
        # the raylet's mask, and a driver in a longer-lived process (a test, a notebook) goes on.
        unpin_overhead(self.unpin)
        self.unpin = {}


def reserve(cfg: TrainConfig, plat: hardware.Platform) -> placement.Reservation:
    """Every worker's place on the joined Ray cluster, reserved: trainer ranks packed node by node,
    each engine's GPUs on one node; spread_roles keeps trainers and engines on different nodes."""
    placement.check_gpu_sharing(cfg, plat)
    alloc = parse_allocation(cfg.allocation_mode)
    return placement.reserve(placement.on_cluster(alloc, plat, cfg.spread_roles))


def create(cfg: TrainConfig, model_path: str, cache_root: str, total_steps: int, stacks_dir: str) -> Workers:
    plat = hardware.detect()
    alloc = parse_allocation(cfg.allocation_mode)
    places = reserve(cfg, plat)
    env = worker_env(cfg, cache_root)
    n_train = alloc.train_gpus
    cores = core_sets(cfg, n_train, alloc.gen.dp, alloc.gen.tp) if plat.is_cpu else None
    # Weight sends run on their own thread (TrainerWorker.send_weights), beside training. (The
    # ignores: ray.remote's typed overloads leave out the actor options it takes.)
    Trainer = ray.remote(concurrency_groups={"weights": 1})(TrainerWorker)  # type: ignore[call-overload]
    trainers = [Trainer.options(**places.trainer_options(r)).remote(
        r, n_train, cfg, model_path, _pinned(env, cores, [r]), total_steps) for r in range(n_train)]
    # A streaming engine serves one call per prompt group, as many at once as the controller keeps
    # in flight ((1 + max_head_offpolicyness) x train_bs_n_seqs at most), beside a weight load,
    # an eval and the watchdog's calls.
    threads = (1 + cfg.ppo.max_head_offpolicyness) * cfg.dataset.train_bs_n_seqs + 8 if streaming(cfg) else 1
    Rollout = ray.remote(max_concurrency=threads)(RolloutWorker)  # type: ignore[call-overload]
    tp = alloc.gen.tp
    # On shared GPUs each engine runs on its trainer ranks' GPUs, which Ray tells those ranks.
    gpus = placement.trainer_gpus(trainers) if places.layout.shared else None
    # The engines' processes start before anything waits on a trainer's setup: an engine takes longest to set up.
    rollouts = [Rollout.options(**places.engine_options(i)).remote(
        i, model_path, cfg, _on_gpus(_pinned(env, cores, range(n_train + i * tp, n_train + (i + 1) * tp)), gpus, i, tp,
                 alloc.kind != "decoupled"),
        tp) for i in range(alloc.gen.dp)]
    # An engine sets up longest, and needs no trainer: it starts as soon as its process is up, not
    # after the rendezvous below. On shared GPUs the engines set up alone first (Workers.setup).
    dog = Watchdog(cfg.exp_ctrl, stacks_dir)
    trainer_group, engine_group = TrainerGroup(trainers, dog), EngineGroup(rollouts, dog, tp)
    setups = None if places.layout.shared else engine_group.each(RolloutWorker.setup)
    # Rank 0's node hosts the DeepSpeed rendezvous; the port must be free there, not here.
    master, port = ray.get(trainer_group.one(0, TrainerWorker.address))
    ray.get(trainer_group.each(TrainerWorker.set_master, master, port))
    overhead = sorted({c for r in range(n_train) for c in cores[r]}) if cores else None
    return Workers(trainer_group, engine_group, dog, places, setups, overhead)


def _on_gpus(env: dict[str, str], gpus: list[str] | None, index: int, tp: int, shared: bool) -> dict[str, str]:
    """An engine's env where generation and training share devices: the trainer ranks beside it
    (each of its workers maps the IPC buffer of one: ipc.worker_key) and, on GPUs, CUDA_VISIBLE_DEVICES
    their GPUs."""
    if not shared:
        return env
    ranks = range(index * tp, (index + 1) * tp)
    env = {**env, ipc.SHARED_RANKS_ENV: ",".join(map(str, ranks))}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[r] for r in ranks)
    return env


def core_sets(cfg: TrainConfig, n_train: int, n_engines: int, tp: int) -> list[list[int]] | None:
    """The cores of each worker slot (trainer ranks, then each engine's tp ranks), or None when
    every worker shares every core (see cpu_cores in config/schema.py)."""
    mode = cfg.cpu_cores
    if mode == "auto":
        mode = "split" if cfg.ppo.max_head_offpolicyness > 0 and not cfg.ray_address else "shared"
    if mode == "shared":
        return None
    cores = sorted(os.sched_getaffinity(0))
    slots = n_train + n_engines * tp
    if len(cores) < slots:
        if cfg.cpu_cores == "split":
            raise UserError(f"cpu_cores=split needs a core per worker: {n_train} trainer rank(s) + {n_engines} "
                            f"engine(s) x tp {tp} = {slots}, this machine has {len(cores)}; use cpu_cores=shared")
        return None
    # Contiguous runs (neighbouring cores share caches and NUMA node); leftovers to the first slots.
    per, extra = divmod(len(cores), slots)
    bounds = [0]
    for s in range(slots):
        bounds.append(bounds[-1] + per + (s < extra))
    return [cores[a:b] for a, b in itertools.pairwise(bounds)]


def pin_overhead(cores: list[int], worker_pids: set[int]) -> dict[int, set[int]]:
    """cpu_cores=split, once the workers are up: the driver and the Ray daemons it started (every
    thread of each) move onto `cores`, the trainer ranks' cores, and leave the engines' cores to
    the engines. Overlapped, generation bounds the step and training waits for it, so the driver's
    and Ray's share of a step is taken from the side with time to spare. Set-up is over: the
    driver's imports and the engines' start no longer compete. The workers and what they started
    keep their own cores. Returns each moved thread's cores before, for Workers.kill to put back."""
    parents = {pid: int(f[1]) for pid, f in stat_fields().items()}
    ours, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.append(pid)
        todo += [c for c, p in parents.items() if p == pid and c not in worker_pids]
    before: dict[int, set[int]] = {}
    for pid in ours:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                before[tid] = os.sched_getaffinity(tid)
            except OSError:
                continue  # a thread that ended meanwhile
    _set_affinity({tid: set(cores) for tid in before})
    return before


def unpin_overhead(before: dict[int, set[int]]) -> None:
    """Put back what pin_overhead moved; the driver's threads started since get its main thread's cores."""
    main = before.get(os.getpid())
    if main:
        before = {**{int(t): main for t in os.listdir("/proc/self/task")}, **before}
    _set_affinity(before)


def _set_affinity(cores: dict[int, set[int]]) -> None:
    for tid, mask in cores.items():
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:
            pass  # a thread that ended meanwhile


def _pinned(env: dict[str, str], cores: list[list[int]] | None, slots: Iterable[int]) -> dict[str, str]:
    """A worker's env bound to its slots' cores: AREAL_CPU_CORES for a trainer rank (applied in its
    setup), VLLM_CPU_OMP_THREADS_BIND for an engine (one core list per tp rank)."""
    slots = list(slots)
    if cores is None:  # shared: each of an engine's tp ranks binds to every core
        bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
        if len(slots) > 1 and bind and "|" not in bind:
            return {**env, "VLLM_CPU_OMP_THREADS_BIND": "|".join([bind] * len(slots))}
        return env
    lists = [",".join(map(str, cores[s])) for s in slots]
    return {**env, "AREAL_CPU_CORES": ",".join(lists), "VLLM_CPU_OMP_THREADS_BIND": "|".join(lists)}

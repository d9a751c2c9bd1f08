"""Start Ray, place trainer and rollout actors by the allocation mode, wire the sync group.

GPU: a trainer rank takes one GPU, a rollout engine takes `tp` GPUs on one node. CPU: every "GPU"
of the allocation is a worker slot of one logical CPU, so `vllm.d2p1m1+d1p1m1` on a laptop gives
two vLLM engines and one DeepSpeed rank, the same actors a GPU cluster would get. Every worker's
place is reserved (rl/workers/placement.py) before the first one starts.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.errors import UserError
from areal_kit.rl.plan import check_gpu_sharing
from areal_kit.rl.workers import placement


def worker_env(cfg, cache_root: str) -> dict[str, str]:
    env = hardware.cpu_env(cache_root) if hardware.detect().is_cpu else {}
    env.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"))
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    env["PYTHONHASHSEED"] = str(cfg.seed)
    return env


def start_ray(cfg, n_slots: int) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # explicit: see DESIGN.md testbed facts
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray.is_initialized():
        return
    verbose = bool(os.environ.get("AREAL_VERBOSE"))
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, log_to_driver=verbose, logging_level="WARNING")
        return
    ncpu = max(n_slots, os.cpu_count() or 1) if hardware.detect().is_cpu else None
    ray.init(num_cpus=ncpu, include_dashboard=False, log_to_driver=verbose, logging_level="WARNING")


@dataclass
class Workers:
    trainers: list  # actor handles, rank order
    rollouts: list  # actor handles, one per engine
    gen_tp: int
    places: placement.Reservation | None = None


def reserve(cfg, plat) -> placement.Reservation:
    """Every worker's place on the joined Ray cluster, reserved: trainer ranks packed node by node,
    each engine's GPUs on one node; spread_roles keeps trainers and engines on different nodes."""
    check_gpu_sharing(cfg, plat)
    alloc = parse_allocation(cfg.allocation_mode)
    return placement.reserve(placement.on_cluster(alloc, plat, cfg.spread_roles))


def create(cfg, model_path: str, cache_root: str, total_steps: int) -> Workers:
    import ray

    from areal_kit.rl.workers.rollout import RolloutWorker
    from areal_kit.rl.workers.trainer import TrainerWorker

    plat = hardware.detect()
    alloc = parse_allocation(cfg.allocation_mode)
    places = reserve(cfg, plat)
    env = worker_env(cfg, cache_root)
    n_train = alloc.train_gpus
    cores = core_sets(cfg, n_train, alloc.gen.dp, alloc.gen.tp) if plat.is_cpu else None
    # Weight sends run on their own thread (TrainerWorker.send_weights), beside training.
    Trainer = ray.remote(concurrency_groups={"weights": 1})(TrainerWorker)
    trainers = [Trainer.options(**places.trainer_options(r)).remote(
        r, n_train, cfg, model_path, _pinned(env, cores, [r]), total_steps) for r in range(n_train)]
    # Rank 0's node hosts the DeepSpeed rendezvous; the port must be free there, not here.
    master, port = ray.get(trainers[0].address.remote())
    ray.get([t.set_master.remote(master, port) for t in trainers])
    Rollout = ray.remote(RolloutWorker)
    tp = alloc.gen.tp
    rollouts = [Rollout.options(**places.engine_options(i)).remote(
        i, model_path, cfg, _pinned(env, cores, range(n_train + i * tp, n_train + (i + 1) * tp)), tp)
        for i in range(alloc.gen.dp)]
    return Workers(trainers, rollouts, tp, places)


def core_sets(cfg, n_train: int, n_engines: int, tp: int) -> list[list[int]] | None:
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


def _pinned(env: dict[str, str], cores: list[list[int]] | None, slots) -> dict[str, str]:
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


def setup(workers: Workers) -> dict[str, float]:
    """Start every engine in parallel; seconds each took."""
    import ray

    t = ray.get([w.setup.remote() for w in workers.trainers] + [r.setup.remote() for r in workers.rollouts])
    return {"trainer_setup": max(t[:len(workers.trainers)]), "rollout_setup": max(t[len(workers.trainers):])}


def init_weight_sync(workers: Workers, shared: bool = False) -> tuple[bool, str]:
    """Join trainer rank 0 and every rollout worker into the standalone sync group; with shared,
    try shared memory for CPU engines on the trainer's node (`share_memory`). Returns whether
    that worked and how the weights will travel, for the log."""
    import ray

    backend = hardware.detect().dist_backend
    # Every rank joins the plan's gather (ZeRO-3); rank 0 returns it.
    plan = ray.get([t.sync_plan.remote() for t in workers.trainers])[0]
    host, port = ray.get(workers.trainers[0].address.remote())
    world = 1 + len(workers.rollouts) * workers.gen_tp
    futs = [workers.trainers[0].init_sync.remote(host, port, world, backend, plan)]
    futs += [r.init_sync.remote(host, port, 1 + i * workers.gen_tp, world, backend, plan)
             for i, r in enumerate(workers.rollouts)]
    ray.get(futs)
    how = f"broadcast over {backend}"
    if not (shared and backend == "gloo"):
        return False, how
    n, why = share_memory(workers)
    if not n:
        return False, f"{how} ({why})"
    total = sum(len(b) for b in plan)
    return True, f"shared memory for {n} of {total} tensors" + (f", the rest {how}" if n < total else "")


def share_memory(workers: Workers) -> tuple[int, str]:
    """Engines on the trainer's node put their parameters in memory the trainer maps, and it
    writes new weights straight into them: no socket, no receive copy. Only when every engine
    can (a mixed sync would still have to broadcast those bytes). Returns (tensors shared, why
    none)."""
    import ray

    regions = [r for rs in ray.get([r.share_weights.remote() for r in workers.rollouts]) for r in rs]
    why = [r["why"] for r in regions if "why" in r]
    if why:
        return 0, why[0]
    names = sorted(set.intersection(*(set(r["places"]) for r in regions)))
    if not names:
        return 0, "no tensor has a place in every engine"
    try:
        ray.get(workers.trainers[0].open_shared.remote(regions, names))
    except ray.exceptions.RayTaskError as e:
        return 0, str(e.cause)
    ray.get([r.use_shared.remote(names) for r in workers.rollouts])
    return len(names), ""

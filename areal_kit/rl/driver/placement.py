"""Where every worker runs: Ray placement groups for the whole layout, reserved before any worker starts.

A trainer rank takes one GPU, a rollout engine `tp` GPUs that must sit on one node (vLLM runs its
tensor-parallel workers as processes of the engine's actor, on the GPUs Ray gave that actor). On
CPU the same layout is counted in CPU slots: one per trainer rank, `tp` per engine.

`pack` lays the workers out over the nodes' free resources: engines first, each on one node (GPU:
the fullest node that still fits it, so whole nodes stay free for the trainers; CPU: the emptiest,
so engines share cores with as few others as possible), then trainer ranks packed onto as few
nodes as they fit, in rank order. Each engine gets a STRICT_PACK group of one bundle, each node's
trainer ranks a STRICT_PACK group of one bundle per rank, and every group is pinned to the node the
layout chose (a label selector on Ray's node id). So an impossible layout is an error at once,
with the per-node arithmetic, instead of a group Ray waits on forever; a feasible one is never lost
to the order in which Ray happens to place groups. `reserve` then waits for every group (with a
timeout) before the caller starts a worker.

    layout = placement.on_cluster(alloc, plat, spread_roles=False)   # joined Ray cluster
    places = placement.reserve(layout)
    Trainer.options(**places.trainer_options(rank)).remote(...)
    print("\\n".join(placement.on_nodes(alloc, plat, 4, 8).describe()))   # the dry run's view

Shared GPUs (a colocated or per-role allocation on GPU nodes, rl/driver/turns.py): each node's
trainer ranks take a bundle of one GPU and two CPUs, in runs of `tp` so an engine's GPUs stay on
one node, and engine i lives in the bundle of trainer rank i x tp, on no GPU of its own in Ray's
count: it is told the GPUs of ranks i x tp .. (i + 1) x tp - 1 (`trainer_gpus`), and takes turns
with them (vLLM's sleep mode).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_kit.errors import UserError
from areal_kit.rl import sharing

if TYPE_CHECKING:
    from areal_kit.config.alloc import Allocation
    from areal_kit.config.schema import TrainConfig
    from areal_kit.hardware import Platform

# How long a run waits for resources that are busy (a relaunch's killed workers hand theirs back
# within seconds), and then for its placement groups to be ready.
TIMEOUT_S = 30.0
# Ray leaves CUDA_VISIBLE_DEVICES unset in a worker whose environment has this set (some clusters
# set it for every worker). Our workers need it: DeepSpeed's rank uses cuda:0, and vLLM's
# tensor-parallel processes use cuda:0..tp-1 of what the engine's actor sees.
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NODE_ID_LABEL = "ray.io/node-id"
STRATEGY = "STRICT_PACK"
# A trainer rank's bundle on shared GPUs: its GPU, its CPU and the CPU of the engine beside it.
SHARED_BUNDLE: dict[str, float] = {"GPU": 1, "CPU": 2}


@dataclass(frozen=True)
class Node:
    id: str  # Ray node id ("" for a node of the configured cluster, in a dry run)
    name: str  # what messages call it: its IP, or "node 2" in a dry run
    free: dict[str, float]


@dataclass(frozen=True)
class Group:
    """One placement group: an engine (first = its index) or one node's trainer ranks (first = the lowest)."""

    role: str  # "trainer" | "engine"
    first: int
    bundles: tuple[dict[str, float], ...]
    node: int  # index into Layout.nodes


@dataclass
class Layout:
    unit: str  # "GPU" | "CPU": what an allocation's "GPU" is on this platform
    nodes: list[Node]
    groups: list[Group]
    tp: int
    shared: bool = False  # engines in the trainer ranks' bundles, on their GPUs (GPU nodes only)

    def trainer_bundle(self, rank: int) -> tuple[int, int]:
        """(group index, bundle index) of a trainer rank."""
        for g, group in enumerate(self.groups):
            if group.role == "trainer" and group.first <= rank < group.first + len(group.bundles):
                return g, rank - group.first
        raise KeyError(f"no trainer rank {rank} in the layout")

    def engine_group(self, index: int) -> int:
        return next(g for g, group in enumerate(self.groups) if group.role == "engine" and group.first == index)

    def engine_bundle(self, index: int) -> tuple[int, int]:
        """(group index, bundle index) of an engine: its own group, or on shared GPUs the bundle of
        the trainer rank on its first GPU."""
        return self.trainer_bundle(index * self.tp) if self.shared else (self.engine_group(index), 0)

    def describe(self) -> list[str]:
        """The placement the run requests: groups per node, their bundles and strategy."""
        lines = [(f"placement: {len(self.groups)} placement groups, each {STRATEGY} on one node, all reserved "
                  f"before any worker starts (within {TIMEOUT_S:g}s)")]
        for n, node in enumerate(self.nodes):
            mine = [g for g in self.groups if g.node == n]
            ranks = [g.first + i for g in mine if g.role == "trainer" for i in range(len(g.bundles))]
            engines = [g for g in mine if g.role == "engine"]
            parts = []
            if ranks:
                per = [g for g in mine if g.role == "trainer"]
                parts.append(f"{_who('trainer rank', ranks)}: {_count(len(per), 'group')} x "
                             f"{_count(len(ranks), 'bundle')} {_bundle(per[0].bundles[0])}")
            if engines:
                parts.append(f"{_who('engine', [g.first for g in engines])}: {_count(len(engines), 'group')} x "
                             f"1 bundle {_bundle(engines[0].bundles[0])}")
            if self.shared and ranks:
                parts.append(f"{_who('engine', range(ranks[0] // self.tp, ranks[-1] // self.tp + 1))} (tp "
                             f"{self.tp}) on those ranks' GPUs, taking turns with them (vLLM sleep mode)")
            lines.append(f"  {node.name}: " + ("; ".join(parts) or "nothing"))
        return lines


def bundles(unit: str, tp: int) -> tuple[dict[str, float], dict[str, float]]:
    """(a trainer rank's bundle, an engine's bundle). GPU: the rank's GPU or the engine's tp GPUs and
    the actor's CPU. CPU: a slot per rank, tp slots per engine (its tp worker processes)."""
    if unit == "GPU":
        return {"GPU": 1, "CPU": 1}, {"GPU": tp, "CPU": 1}
    return {"CPU": 1}, {"CPU": tp}


def unit_of(plat: Platform) -> str:
    return "CPU" if plat.is_cpu else "GPU"


def pack_shared(nodes: list[Node], n_train: int, n_engines: int, tp: int, held: str = "free ") -> Layout:
    """Trainer ranks on GPU nodes, runs of tp per node, each engine on its run's GPUs (see the
    module docstring); a UserError naming what does not fit."""
    if n_engines * tp != n_train:
        raise UserError(f"shared GPUs: {n_engines} engines x tp {tp} = {n_engines * tp} GPUs, but {n_train} trainer "
                        "ranks; expected one trainer rank on every generation GPU")
    free = [dict(n.free) for n in nodes]
    groups: list[Group] = []
    rank = 0
    for j in sorted(range(len(nodes)), key=lambda j: -_fits(free[j], SHARED_BUNDLE)):
        k = min(_fits(free[j], SHARED_BUNDLE) // tp * tp, n_train - rank)
        if k:
            _take(free[j], {r: v * k for r, v in SHARED_BUNDLE.items()})
            groups.append(Group("trainer", rank, (SHARED_BUNDLE,) * k, j))
            rank += k
    if rank < n_train:
        have = ", ".join(f"{n.free.get('GPU', 0):g}" for n in nodes)
        raise UserError(f"shared GPUs: {n_train} trainer ranks, each with a share of an engine of tp {tp} on its node, "
                        f"need {_amount(SHARED_BUNDLE, 'GPU')} and {SHARED_BUNDLE['CPU']:g} CPUs each, in runs of "
                        f"{tp} a node; {rank} fit; nodes have {held}GPUs {have}; change allocation_mode or free GPUs")
    groups.sort(key=lambda g: g.first)
    return Layout("GPU", list(nodes), groups, tp, shared=True)


def pack(nodes: list[Node], n_train: int, n_engines: int, tp: int, unit: str, spread_roles: bool = False,
         held: str = "free ", shared: bool = False) -> Layout:
    """Lay out n_train trainer ranks and n_engines engines of tp over the nodes' `free` resources
    (see the module docstring); a UserError naming what does not fit and what the nodes have.
    spread_roles: trainers on the first node(s), as many as their ranks need, engines on the rest.
    held: how messages describe the nodes' resources ("free " on a live cluster).
    shared: generation and training on the same GPUs (GPU nodes: pack_shared)."""
    if shared and unit == "GPU":
        return pack_shared(nodes, n_train, n_engines, tp, held)
    trainer_b, engine_b = bundles(unit, tp)
    free = [dict(n.free) for n in nodes]
    need = n_train + n_engines * tp

    def have(now: list[dict[str, float]]) -> str:
        return f"nodes have {held}{unit}s " + ", ".join(f"{f.get(unit, 0):g}" for f in now)

    total = sum(f.get(unit, 0) for f in free)
    if total < need:
        raise UserError(f"{n_train} trainer ranks + {n_engines} engines x tp {tp} need {need} {unit}s, "
                        f"{have(free)} ({total:g} in all); change allocation_mode or free {unit}s")
    trainer_nodes = engine_nodes = list(range(len(nodes)))
    if spread_roles:
        if len(nodes) < 2:
            raise UserError(f"spread_roles=true needs a Ray cluster of at least 2 nodes, found {len(nodes)}; "
                            "set spread_roles=false or join more nodes")
        k, room = 0, 0
        while room < n_train and k < len(nodes) - 1:
            room += _fits(free[k], trainer_b)
            k += 1
        trainer_nodes, engine_nodes = trainer_nodes[:k], engine_nodes[k:]
    engines: list[Group] = []
    for i in range(n_engines):
        fits = [j for j in engine_nodes if _fits(free[j], engine_b)]
        if not fits:
            after = f" (after {_who('engine', range(i))})" if i else ""
            raise UserError(f"engine {i} needs {_amount(engine_b, unit)} on one node (tensor parallel {tp}); "
                            f"{have(free)}{after}; change allocation_mode or free {unit}s")
        # Ties go to the later node: trainers then fill the cluster from its first node.
        if unit == "GPU":
            j = min(fits, key=lambda j: (free[j][unit], -j))
        else:
            j = max(fits, key=lambda j: (free[j][unit], j))
        _take(free[j], engine_b)
        engines.append(Group("engine", i, (engine_b,), j))
    trainers: list[Group] = []
    rank = 0
    for j in sorted(trainer_nodes, key=lambda j: -_fits(free[j], trainer_b)):
        k = min(_fits(free[j], trainer_b), n_train - rank)
        if k:
            _take(free[j], {r: v * k for r, v in trainer_b.items()})
            trainers.append(Group("trainer", rank, (trainer_b,) * k, j))
            rank += k
    if rank < n_train:
        where = f" on {_count(len(trainer_nodes), 'node')} (spread_roles)" if spread_roles else ""
        raise UserError(f"{n_train} trainer ranks need {_amount(trainer_b, unit)} each, {rank} fit{where}; "
                        f"{have(free)} after the engines; change allocation_mode or free {unit}s")
    # Engines are interchangeable: number them in node order, as the trainer ranks are.
    engines = [Group("engine", i, g.bundles, g.node)
               for i, g in enumerate(sorted(engines, key=lambda g: (g.node, g.first)))]
    return Layout(unit, list(nodes), trainers + engines, tp)


def on_nodes(alloc: Allocation, plat: Platform, n_nodes: int, per_node: int, spread_roles: bool = False) -> Layout:
    """The layout on a configured cluster of n_nodes x per_node free GPUs (CPU slots on CPU): the dry run's."""
    unit = unit_of(plat)
    free: dict[str, float]
    if unit == "CPU":
        # Roles that share GPUs (colocated, per-role) take a slot each on CPU (see start_ray).
        free = {unit: per_node * (alloc.gen_gpus + alloc.train_gpus) // alloc.total_gpus}
    else:  # a GPU node's CPUs are not in the configuration: assume one for every bundle
        free = {unit: per_node, "CPU": math.inf}
    nodes = [Node("", f"node {i + 1}", dict(free)) for i in range(n_nodes)]
    return pack(nodes, alloc.train_gpus, alloc.gen.dp, alloc.gen.tp, unit, spread_roles, held="",
                shared=alloc.kind != "decoupled")


def cluster_nodes(unit: str) -> tuple[list[Node], list[Node]]:
    """(nodes with their free resources, the same nodes with their total) of the joined Ray cluster,
    in address order, those without any `unit` left out."""

    alive = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get(unit, 0) > 0),
                   key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
    try:
        # Private, as in verl's resource check; Ray has no public per-node view without its dashboard.
        free = ray._private.state.available_resources_per_node()
    except AttributeError:
        free = {n["NodeID"]: n["Resources"] for n in alive}
    ips = [n["NodeManagerAddress"] for n in alive]
    names = [ip if ips.count(ip) == 1 else f"{ip} ({n['NodeID'][:8]})" for ip, n in zip(ips, alive)]
    now = [Node(n["NodeID"], name, dict(free.get(n["NodeID"], {}))) for n, name in zip(alive, names)]
    total = [Node(n["NodeID"], name, dict(n["Resources"])) for n, name in zip(alive, names)]
    return now, total


def on_cluster(alloc: Allocation, plat: Platform, spread_roles: bool = False, timeout_s: float | None = None) -> Layout:
    """The layout on the joined Ray cluster's free resources. A layout that its total resources
    cannot hold fails at once; one that only needs busy resources waits up to timeout_s for them."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    unit = unit_of(plat)
    release()  # a relaunch's last attempt holds its groups still: they are not other work
    args = (alloc.train_gpus, alloc.gen.dp, alloc.gen.tp, unit, spread_roles)
    shared = alloc.kind != "decoupled"
    deadline = time.monotonic() + timeout_s
    while True:
        now, total = cluster_nodes(unit)
        try:
            return pack(now, *args, shared=shared)
        except UserError as e:
            busy = e
        pack(total, *args, held="", shared=shared)  # raises when no wait could help
        if time.monotonic() >= deadline:
            raise UserError(f"{busy} (other work holds the rest; waited {timeout_s:.0f}s)")
        time.sleep(0.5)


@dataclass
class Reservation:
    """The reserved placement groups of a layout, and each worker's options for Ray."""

    layout: Layout
    groups: list = field(default_factory=list)  # ray PlacementGroup, one per layout group

    def trainer_options(self, rank: int) -> dict:
        g, b = self.layout.trainer_bundle(rank)
        return self._options(g, b, 1)

    def engine_options(self, index: int) -> dict:
        g, b = self.layout.engine_bundle(index)
        if not self.layout.shared:
            return self._options(g, b, self.layout.tp)
        # No GPU of its own in Ray's count (its trainer ranks hold them), and Ray must leave
        # CUDA_VISIBLE_DEVICES as the engine sets it: to its trainer ranks' GPUs (trainer_gpus).
        return {"num_cpus": 1, "num_gpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.groups[g], placement_group_bundle_index=b)}

    def _options(self, g: int, b: int, n_gpus: int) -> dict:
        opts: dict = {"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.groups[g], placement_group_bundle_index=b)}
        if self.layout.unit == "GPU":
            # Ray then sets CUDA_VISIBLE_DEVICES to exactly these GPUs, even where the cluster
            # asked it not to (see NOSET_CUDA_VISIBLE_DEVICES).
            opts.update(num_gpus=n_gpus, runtime_env={"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "0"}})
        return opts


_held: list = []  # this process's placement groups: a relaunch's reserve replaces the last attempt's


def release() -> None:
    """Remove the placement groups this process reserved (their workers go with them)."""

    while _held:
        remove_placement_group(_held.pop())  # a group of an earlier Ray session: a no-op


def reserve(layout: Layout, timeout_s: float | None = None) -> Reservation:
    """Create every group of the layout, each pinned to its node, and wait until all are ready;
    on timeout remove them and raise a UserError naming the groups that were not placed."""

    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    release()
    pgs = [placement_group(list(g.bundles), strategy=STRATEGY,
                           bundle_label_selector=[{NODE_ID_LABEL: layout.nodes[g.node].id}] * len(g.bundles))
           for g in layout.groups]
    _held.extend(pgs)
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        done = set(ready)
        missing = [_label(g) + f" on {layout.nodes[g.node].name}" for g, r in zip(layout.groups, refs)
                   if r not in done]
        release()
        now, _ = cluster_nodes(layout.unit)
        raise UserError(f"Ray did not place {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                        f"within {timeout_s:.0f}s; nodes have free {layout.unit}s "
                        + ", ".join(f"{n.free.get(layout.unit, 0):g}" for n in now))
    return Reservation(layout, pgs)


def _fits(free: dict[str, float], bundle: dict[str, float]) -> int:
    """How many such bundles fit in free."""
    return int(min(free.get(r, 0) // v for r, v in bundle.items()))


def _take(free: dict[str, float], demand: dict[str, float]) -> None:
    for r, v in demand.items():
        free[r] -= v


def _amount(bundle: dict[str, float], unit: str) -> str:
    return _count(bundle[unit], unit)


def _count(n: float, what: str) -> str:
    return f"{n:g} {what}" + ("" if n == 1 else "s")


def _bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {v:g}" for r, v in bundle.items()) + "}"


def _label(g: Group) -> str:
    return _who(g.role if g.role == "engine" else "trainer rank", range(g.first, g.first + len(g.bundles)))


def _who(what: str, indices: Iterable[int]) -> str:
    """engine 3, engines 0-7, trainer ranks 0, 2."""
    indices = list(indices)
    return f"{what}{'s' if len(indices) > 1 else ''} {_spans(indices)}"


def _spans(values: Iterable[int]) -> str:
    """0-7 for a run, 0, 2, 4 otherwise."""
    values = sorted(values)
    if not values:
        return ""
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 1:
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


def check_gpu_sharing(cfg: TrainConfig, plat: Platform) -> None:
    """Generation and training on the same GPUs (colocated or per-role allocations): on CPU nodes
    they share cores; on GPUs they take turns (rl/driver/turns.py), which refuses the settings
    that cannot (generation overlapping training, an NCCL broadcast within one GPU)."""
    sharing.check(cfg, plat)


def _gpu_ids(actor: object) -> str:
    """Run inside a trainer rank's actor (Ray's __ray_call__ passes it, unused): the GPU Ray gave
    it, as the node numbers them."""
    return ",".join(str(i) for i in ray.get_gpu_ids())


def trainer_gpus(trainers: list) -> list[str]:
    """Each trainer rank's GPU on its node, rank order (an engine on shared GPUs takes its ranks')."""
    return ray.get([t.__ray_call__.remote(_gpu_ids) for t in trainers])

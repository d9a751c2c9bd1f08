"""Placement of the 4-node presets on a real multi-node Ray cluster with 4 x 8 declared GPUs.

    .venv/bin/python -m pytest tests/integration/test_placement_ray.py

The cluster is real (ray.cluster_utils.Cluster: a raylet per node, on this machine); its GPUs are
declared, not present. The GPU branch of the placement is forced with AREAL_DEVICE=cuda in the
driver only, for groups.reserve, the function groups.create reserves with and takes each worker's
options from; the workers are replaced by a probe, which loads no model and reports where Ray put
it. One node's raylet runs with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, as some clusters
set it: the workers there must still see exactly their GPUs.
"""

import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config
from areal_kit.errors import UserError
from areal_kit.rl.driver import groups, placement

NODES, GPUS = 4, 8


def probe_class():
    """Stands in for TrainerWorker and RolloutWorker: where it runs and which GPUs it sees. Defined
    here, so that Ray ships it by value: its workers import neither this module nor torch."""

    class Probe:
        def where(self) -> dict:
            return {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                    "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    return ray.remote(Probe)


@pytest.fixture(scope="module")
def cluster():
    # The head is the first GPU node; no dashboard, and no idle workers started ahead (each probe
    # runs in a worker of its own, for its runtime_env): a raylet each, on a shared 2-core machine.
    system = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    node = {"num_cpus": GPUS, "num_gpus": GPUS}
    c = Cluster(initialize_head=True, head_node_args={
        **node, "include_dashboard": False, "_system_config": system,
        "env_vars": {placement.NOSET_CUDA_VISIBLE_DEVICES: "1"}})
    for _ in range(NODES - 1):
        c.add_node(**node, wait=False)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield {"noset_node": c.head_node.node_id}
    placement.release()
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """Plan for GPUs in this process only (the raylets and the probes never see AREAL_DEVICE)."""
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    monkeypatch.setenv("AREAL_USER", "tester")
    monkeypatch.chdir(tmp_path)
    yield hardware.detect()
    placement.release()


def place(preset: str, plat, overrides=()):
    """Reserve the preset's layout as a run does and start a probe in each worker's place."""
    cfg = load_config(preset, list(overrides))
    alloc = parse_allocation(cfg.allocation_mode)
    places = groups.reserve(cfg, plat)
    probe = probe_class()
    trainers = [probe.options(**places.trainer_options(r)).remote() for r in range(alloc.train_gpus)]
    engines = [probe.options(**places.engine_options(i)).remote() for i in range(alloc.gen.dp)]
    return alloc, ray.get([a.where.remote() for a in trainers]), ray.get([a.where.remote() for a in engines])


@pytest.mark.parametrize("preset", ["1.5B_n4", "7B_n4"])
def test_a_preset_layout_gives_every_worker_its_own_gpus_on_one_node(cluster, gpu, preset):
    alloc, trainers, engines = place(preset, gpu)
    tp = alloc.gen.tp
    for t in trainers:  # DeepSpeed's rank uses cuda:0: the one GPU it was given
        assert len(t["gpus"]) == 1
        assert t["visible"] == t["gpus"][0]
    for e in engines:  # vLLM's mp executor puts its tp workers on cuda:0..tp-1 of one node
        assert len(e["gpus"]) == tp
        assert e["visible"] == ",".join(e["gpus"])
    given = [(w["node"], g) for w in trainers + engines for g in w["gpus"]]
    assert len(given) == len(set(given)) == NODES * GPUS
    trainer_nodes = [t["node"] for t in trainers]
    # Packed in rank order: ranks 0-7 on one node, 8-15 on another; engines on the other two.
    assert len(set(trainer_nodes[:8])) == len(set(trainer_nodes[8:])) == 1
    assert trainer_nodes[0] != trainer_nodes[8]
    assert not set(trainer_nodes) & {e["node"] for e in engines}
    assert cluster["noset_node"] in {w["node"] for w in trainers + engines}


def test_a_relaunch_replaces_its_own_reservation(cluster, gpu):
    """A relaunch reserves the whole cluster again while the last attempt's groups still hold it:
    those are its own, released first, not other work to wait for."""
    cfg = load_config("1.5B_n4")
    first = groups.reserve(cfg, gpu)
    t0 = time.monotonic()
    again = groups.reserve(cfg, gpu)
    assert time.monotonic() - t0 < 10
    assert {ray.util.placement_group_table(pg)["state"] for pg in first.groups} == {"REMOVED"}
    assert {ray.util.placement_group_table(pg)["state"] for pg in again.groups} == {"CREATED"}


def test_more_gpus_than_the_cluster_has_fails_at_once(cluster, gpu):
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        groups.reserve(load_config("1.5B_n4", ["n_nodes=5", "allocation_mode=vllm.d16p1m1+d24p1m1"]), gpu)
    assert time.monotonic() - t0 < 5
    assert str(e.value) == ("24 trainer ranks + 16 engines x tp 1 need 40 GPUs, nodes have GPUs 8, 8, 8, 8 "
                            "(32 in all); change allocation_mode or free GPUs")


def test_a_group_ray_cannot_place_is_named_after_the_timeout(cluster, gpu):
    """The last guard, for resources taken between the plan and the reservation: a layout that
    asks one node for more than it has is removed again after the timeout, and named."""
    nodes, _ = placement.cluster_nodes("GPU")
    layout = placement.Layout("GPU", nodes, [placement.Group("engine", 0, ({"GPU": GPUS + 1, "CPU": 1},), 1)], GPUS + 1)
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        placement.reserve(layout, timeout_s=2)
    assert time.monotonic() - t0 < 6
    assert str(e.value) == f"Ray did not place engine 0 on {nodes[1].name} within 2s; nodes have free GPUs 8, 8, 8, 8"


@pytest.fixture
def busy(cluster):
    """Hold GPUs on some nodes, as another job would: a placement group pinned to each."""
    held = []

    def hold(per_node: list[int]):
        nodes, _ = placement.cluster_nodes("GPU")
        for node, n in zip(nodes, per_node):
            if n:
                held.append(ray.util.placement_group([{"GPU": n}], bundle_label_selector=[
                    {placement.NODE_ID_LABEL: node.id}]))
        ray.get([pg.ready() for pg in held], timeout=30)

    yield hold
    for pg in held:
        ray.util.remove_placement_group(pg)


def test_busy_gpus_fail_after_the_timeout_with_what_is_free(cluster, gpu, busy, monkeypatch):
    """7B_n4 needs every GPU; a node with only 3 free ones cannot hold it."""
    monkeypatch.setattr(placement, "TIMEOUT_S", 2.0)
    busy([5, 0, 0, 0])
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        groups.reserve(load_config("7B_n4"), gpu)
    assert time.monotonic() - t0 < 8
    assert str(e.value) == ("16 trainer ranks + 4 engines x tp 4 need 32 GPUs, nodes have free GPUs 3, 8, 8, 8 "
                            "(27 in all); change allocation_mode or free GPUs (other work holds the rest; "
                            "waited 2s)")


def test_an_engine_that_fits_no_single_node_is_named(cluster, gpu, busy, monkeypatch):
    """12 GPUs are free, but no node has the 4 one engine needs."""
    monkeypatch.setattr(placement, "TIMEOUT_S", 2.0)
    busy([5, 5, 5, 5])
    with pytest.raises(UserError) as e:
        groups.reserve(load_config("7B_n4", ["n_nodes=1", "allocation_mode=vllm.d1p1m4+d4p1m1"]), gpu)
    assert str(e.value).startswith("engine 0 needs 4 GPUs on one node (tensor parallel 4); nodes have free "
                                   "GPUs 3, 3, 3, 3; ")

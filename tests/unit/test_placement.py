"""The layout placement.pack computes: which node each trainer rank and engine is reserved on.

tests/integration/test_placement_ray.py reserves these layouts on a real 4-node Ray cluster.
"""

import pytest

from areal_kit import hardware
from areal_kit.config.alloc import parse_allocation
from areal_kit.errors import UserError
from areal_kit.rl.driver import placement

GPU, CPU = hardware.detect("cuda"), hardware.detect("cpu")


def gpu_nodes(*free):
    return [placement.Node(f"id{i}", f"10.0.0.{i + 1}", {"GPU": f, "CPU": 64}) for i, f in enumerate(free)]


def used(layout) -> list[float]:
    """Each node's reserved amount of the layout's unit."""
    out = [0.0] * len(layout.nodes)
    for g in layout.groups:
        out[g.node] += sum(b[layout.unit] for b in g.bundles)
    return out


@pytest.mark.parametrize("mode,tp", [("vllm.d16p1m1+d8p2m1", 1), ("vllm.d4p1m4+d8p2m1", 4)])
def test_the_4_node_presets_pack_trainers_on_two_nodes_and_engines_on_the_others(mode, tp):
    layout = placement.on_nodes(parse_allocation(mode), GPU, 4, 8)
    trainers = [g for g in layout.groups if g.role == "trainer"]
    engines = [g for g in layout.groups if g.role == "engine"]
    assert [(g.first, len(g.bundles), g.node) for g in trainers] == [(0, 8, 0), (8, 8, 1)]
    assert [g.bundles for g in engines] == [({"GPU": tp, "CPU": 1},)] * (16 // tp)
    assert sorted(g.node for g in engines) == [2] * (8 // tp) + [3] * (8 // tp)
    assert used(layout) == [8, 8, 8, 8]
    assert layout.trainer_bundle(9) == (1, 1)
    assert layout.groups[layout.engine_group(2)].first == 2


def test_an_engine_that_fits_no_node_names_itself_and_the_free_gpus():
    with pytest.raises(UserError) as e:
        placement.pack(gpu_nodes(3, 3, 2, 8), 2, 3, 4, "GPU")
    assert str(e.value) == ("engine 2 needs 4 GPUs on one node (tensor parallel 4); nodes have free GPUs 3, 3, 2, 0 "
                            "(after engines 0-1); change allocation_mode or free GPUs")


def test_more_gpus_than_the_nodes_have_is_the_sum():
    with pytest.raises(UserError) as e:
        placement.pack(gpu_nodes(3, 3, 2, 8), 16, 4, 4, "GPU")
    assert str(e.value) == ("16 trainer ranks + 4 engines x tp 4 need 32 GPUs, nodes have free GPUs 3, 3, 2, 8 "
                            "(16 in all); change allocation_mode or free GPUs")


def test_engines_go_first_so_a_layout_that_fits_is_found():
    """Trainer ranks placed first, on the emptiest nodes, would split 4 + 2 over the first two
    and leave no node with the engine's 4 GPUs."""
    layout = placement.pack(gpu_nodes(4, 4, 2), 6, 1, 4, "GPU")
    assert used(layout) == [4, 4, 2]
    [engine] = [g for g in layout.groups if g.role == "engine"]
    assert [(g.first, len(g.bundles)) for g in layout.groups if g.role == "trainer"] == [(0, 4), (4, 2)]
    assert engine.node == 1


def test_a_node_short_of_cpus_holds_fewer_bundles():
    nodes = [placement.Node("a", "a", {"GPU": 8, "CPU": 2}), placement.Node("b", "b", {"GPU": 8, "CPU": 64})]
    layout = placement.pack(nodes, 10, 0, 1, "GPU")
    assert [(g.first, len(g.bundles), g.node) for g in layout.groups] == [(0, 8, 1), (8, 2, 0)]


def test_spread_roles_keeps_trainers_and_engines_on_different_nodes():
    layout = placement.pack(gpu_nodes(8, 8, 8, 8), 10, 2, 4, "GPU", spread_roles=True)
    assert {g.node for g in layout.groups if g.role == "trainer"} == {0, 1}
    assert {g.node for g in layout.groups if g.role == "engine"} <= {2, 3}
    with pytest.raises(UserError, match="spread_roles=true needs a Ray cluster of at least 2 nodes, found 1"):
        placement.pack(gpu_nodes(8), 1, 1, 1, "GPU", spread_roles=True)


def test_on_cpu_every_gpu_is_a_slot_and_engines_spread():
    """CPU nodes: a slot per trainer rank and per engine GPU; engines spread over the nodes so they
    share cores with as few others as possible (spread_roles: engines on the nodes after the trainer's)."""
    layout = placement.on_nodes(parse_allocation("vllm.d2p1m1+d1p1m1"), CPU, 3, 1, spread_roles=True)
    assert [(g.role, g.first, g.node) for g in layout.groups] == [("trainer", 0, 0), ("engine", 0, 1), ("engine", 1, 2)]
    assert layout.groups[0].bundles == ({"CPU": 1},)
    # Colocated roles share the GPUs but not the slots: 8 "GPUs" hold 8 ranks and 4 engines of tp 2.
    shared = placement.on_nodes(parse_allocation("actor_gen:d4p1m2,*:d4p2m1"), CPU, 1, 8)
    assert used(shared) == [16]
    assert [g.bundles for g in shared.groups if g.role == "engine"] == [({"CPU": 2},)] * 4


def test_describe_says_per_node_what_each_group_reserves():
    assert placement.on_nodes(parse_allocation("vllm.d4p1m4+d8p2m1"), GPU, 4, 8).describe() == [
        "placement: 6 placement groups, each STRICT_PACK on one node, all reserved before any worker starts (within 30s)",
        "  node 1: trainer ranks 0-7: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 2: trainer ranks 8-15: 1 group x 8 bundles {GPU: 1, CPU: 1}",
        "  node 3: engines 0-1: 2 groups x 1 bundle {GPU: 4, CPU: 1}",
        "  node 4: engines 2-3: 2 groups x 1 bundle {GPU: 4, CPU: 1}",
    ]

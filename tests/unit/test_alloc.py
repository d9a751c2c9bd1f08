"""Allocation-mode grammar (config/alloc.py): parsing, GPU arithmetic, and its error messages."""

import pytest

from areal_kit.config.alloc import Parallel, parse_allocation, parse_parallel
from areal_kit.config.schema import ConfigError


@pytest.mark.parametrize("text", ["d4m2p1", "d4p1m2", "m2d4p1", "m2p1d4", "p1d4m2", "p1m2d4"])
def test_parallel_any_letter_order(text):
    assert parse_parallel(text) == Parallel(dp=4, tp=2, pp=1)


def test_parallel_missing_letters_default_to_one():
    assert parse_parallel("d8") == Parallel(8, 1, 1)
    assert parse_parallel("m4") == Parallel(1, 4, 1)
    assert parse_parallel("p2d3") == Parallel(3, 1, 2)
    assert parse_parallel("d12m10p3").world == 360
    assert str(parse_parallel("p2m1d8")) == "d8m1p2"


def test_colocated():
    a = parse_allocation("d4m2p1")
    assert a.kind == "colocated"
    assert a.gen == a.train == Parallel(4, 2, 1)
    assert (a.gen_gpus, a.train_gpus, a.total_gpus) == (8, 8, 8)
    a.check(1, 8)
    assert a.describe(1, 8) == "d4m2p1 needs 8 GPUs, cluster has 1x8=8: ok"


def test_per_role_guide_1p5b_n1():
    a = parse_allocation("actor_gen:d4p1m2,*:d4p2m1")
    assert a.kind == "per_role"
    assert a.gen == Parallel(4, 2, 1)
    assert a.train == Parallel(4, 1, 2)
    assert a.total_gpus == 8
    a.check(1, 8)


@pytest.mark.parametrize(("text", "split"), [
    ("actor_gen:d4p1m2,*:d4p2m1", "vllm.d2p1m2+d4p1m1"),  # the guide's 1.5B_n1: generation keeps m2
    ("d4m1p1", "vllm.d2p1m1+d2p1m1"),
    ("d3m2p1", "vllm.d3p1m1+d3p1m1"),  # 3 generation GPUs cannot keep m2
    ("d1m1p1", None),  # one GPU: nothing to split
    ("vllm.d4p1m1+d4p1m1", None),  # already split
])
def test_a_shared_allocation_splits_into_the_same_gpus(text, split):
    a = parse_allocation(text)
    assert a.split() == split
    if split:
        b = parse_allocation(split)
        assert b.kind == "decoupled"
        assert b.total_gpus == a.total_gpus


def test_per_role_explicit_train_wins_over_star():
    a = parse_allocation("actor_gen:d2m2,actor_train:d4,*:d1")
    assert a.gen == Parallel(2, 2, 1)
    assert a.train == Parallel(4, 1, 1)


def test_decoupled_sum_and_message():
    a = parse_allocation("vllm.d16p1m1+d8p2m1")
    assert a.kind == "decoupled"
    assert (a.gen_gpus, a.train_gpus, a.total_gpus) == (16, 16, 32)
    a.check(4, 8)
    assert a.describe(4, 8) == "vllm.d16p1m1+d8p2m1 needs 16+16=32 GPUs, cluster has 4x8=32: ok"


@pytest.mark.parametrize("text,nodes,per_node", [
    ("vllm.d64p1m1+d32p2m1", 16, 8),
    ("vllm.d4p1m4+d8p2m1", 4, 8),
    ("vllm.d16p1m4+d32p2m1", 16, 8),
    ("vllm.d1p1m1+d1p1m1", 1, 2),
])
def test_guide_modes_fit_their_clusters(text, nodes, per_node):
    a = parse_allocation(text)
    assert a.total_gpus == nodes * per_node
    a.check(nodes, per_node)


def test_whitespace_around_is_ignored():
    assert parse_allocation("  d2m1p1 ").gen == Parallel(2, 1, 1)


@pytest.mark.parametrize("text,nodes,per_node,expected", [
    ("vllm.d16p1m1+d8p2m1", 3, 8, "vllm.d16p1m1+d8p2m1 needs 16+16=32 GPUs, cluster has 3x8=24"),
    ("vllm.d16p1m1+d8p2m1", 8, 8, "needs 16+16=32 GPUs, cluster has 8x8=64"),
    ("d4m2p1", 2, 8, "d4m2p1 needs 8 GPUs, cluster has 2x8=16"),
    ("actor_gen:d4p1m2,*:d4p2m1", 1, 4, "needs 8 GPUs, cluster has 1x4=4"),
])
def test_wrong_product_shows_arithmetic(text, nodes, per_node, expected):
    with pytest.raises(ConfigError) as e:
        parse_allocation(text).check(nodes, per_node)
    assert expected in str(e.value)


def test_colocated_roles_must_match():
    a = parse_allocation("actor_gen:d4,*:d2")
    with pytest.raises(ConfigError, match="colocated roles must use the same GPUs"):
        a.check(1, 4)


def test_generation_tp_must_fit_in_a_node():
    a = parse_allocation("vllm.d1m16+d16")
    with pytest.raises(ConfigError, match="m16 spans more than one node"):
        a.check(4, 8)


@pytest.mark.parametrize("text,message", [
    ("", "allocation_mode is empty"),
    ("   ", "allocation_mode is empty"),
    ("d4x2", "is not a parallel strategy"),
    ("d4m2p1 ", None),  # trailing space is stripped: valid
    ("4d", "is not a parallel strategy"),
    ("d", "is not a parallel strategy"),
    ("d-1", "is not a parallel strategy"),
    ("d2d2", "repeats a letter"),
    ("d0m1p1", "has a zero"),
    ("D4M2P1", "is not a parallel strategy"),
    ("sglang.d16p1m1+d8p2m1", "'sglang' is not supported"),
    ("tgi.d1+d1", "unknown generation backend 'tgi'"),
    ("vllm.d16p1m1", "expected vllm.GEN+TRAIN"),
    ("vllm.+d8", "expected vllm.GEN+TRAIN"),
    ("vllm.d16p1m1+", "expected vllm.GEN+TRAIN"),
    ("vllm.d8p2m1+d8p2m1", "generation pipeline parallel p2"),
    ("vllm.d8+d8x", "is not a parallel strategy"),
    ("actor_gen:d4p1m2,critic:d4", "unknown role 'critic'"),
    ("actor_gen:d4p1m2,d4p2m1", "has no role"),
    ("actor_gen:d4", "actor_gen and actor_train need a strategy"),
    ("actor_gen:,*:d4", "is not a parallel strategy"),
])
def test_bad_allocation_strings(text, message):
    if message is None:
        parse_allocation(text)
        return
    with pytest.raises(ConfigError) as e:
        parse_allocation(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)

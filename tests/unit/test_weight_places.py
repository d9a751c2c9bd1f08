"""The engine learns where its loader puts each received tensor (vllm_ext._places), so later
updates can be received straight into the parameters. The loader here is a few lines standing in
for vLLM's: the real one is exercised in tests/integration/test_rl_engine_engines.py."""

import torch

from areal_kit.rl import vllm_ext


def _load(params, bucket):
    """What vLLM's loaders do: fused rows copied into a slice, a dtype conversion, a TP shard."""
    t = dict(bucket)
    qkv = params["qkv.weight"].data
    qkv.narrow(0, 0, 2).copy_(t["q.weight"].narrow(0, 0, 2))  # a no-op narrow, as vLLM's tp=1 path
    qkv.narrow(0, 2, 4).copy_(t["kv.weight"])
    params["o.weight"].data.copy_(t["o.weight"].to(torch.float64).to(torch.float32))
    params["emb.weight"].data.copy_(t["emb.weight"].narrow(0, 0, 3))  # this rank's shard of 6 rows


def test_only_whole_plain_copies_are_learned():
    params = {"qkv.weight": torch.nn.Parameter(torch.zeros(6, 4)), "o.weight": torch.nn.Parameter(torch.zeros(4, 4)),
              "emb.weight": torch.nn.Parameter(torch.zeros(3, 4))}
    g = torch.Generator().manual_seed(0)
    bucket = [("q.weight", torch.randn(2, 4, generator=g)), ("kv.weight", torch.randn(4, 4, generator=g)),
              ("o.weight", torch.randn(4, 4, generator=g)), ("emb.weight", torch.randn(6, 4, generator=g))]
    with vllm_ext._CopyLog() as log:
        _load(params, bucket)
    places = vllm_ext._places(bucket, log.copies, params)
    assert sorted(places) == ["kv.weight", "q.weight"]
    assert places["q.weight"][1] == places["kv.weight"][1] == "qkv.weight"
    # A place is the parameter's own memory: writing it is loading.
    new = torch.full((4, 4), 7.0)
    places["kv.weight"][0].copy_(new)
    assert torch.equal(params["qkv.weight"][2:], new)


def test_a_copy_the_loader_then_overwrites_is_not_learned():
    params = {"w": torch.nn.Parameter(torch.zeros(2, 2))}
    bucket = [("w", torch.ones(2, 2))]
    with vllm_ext._CopyLog() as log:
        params["w"].data.copy_(bucket[0][1])
        params["w"].data.mul_(2)  # e.g. a scale folded in after the copy
    assert vllm_ext._places(bucket, log.copies, params) == {}

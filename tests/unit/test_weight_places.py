"""The engine learns where its loader puts each received tensor (vllm_ext._places), so later
updates can be received straight into the parameters. The loader here is a few lines standing in
for vLLM's: the real one is exercised in tests/integration/test_rl_engine_engines.py."""

import torch

from areal_kit.rl.weight_sync import vllm_ext


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


def test_parameters_with_places_move_into_a_region_the_trainer_can_write():
    """vllm_ext._move_to_region: the parameters keep their values, their places follow them into
    the region, and a second mapping of it (what trainer rank 0 opens) writes into the parameters."""
    from areal_kit.rl.weight_sync import transport

    g = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)
              for n, shape in [("qkv.weight", (6, 4)), ("o.weight", (4, 4)), ("norm.weight", (4,))]}
    before = {n: p.detach().clone() for n, p in params.items()}
    qkv = params["qkv.weight"].data
    places = {"q.weight": (qkv[0:2], "qkv.weight"), "kv.weight": (qkv[2:6], "qkv.weight"),
              "o.weight": (params["o.weight"].data, "o.weight")}
    moved, offsets, buf, region = vllm_ext._move_to_region(params, places)
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
    in_region = {n: buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() for n, p in params.items()}
    assert in_region == {"qkv.weight": True, "o.weight": True, "norm.weight": False}  # no place: stays
    # Byte offsets mirror the parameter: kv's rows start 2 rows x 4 floats after q's; each
    # parameter starts 64-byte aligned.
    assert offsets["kv.weight"] == offsets["q.weight"] + 2 * 4 * 4
    assert offsets["q.weight"] % 64 == 0
    assert offsets["o.weight"] % 64 == 0
    assert moved["kv.weight"][0].data_ptr() == params["qkv.weight"].data[2:6].data_ptr()

    trainer = transport.open_region(region)
    for name, (dst, _) in moved.items():
        meta = transport.TensorMeta(name, tuple(dst.shape), "float32")
        transport.region_view(trainer, offsets[name], meta).fill_(len(name))
    assert params["qkv.weight"][0:2].eq(len("q.weight")).all()
    assert params["qkv.weight"][2:].eq(len("kv.weight")).all()
    assert params["o.weight"].eq(len("o.weight")).all()
    assert torch.equal(params["norm.weight"], before["norm.weight"])

"""The engine learns where its loader puts each received tensor (vllm_ext._places), so later
updates can be received straight into the parameters. The loader here is a few lines standing in
for vLLM's: the real one is exercised in tests/integration/test_rl_engine_engines.py."""

from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from areal_kit.rl.vllm_worker import extension as vllm_ext


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


# ---------------------------------------------------------------- a disk load onto a GPU engine
GPU = torch.device("cuda", 0)


class OnGpu(torch.Tensor):
    """A tensor in host memory that says it is on the GPU (results computed from it say so too)."""

    @property
    def device(self):
        return GPU


def _on_gpu(t) -> bool:
    return isinstance(t, OnGpu)


class FakeCuda(TorchFunctionMode):
    """CUDA's device rules at the edge, for what cannot run here: `.to(cuda)` makes an OnGpu copy,
    and an op that mixes a GPU tensor with one in host memory raises CUDA's error, except copy_
    (the one op CUDA takes across devices)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            to_gpu = func is torch.Tensor.cuda or any(isinstance(a, (str, torch.device)) and torch.device(a).type
                                                      == "cuda" for a in (*args[1:], kwargs.get("device")))
            if to_gpu:
                src = args[0].as_subclass(torch.Tensor)
                return src.detach().clone().as_subclass(OnGpu)
            return func(*args, **kwargs)
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        if func not in (torch.Tensor.copy_,) and len({_on_gpu(t) for t in tensors}) > 1:
            if func in (torch.Tensor.equal, torch.equal):
                raise RuntimeError("Cannot compare two tensors on different devices. Got: cuda:0 and cpu")
            raise RuntimeError(f"{getattr(func, '__name__', func)}: Expected all tensors to be on the same device, "
                               "but found at least two devices, cuda:0 and cpu!")
        return func(*args, **kwargs)


class FusedModel(torch.nn.Module):
    """A vLLM model at its load_weights: q and kv rows copied into one fused qkv parameter, o whole."""

    def __init__(self, device=None, on_gpu: bool = False):
        super().__init__()
        make = (lambda *s: torch.zeros(*s).as_subclass(OnGpu)) if on_gpu else (lambda *s: torch.zeros(*s, device=device))
        self.qkv = torch.nn.Parameter(make(6, 4), requires_grad=False)
        self.o = torch.nn.Parameter(make(4, 4), requires_grad=False)

    def load_weights(self, weights) -> set:
        done = set()
        for name, w in weights:
            if name == "o.weight":
                self.o.data.copy_(w)
                done.add("o")
            else:
                rows = (0, 2) if name == "q.weight" else (2, 4)
                self.qkv.data.narrow(0, *rows).copy_(w)
                done.add("qkv")
        return done


class Worker(vllm_ext.WeightSyncExtension):
    """The vLLM worker the extension runs in: its model runner, on `device`."""

    def __init__(self, model, device: str):
        cfg = SimpleNamespace(quantization=None, hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.model_runner = SimpleNamespace(model=model, model_config=cfg, device=device)


def write_folder(path, seed: int) -> dict:
    """A Hugging Face folder's weights in two files (two buckets), as the trainer saves them."""
    g = torch.Generator().manual_seed(seed)
    w = {"q.weight": torch.randn(2, 4, generator=g), "kv.weight": torch.randn(4, 4, generator=g),
         "o.weight": torch.randn(4, 4, generator=g)}
    path.mkdir()
    save_file({"q.weight": w["q.weight"], "kv.weight": w["kv.weight"]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({"o.weight": w["o.weight"]}, str(path / "model-00002-of-00002.safetensors"))
    return w


def test_a_disk_load_onto_a_gpu_engine_compares_on_the_gpu(tmp_path, monkeypatch):
    """The weight sync by disk (shared GPUs): safetensors gives host tensors, the engine's
    parameters are on its GPU, and CUDA refuses to compare the two. No GPU here: the parameters
    are OnGpu tensors and FakeCuda applies CUDA's device rules at that edge (hardware.synchronize,
    a CUDA stream's wait, is a no-op). tests/gpu/test_weight_places_gpu.py runs it on a GPU."""
    monkeypatch.setattr(vllm_ext.hardware, "synchronize", lambda device: None)
    v1, v2 = write_folder(tmp_path / "v1", 1), write_folder(tmp_path / "v2", 2)
    worker = Worker(FusedModel(on_gpu=True), "cuda:0")
    with FakeCuda():
        worker.load_weights_from_disk(str(tmp_path / "v1"))  # learns the places
        assert worker.placed_weights() == ["kv.weight", "o.weight", "q.weight"]
        stats = worker.load_weights_from_disk(str(tmp_path / "v2"))  # copies into them
    model = worker.model_runner.model
    assert stats["placed"] == 0  # from a file, nothing arrives in place: each is copied there
    assert torch.equal(model.qkv.as_subclass(torch.Tensor), torch.cat([v2["q.weight"], v2["kv.weight"]]))
    assert torch.equal(model.o.as_subclass(torch.Tensor), v2["o.weight"])
    assert not torch.equal(v1["o.weight"], v2["o.weight"])


def test_the_fake_refuses_what_cuda_refuses():
    with FakeCuda():
        g = torch.ones(2).to("cuda:0")
        assert isinstance(g, OnGpu) and g.device == GPU
        for mixed in (lambda: g.equal(torch.ones(2)), lambda: g + torch.ones(2)):
            try:
                mixed()
            except RuntimeError as e:
                assert "device" in str(e)
            else:
                raise AssertionError("a GPU tensor and a host tensor were mixed")
        g.copy_(torch.zeros(2))  # copy_ crosses devices on CUDA too
        assert g.equal(torch.zeros(2).to(g.device))

"""A packed micro-batch's attention layout is worked out once, on the host, from the sequence lengths
the packer knows (varlen.layout_kwargs), and handed to every layer: no layer reads the sequence
starts back from the device. On a GPU each such read (`.nonzero()`, `.tolist()`) is a
device-to-host sync, once per layer per micro-batch; here they are counted on CPU tensors.

    .venv/bin/python -m pytest tests/unit/test_varlen_layout.py
"""

import collections
import functools

import pytest
import torch
from torch.overrides import TorchFunctionMode

from areal_kit.rl.algo import varlen
from areal_kit.rl.algo.packing import pack
from areal_kit.rl.trainer.worker import TrainerWorker

# Calls that read a tensor's values back to Python (a sync on a GPU).
READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_of(tmp_path_factory):
    """A tiny Qwen2 with the varlen attention, by its number of layers."""
    from transformers import AutoModelForCausalLM

    from areal_kit.data.tiny_model import TinySpec, build

    @functools.cache
    def load(layers: int):
        path = build(str(tmp_path_factory.mktemp(f"tiny{layers}")), TinySpec(kind="bpe", heads=4, kv_heads=2,
                                                                              layers=layers))
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=varlen.register())

    return load


# Lengths 5, 5, 8, 3, 5, 8: repeated lengths share a batched call, several groups need the re-order.
BATCH = ([[1, 2, 3], [4, 5], [6, 7, 8, 9], [3], [7, 7], [2, 4, 6]], [[9, 9], [3, 3, 3], [1] * 4, [5, 6], [8] * 3, [1] * 5])


def _forward(model, pk, **kw):
    return model.model(input_ids=pk.input_ids[None], position_ids=pk.position_ids[None], use_cache=False,
                       **kw).last_hidden_state[0]


@pytest.mark.parametrize("layers", [2, 4])
def test_no_layer_reads_the_sequence_starts_back_from_the_device(model_of, layers):
    model, pk = model_of(layers), pack(*BATCH)
    with CountReads() as plain:
        _forward(model, pk)
    assert plain.reads["nonzero"] == layers  # without the layout: every layer asks (the old path)
    kw = varlen.layout_kwargs(varlen.NAME, pk.views, "cpu")
    with CountReads() as laid_out:
        _forward(model, pk, **kw)
    assert laid_out.reads["nonzero"] == laid_out.reads["tolist"] == laid_out.reads["item"] == 0, laid_out.reads
    # What is left (transformers' mask check) happens once a forward, not once a layer.
    assert sum(laid_out.reads.values()) <= 1, laid_out.reads


def test_the_layout_gives_bit_identical_outputs_and_gradients(model_of):
    model = model_of(2)
    for prompts, answers in (BATCH, ([[1, 2]], [[3]]), ([[1], [2]], [[3, 4], [5, 6]])):
        pk = pack(prompts, answers)
        outs = []
        for kw in ({}, varlen.layout_kwargs(varlen.NAME, pk.views, "cpu")):
            model.zero_grad()
            hidden = _forward(model, pk, **kw)
            hidden.square().sum().backward()
            outs.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (h0, g0), (h1, g1) = outs
        assert torch.equal(h0, h1)
        assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_flash_attn_gets_the_varlen_arguments_transformers_would_derive_per_layer():
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    pk = pack(*BATCH)
    kw = varlen.layout_kwargs(varlen.FLASH, pk.views, "cpu")
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pk.position_ids[None])
    assert torch.equal(kw["cu_seq_lens_q"], cu_q) and kw["cu_seq_lens_q"].dtype == cu_q.dtype == torch.int32
    assert torch.equal(kw["cu_seq_lens_k"], cu_k)
    assert (kw["max_length_q"], kw["max_length_k"]) == (int(max_q), int(max_k))
    assert isinstance(kw["max_length_q"], int)  # a Python int: flash-attn reads no tensor back


def test_the_trainer_hands_the_layout_to_the_model(model_of):
    """TrainerWorker._logprobs (every forward of the trainer and the reference model) with the
    layout its setup chose: no read-back in any layer."""
    w = TrainerWorker.__new__(TrainerWorker)
    w.device = torch.device("cpu")
    w.cfg = type("Cfg", (), {"ppo": type("P", (), {"gen": type("G", (), {"temperature": 1.0})})})()
    w.layout = functools.partial(varlen.layout_kwargs, varlen.NAME)
    pk = pack(*BATCH)
    with CountReads() as counted:
        w._logprobs(model_of(4), pk, grad=False)
    assert counted.reads["nonzero"] == 0, counted.reads

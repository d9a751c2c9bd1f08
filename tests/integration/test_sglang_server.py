"""SGLang's server on this CPU, for real: generation, weight loads from disk and by broadcast, relaunch.

One server for the module (its start is the cost: ~1-2 min on this machine's 2 cores), on a tiny
random Qwen2 built here; the relaunch test starts it a second time.

Stand-ins (SGLang's CPU venv only, sglang_cpu_standins.py): sgl_kernel's CPU build does not exist
on PyPI, so its one kernel a generation calls is plain torch there, and PyPI's CUDA torchvision
gets its two operator schemas defined before it imports. Everything else is SGLang 0.5.23 itself.
Skipped where SGLang's venv is not installed (python -m areal_kit.rl.engine.sglang_env).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from areal_kit.rl.engine.sglang_env import python_of

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    python_of() is None, reason="SGLang's venv is not installed: python -m areal_kit.rl.engine.sglang_env")]

PROMPT = [2, 5, 6, 16, 7, 18]  # ids of the toy vocabulary (22 tokens); what they spell does not matter here
NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    root = tmp_path_factory.mktemp("models")
    # Random weights (no format prior, so no early end of text); two seeds, two sets of weights.
    return (build(str(root / "a"), TinySpec(prior_steps=0, seed=1)),
            build(str(root / "b"), TinySpec(prior_steps=0, seed=2)))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    from areal_kit.rl.engine.sglang_server import SGLangServer

    s = SGLangServer(models[0], log_dir=tmp_path_factory.mktemp("logs"))
    s.start()
    yield s
    s.close()


def greedy(server):
    return server.generate(PROMPT, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def test_greedy_tokens_and_logprobs_match_transformers(server, models):
    from transformers import AutoModelForCausalLM

    out = greedy(server)
    assert len(out.token_ids) == len(out.logprobs) == NEW and out.finish_reason == "length"
    model = AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1:-1].float(), dim=-1)
    # Each sampled token is transformers' argmax, and its logprob is transformers' (SGLang's CPU KV
    # cache is fp16: agreement within that rounding).
    assert out.token_ids == logp.argmax(-1).tolist()
    want = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=2e-2), (out.logprobs, want.tolist())


def test_weight_push_through_the_group_equals_a_disk_load(server, models):
    from safetensors.torch import load_file

    from areal_kit.rl.engine.sglang_server import free_port
    from areal_kit.rl.weight_sync import sglang_group

    before = greedy(server)
    server.update_weights_from_disk(models[1], version="disk-b")
    from_disk = greedy(server)
    assert from_disk.weight_version == "disk-b"
    # the other weights answer otherwise: the comparison below could fail
    assert max(abs(a - b) for a, b in zip(before.logprobs, from_disk.logprobs)) > 1e-3
    server.update_weights_from_disk(models[0], version="disk-a")
    assert greedy(server).logprobs == pytest.approx(before.logprobs, abs=1e-6)

    params = sorted(load_file(os.path.join(models[1], "model.safetensors")).items())
    port = free_port()
    errors: list[BaseException] = []

    def beside(call):
        def run():
            try:
                call()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread's assert
                errors.append(e)
        t = threading.Thread(target=run)
        t.start()
        return t

    t = beside(lambda: server.init_weights_group("127.0.0.1", port, rank_offset=1, world_size=2))
    group = sglang_group.join(("127.0.0.1", port), world_size=2, backend="gloo")
    t.join(timeout=300)
    assert not errors, errors
    names, dtypes, shapes = sglang_group.specs(params)
    t = beside(lambda: server.update_weights_from_distributed(names, dtypes, shapes, version="pushed-b"))
    sglang_group.broadcast(group, params)
    t.join(timeout=300)
    sglang_group.destroy(group)
    assert not errors, errors
    pushed = greedy(server)
    assert pushed.weight_version == "pushed-b"
    assert pushed.token_ids == from_disk.token_ids
    assert pushed.logprobs == pytest.approx(from_disk.logprobs, abs=1e-6)


def test_paused_server_holds_requests_until_continued(server):
    server.pause()
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(greedy(server)))
    t.start()
    time.sleep(3.0)
    held = not done
    server.resume()
    t.join(timeout=120)
    assert held and len(done) == 1


def test_killed_server_is_noticed_and_relaunched(server):
    server.update_weights_from_disk(server.model_path, version="disk-a")
    want = greedy(server)
    assert server.ensure_alive() is False  # a healthy one is left alone
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    assert not server.alive()
    assert server.ensure_alive() is True and server.launches == 2 and server.alive()
    again = greedy(server)
    assert again.token_ids == want.token_ids
    assert again.logprobs == pytest.approx(want.logprobs, abs=1e-6)

"""Device discipline of the trainer's collectives: every tensor the trainer hands to a collective of
its world lives on its device, which NCCL (DeepSpeed's group on GPUs) requires of every tensor.

Two real DeepSpeed ranks (CPU accelerator, gloo) in child processes run TrainerWorker's real steps
(setup, two train_steps with advantage normalization and a KL reference, the weight staging) with
the trainer's device set to the label `cpu:0` and `strict_device.strict_collectives` active: the
edge where the trainer calls torch.distributed refuses any tensor not made on (or moved to, or
computed from) that device, the way NCCL refuses host tensors. DeepSpeed's own collectives pass:
on CPU its tensors legitimately live in host memory. A host tensor handed to all_reduce by the
child itself is refused too, so the guard is known to bite.

    .venv/bin/python -m pytest tests/integration/test_trainer_device.py
"""

import json
import math
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, sys
import torch
import torch.distributed as dist
from strict_device import HostTensorRefused, strict_collectives
from areal_kit.rl.sample import TrainerRow
from areal_kit.config.loader import load_config
from areal_kit.rl.driver.groups import shard_batch
from areal_kit.rl.trainer.worker import TrainerWorker

rank, zero, root, model, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
cfg = load_config("tiny", [f"fileroot={root}", f"actor.zero_stage={zero}", "ppo.adv_norm=true", "ppo.kl_ctl=0.01"])
worker = TrainerWorker(rank, 2, cfg, model, {"DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": port}, total_steps=2)
worker.setup()
label = torch.device("cpu", 0)
worker.device = label  # where platform puts cuda:0 on a GPU
g = torch.Generator().manual_seed(0)
samples = []
for i in range(8):  # uneven lengths: the ranks get different shards and micro-batch counts agree by max
    out = torch.randint(3, 20, (1 + i % 3,), generator=g).tolist()
    samples.append(TrainerRow(torch.randint(3, 20, (4 + i % 2,), generator=g).tolist(), out,
                              logprobs=[-2.5] * len(out), seq_reward=float(i % 2)))
result = {}
with strict_collectives(label):
    result["steps"] = [worker.train_step(shard_batch(samples, 2)[rank]).stats for _ in range(2)]
    worker.stage_weights()
    try:
        dist.all_reduce(torch.zeros(1))
        result["host_tensor_refused"] = False
    except HostTensorRefused:
        result["host_tensor_refused"] = True
print("RESULT " + json.dumps(result))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from areal_kit.data.tiny_model import TinySpec, build

    return build(str(tmp_path_factory.mktemp("model") / "tiny"), TinySpec())


@pytest.mark.parametrize("zero", [2, 3])
def test_trainer_steps_hand_collectives_only_device_tensors(tmp_path, tiny_model, zero):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(zero), str(tmp_path), tiny_model, port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    results = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out, _ in outs]
    for r in results:
        assert r["host_tensor_refused"] is True
    for step0, step1 in zip(results[0]["steps"], results[1]["steps"]):
        # the ranks' totals come from the same all-reduces
        assert step0["n_valid_tokens"] == step1["n_valid_tokens"] == 15
        assert step0["actor_loss"] == step1["actor_loss"]
        assert math.isfinite(step0["actor_loss"])

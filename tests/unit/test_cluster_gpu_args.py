"""The Ray containers `areal-kit setup` starts on GPU nodes: InfiniBand devices where the host has
them, locked memory for NCCL, the cluster spec's NCCL_* / GLOO_* settings (validated), the hub
off and vLLM's compile cache on storage. Built from a cluster spec and host facts, no host needed;
the InfiniBand probe runs for real on this machine's shell.

    .venv/bin/python -m pytest tests/unit/test_cluster_gpu_args.py
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from areal_kit import hardware
from areal_kit.cli import main
from areal_kit.cluster import steps
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.ray_cluster import docker_run_args, host_env, probe_infiniband
from areal_kit.cluster.remote import Result
from areal_kit.config.cluster_spec import load_cluster_spec
from areal_kit.errors import UserError

INVENTORY = """\
cluster_name: gpu
storage: /mnt/nas
hosts: [g1, g2]
env:
  NCCL_IB_HCA: mlx5_0,mlx5_1
  NCCL_SOCKET_IFNAME: eth0
  GLOO_SOCKET_IFNAME: eth0
  NCCL_DEBUG: WARN
  TORCH_NCCL_ASYNC_ERROR_HANDLING: 1
"""


def cluster(tmp_path, text=INVENTORY, **opts) -> Cluster:
    p = tmp_path / "hosts.yaml"
    p.write_text(text)
    spec = load_cluster_spec(p)
    return Cluster(opts=SetupOptions(spec=spec, log_dir=str(tmp_path / "logs"), **opts), image="areal-kit:latest",
                   hosts=[HostState(spec=h, index=i) for i, h in enumerate(spec.hosts)])


def pairs(args: list[str], flag: str) -> list[str]:
    """The values of every `flag VALUE` in a docker command line."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def env_of(args: list[str]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in pairs(args, "-e"))


def test_gpu_node_with_infiniband_gets_the_devices_and_locked_memory(tmp_path):
    c = cluster(tmp_path)
    head = c.hosts[0]
    head.facts.update(gpus=8, infiniband=True)
    args = docker_run_args(c, head)
    assert pairs(args, "--device") == ["/dev/infiniband"]
    assert pairs(args, "--cap-add") == ["IPC_LOCK"]
    assert pairs(args, "--ulimit") == ["memlock=-1:-1"]
    assert pairs(args, "--gpus") == ["all"]
    assert args.index("--device") < args.index("areal-kit:latest")  # docker options, not the command's


def test_gpu_node_without_infiniband_still_locks_memory_but_gets_no_device(tmp_path):
    c = cluster(tmp_path)
    worker = c.hosts[1]
    worker.facts.update(gpus=8, infiniband=False)
    args = docker_run_args(c, worker)
    assert "--device" not in args
    assert pairs(args, "--ulimit") == ["memlock=-1:-1"]  # CUDA's pinned host buffers lock pages too


def test_cpu_node_container_is_unchanged_by_gpu_options(tmp_path):
    c = cluster(tmp_path)
    h = c.hosts[1]
    h.facts.update(gpus=0, infiniband=False)
    args = docker_run_args(c, h)
    for flag in ("--device", "--cap-add", "--ulimit", "--gpus"):
        assert flag not in args, flag


def test_spec_env_reaches_every_container_and_setup_env_wins(tmp_path):
    c = cluster(tmp_path, env=["NCCL_DEBUG=INFO", "MY_VAR=1"])
    for h in c.hosts:
        env = env_of(docker_run_args(c, h))
        assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["NCCL_DEBUG"] == "INFO"  # --env, given to this setup, over the spec
        assert env["MY_VAR"] == "1"
        assert env["RAY_AUTH_MODE"] == "disabled"
    args = docker_run_args(c, c.hosts[0])
    assert len(pairs(args, "-e")) == len(env_of(args))  # each variable once


def test_containers_never_try_the_hub_and_cache_compiles_on_storage(tmp_path):
    c = cluster(tmp_path)
    env = env_of(docker_run_args(c, c.hosts[0]))
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["TRANSFORMERS_OFFLINE"] == "1"
    # the training's own cache folder under fileroot, on the shared storage every node mounts
    assert env["VLLM_CACHE_ROOT"] == "/mnt/nas/ray/experiments/cache/vllm"


def test_host_runtime_gets_the_same_environment_as_the_containers(tmp_path):
    """--runtime host starts Ray with a command prefix instead of `docker run -e`: the hub off, the
    cache on storage and the spec's NCCL settings must reach those Ray processes all the same."""
    c = cluster(tmp_path, runtime="host")
    prefix = dict(w.split("=", 1) for w in shlex.split(host_env(c, c.hosts[1])) if "=" in w)
    assert prefix == env_of(docker_run_args(c, c.hosts[1]))
    assert prefix["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert prefix["HF_HUB_OFFLINE"] == "1"


def test_gpu_workers_started_outside_setup_never_try_the_hub(monkeypatch, tmp_path):
    """`areal-kit train` or `eval` on a GPU machine set up by hand: their Ray workers get the
    offline settings and vLLM's cache folder too (on CPU as well, beside the CPU settings)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    gpu = hardware.worker_env()
    assert gpu["HF_HUB_OFFLINE"] == "1"
    assert gpu["VLLM_CACHE_ROOT"] == str(tmp_path / "areal-kit" / "vllm")
    assert "DS_ACCELERATOR" not in gpu, "a GPU worker must not be told to use DeepSpeed's CPU accelerator"
    monkeypatch.setenv("AREAL_DEVICE", "cpu")
    cpu = hardware.worker_env()
    assert cpu["DS_ACCELERATOR"] == "cpu"
    assert {k: cpu[k] for k in gpu} == gpu


def test_other_options_change_the_container_digest(tmp_path):
    """A container started before InfiniBand (or a spec env) existed is replaced, not kept."""
    c = cluster(tmp_path)
    h = c.hosts[0]
    h.facts.update(gpus=8, infiniband=False)
    before = docker_run_args(c, h)
    h.facts["infiniband"] = True
    assert before[before.index("--label") + 1] != docker_run_args(c, h)[before.index("--label") + 1]


class LocalShell:
    """Runs the probe on this machine: the probe is a real shell command."""

    def run(self, cmd, check=False, **kw):
        proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False)
        return type("Result", (), {"ok": proc.returncode == 0})()


def test_infiniband_probe_runs_once_and_matches_the_host(tmp_path):
    c = cluster(tmp_path)
    h = c.hosts[0]
    h.remote = LocalShell()
    assert probe_infiniband(c, h) is os.path.isdir("/dev/infiniband")
    h.remote = None  # remembered in the facts: a second call runs nothing
    assert probe_infiniband(c, h) is os.path.isdir("/dev/infiniband")


@pytest.mark.parametrize("env, message", [
    ("{PATH: /bin}", "env: 'PATH' is not a communication setting; expected a name starting with NCCL_"),
    ("{CUDA_VISIBLE_DEVICES: '0'}", "env: 'CUDA_VISIBLE_DEVICES' is not a communication setting"),
    ("{nccl_debug: INFO}", "env: 'nccl_debug' is not a communication setting"),
    ("{NCCL_DEBUG: [INFO]}", "env: NCCL_DEBUG: expected a string or a number, got ['INFO']"),
    ("{NCCL_DEBUG: true}", "env: NCCL_DEBUG: expected a string or a number, got True"),
    ('{NCCL_DEBUG: "a\\nb"}', "env: NCCL_DEBUG: the value contains a line break"),
    ("[NCCL_DEBUG]", "env: expected a mapping of NAME: value"),
])
def test_bad_env_in_the_spec_is_one_line(tmp_path, env, message):
    p = tmp_path / "hosts.yaml"
    p.write_text(f"hosts: [g1]\nenv: {env}\n")
    with pytest.raises(UserError) as e:
        load_cluster_spec(p)
    assert message in str(e.value)
    assert str(e.value).startswith(f"cluster spec {p}: env")
    assert "\n" not in str(e.value)


def test_setup_with_a_bad_spec_env_exits_2_without_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))
    p = tmp_path / "hosts.yaml"
    p.write_text("hosts: [g1]\nenv: {LD_PRELOAD: /tmp/x.so}\n")
    try:
        code = main(["setup", "--inventory", str(p), "--dry-run"]) or 0
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    line = (f"error: cluster spec {p}: env: 'LD_PRELOAD' is not a communication setting; expected a name "
            "starting with NCCL_, TORCH_NCCL_, GLOO_, UCX_, TORCH_DISTRIBUTED_ (other variables: areal-kit setup "
            "--env KEY=VALUE)")
    assert err.strip().splitlines() == [line]


class Facts:
    """A host answering preflight's facts script with `gpus=<what nvidia-smi counted>`."""

    user = "root"

    def __init__(self, gpus: str):
        self.gpus = gpus

    def run(self, cmd, sudo=False, check=False, timeout=None):
        return Result(cmd, 0, f"os=ubuntu 22.04\narch=x86_64\nsudo=root\ngpus={self.gpus}\ndisk_gb=100.0\napt=yes\n")


@pytest.mark.parametrize("said, count", [("8", 8), ("none", 0)])
def test_preflight_keeps_the_gpu_count_a_number(tmp_path, said, count):
    """The later steps read facts["gpus"] as a number: it is one from the moment preflight stores it."""
    c = cluster(tmp_path)
    h = c.hosts[0]
    h.remote = Facts(said)
    assert steps.preflight(c, h).status == "ok"
    assert h.facts["gpus"] == count and type(h.facts["gpus"]) is int

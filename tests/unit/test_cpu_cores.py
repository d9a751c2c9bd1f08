"""cpu_cores: which cores each CPU worker gets (rl/driver/groups.py core_sets and _pinned).

The machine's core list is the one thing faked (os.sched_getaffinity), to lay out 2-, 3- and
8-core machines on this 2-core one.
"""

import os

import pytest

from areal_kit.config.loader import load_config
from areal_kit.errors import UserError
from areal_kit.rl.driver import groups


def cfg(mode="auto", k=1, ray_address=""):
    return load_config("tiny", [f"cpu_cores={mode}", f"ray_address={ray_address}", f"ppo.max_head_offpolicyness={k}"])


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
    return set_cores


def test_auto_splits_only_when_generation_and_training_overlap_on_a_local_ray(cores):
    cores(2)
    assert groups.core_sets(cfg(k=1), 1, 1, 1) == [[0], [1]]
    assert groups.core_sets(cfg(k=0), 1, 1, 1) is None  # roles take turns: each uses every core
    assert groups.core_sets(cfg(k=1, ray_address="10.0.0.1:6379"), 1, 1, 1) is None
    assert groups.core_sets(cfg("shared", k=2), 1, 1, 1) is None
    assert groups.core_sets(cfg("split", k=0), 1, 1, 1) == [[0], [1]]


def test_every_slot_gets_its_share_and_no_core_is_given_twice(cores):
    cores(8)
    sets = groups.core_sets(cfg(), 2, 1, 2)  # 2 trainer ranks + one engine at tp 2 = 4 slots
    assert sets == [[0, 1], [2, 3], [4, 5], [6, 7]]
    cores(3)
    assert [len(s) for s in groups.core_sets(cfg(), 1, 1, 1)] == [2, 1]  # the leftover core goes first


def test_too_few_cores_shares_under_auto_and_is_an_error_under_split(cores):
    cores(2)
    assert groups.core_sets(cfg(), 1, 2, 1) is None
    with pytest.raises(UserError, match=r"1 trainer rank\(s\) \+ 2 engine\(s\) x tp 1 = 3, this machine has 2"):
        groups.core_sets(cfg("split"), 1, 2, 1)


def test_pinned_env_binds_trainers_and_each_tp_rank_of_an_engine():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-7", "X": "1"}
    sets = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups._pinned(env, None, [0]) is env
    t = groups._pinned(env, sets, [0])
    assert t["AREAL_CPU_CORES"] == "0,1"
    assert t["X"] == "1"
    e = groups._pinned(env, sets, range(2, 4))
    assert e["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"  # the shared env is not changed


def test_shared_cores_give_every_tp_rank_of_an_engine_every_core():
    """vLLM wants one core list per tp rank (it failed to start a tp=2 engine on "0-1")."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert groups._pinned(env, None, range(1, 3))["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|0-1"
    assert groups._pinned(env, None, [1]) is env
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # the user's own lists stay
    assert groups._pinned(mine, None, range(1, 3)) is mine


def test_vllm_cache_is_the_users_not_the_runs(monkeypatch, tmp_path):
    """vLLM's model-class cache outlives a fileroot (a miss costs vLLM a subprocess at every
    engine start); an explicit VLLM_CACHE_ROOT still wins, and build caches stay under the run."""
    from areal_kit import hardware

    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env = hardware.cpu_env(str(tmp_path / "run" / "cache"))
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "xdg" / "areal-kit" / "vllm")
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "run" / "cache" / "torch_extensions")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere")
    assert hardware.cpu_env(str(tmp_path))["VLLM_CACHE_ROOT"] == "/elsewhere"


def _config(tmp_path, name, **fields):
    import json

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder)


def test_cpu_kv_cache_is_sized_by_the_model(tmp_path, monkeypatch):
    """hardware.cpu_kv_cache_bytes: twice 256 sequences of max_model_len tokens (fp32 K and V of
    every layer), at least 64 MiB, at most 1 GiB; 1 GiB when the config cannot be read. The user's
    VLLM_CPU_KVCACHE_SPACE reaches the workers only when set (vLLM then takes it over ours)."""
    from areal_kit import hardware

    tiny = _config(tmp_path, "tiny", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=64)
    assert hardware.cpu_kv_cache_bytes(tiny, 19) == 64 << 20
    mid = _config(tmp_path, "mid", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  hidden_size=512, head_dim=64)
    assert hardware.cpu_kv_cache_bytes(mid, 256) == 2 * 256 * 256 * (2 * 4 * 2 * 64 * 4)  # 256 MiB
    big = _config(tmp_path, "big", num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  hidden_size=1536)
    assert hardware.cpu_kv_cache_bytes(big, 32768) == 1 << 30
    assert hardware.cpu_kv_cache_bytes(str(tmp_path / "absent"), 19) == 1 << 30
    assert hardware.vllm_kwargs(hardware.detect("cpu"), tiny, 19)["kv_cache_memory_bytes"] == 64 << 20

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in hardware.cpu_env(str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    assert hardware.cpu_env(str(tmp_path))["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_a_cpu_engine_runs_in_process_unless_the_config_or_environment_says_otherwise(monkeypatch):
    """One CPU worker: vLLM's engine core in the actor under engine_core=auto or inline, unless
    VLLM_ENABLE_V1_MULTIPROCESSING is set; engine_core=process gives it its own process, as on
    GPUs, whatever the environment."""
    from areal_kit import hardware

    cpu, gpu = hardware.detect("cpu"), hardware.detect("cuda")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert hardware.vllm_env(cpu)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert hardware.vllm_env(cpu, engine_core="inline")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert hardware.vllm_env(cpu, engine_core="process")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in hardware.vllm_env(cpu, tp=2)
    assert hardware.vllm_env(gpu, engine_core="inline") == {}  # GPUs keep vLLM's own process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in hardware.vllm_env(cpu)
    assert hardware.vllm_env(cpu, engine_core="process")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


_DRIVER = """
import json, os, signal, subprocess, sys, threading, time
from areal_kit.rl.driver.groups import pin_overhead, unpin_overhead
sleep = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
daemon, worker = (subprocess.Popen(sleep, stdout=subprocess.DEVNULL, start_new_session=True) for _ in range(2))
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread started before the pin
time.sleep(1.5)  # the grandchildren are up
before = pin_overhead([0], {worker.pid})
def kids(pid):
    return [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
def cores():
    return {"driver": [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")],
            "daemon": [sorted(os.sched_getaffinity(p)) for p in [daemon.pid] + kids(daemon.pid)],
            "worker": [sorted(os.sched_getaffinity(p)) for p in [worker.pid] + kids(worker.pid)]}
got = {"pinned": cores()}
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread started while pinned
unpin_overhead(before)
got["unpinned"] = cores()
for p in (daemon, worker):
    os.killpg(p.pid, signal.SIGKILL)
print(json.dumps(got))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell a pinned process from a free one")
def test_the_driver_and_its_daemons_move_to_the_trainer_cores_and_the_workers_stay():
    """pin_overhead in a real process tree (a driver with a daemon and a worker, each with a child
    of its own): every thread of the driver and the daemon's whole tree go to the given cores; the
    worker, and what it started, keep every core. unpin_overhead gives every core back, to a
    driver thread started while pinned too."""
    import json
    import subprocess
    import sys

    every = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _DRIVER], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    pinned, unpinned = got["pinned"], got["unpinned"]
    assert len(pinned["driver"]) >= 2 and all(a == [0] for a in pinned["driver"])
    assert len(pinned["daemon"]) == 2 and all(a == [0] for a in pinned["daemon"])
    assert len(pinned["worker"]) == 2 and all(a == every for a in pinned["worker"])
    assert len(unpinned["driver"]) == len(pinned["driver"]) + 1
    assert all(a == every for who in unpinned.values() for a in who)

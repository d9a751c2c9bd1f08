"""Build the CPU runtime image for the cluster tests, with no registry: debootstrap a Debian
bookworm rootfs, `docker import` it as the base, build docker/Dockerfile on it
(ACCELERATOR=cpu, PY_ENV=storage: the checkout's venv on "shared storage" is the Python environment), and
`docker save` it to a tarball on the testbed's storage, which `areal-kit setup --image-tar`
loads on every node.

The rootfs tarball is cached (AK_IMAGE_CACHE, default /var/cache/areal-kit-testbed): the
debootstrap takes ~70 s once, the build itself a few seconds.

    python tests/cluster/image.py unix:///tmp/areal-kit-testbed/nodes/node1/docker.sock OUT.tar
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("AK_IMAGE_CACHE", "/var/cache/areal-kit-testbed"))
MIRROR = os.environ.get("AK_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_TAG = "areal-kit-base:bookworm"
IMAGE_TAG = "areal-kit:cpu-test"
# What docker/Dockerfile needs for ACCELERATOR=cpu in storage mode (g++: vLLM's sampler goes
# through torch.compile even with enforce_eager, and inductor needs a C++ compiler), plus the shared
# libraries the checkout's Python (possibly a pyenv build) links against; with these the Dockerfile
# needs no apt.
PACKAGES = ("python3,python3-venv,ca-certificates,procps,iproute2,libgomp1,libnuma1,g++,libssl3,libffi8,"
            "libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgdbm6,libuuid1,libexpat1,libtirpc3")


def log(msg: str) -> None:
    print(f"[image] {msg}", file=sys.stderr, flush=True)


def rootfs_tar() -> Path:
    """bookworm minbase rootfs as a tarball, built once and cached."""
    tar = CACHE / "bookworm-rootfs.tar"
    stamp = CACHE / "bookworm-rootfs.packages"
    if tar.exists() and stamp.exists() and stamp.read_text() == PACKAGES:
        return tar
    CACHE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as d:
        r = Path(d) / "rootfs"
        res = subprocess.run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", "bookworm", str(r), MIRROR],
                             capture_output=True, text=True, check=False)
        if res.returncode:
            raise RuntimeError(f"debootstrap failed: {res.stdout[-1500:]}{res.stderr[-1500:]}")
        for deb in (r / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        subprocess.run(["tar", "-C", str(r), "-cf", f"{tar}.tmp", "."], check=True)
    os.replace(f"{tar}.tmp", tar)
    stamp.write_text(PACKAGES)
    log(f"debootstrap rootfs in {time.monotonic() - t0:.0f}s")
    return tar


def venv_mounts() -> tuple[str, list[str]]:
    """The venv this test runs in, and the directories containers must mount to run it: the
    checkout (venv + editable install) and the interpreter the venv points to, unless that is
    the distro's /usr/bin/python3.11, which the image has."""
    venv = Path(sys.prefix)
    mounts = [str(ROOT)]
    if not str(venv).startswith(str(ROOT) + "/"):
        mounts.append(str(venv))
    home = Path(sys.base_prefix)
    if not str(home).startswith("/usr"):
        mounts.append(f"{home}:{home}:ro")
    return str(venv), mounts


def build(docker_host: str, out_tar: Path) -> dict:
    """Import the base, build docker/Dockerfile for CPU, save to out_tar. Returns timings."""
    import docker

    env = dict(os.environ, DOCKER_HOST=docker_host)
    times = {}
    t0 = time.monotonic()
    base = rootfs_tar()
    times["rootfs"] = time.monotonic() - t0
    t0 = time.monotonic()
    subprocess.run(["/usr/bin/docker", "import", "-c", 'CMD ["/bin/bash"]', str(base), BASE_TAG],
                   check=True, env=env, capture_output=True)
    times["import"] = time.monotonic() - t0
    venv, _ = venv_mounts()
    with tempfile.TemporaryDirectory() as ctx:
        c = Path(ctx)
        (c / "docker").mkdir()
        shutil.copy(ROOT / "docker" / "Dockerfile", c / "docker" / "Dockerfile")
        shutil.copytree(ROOT / "docker" / "certs", c / "docker" / "certs")
        (c / "docker" / "wheels").mkdir()
        # PyPI is reached through a TLS-intercepting proxy here: the image trusts its CA.
        if Path("/etc/ssl/certs/ca-certificates.crt").exists():
            shutil.copy("/etc/ssl/certs/ca-certificates.crt", c / "docker" / "certs" / "host-ca-bundle.crt")
        for name in ("pyproject.toml", "setup.py", "README.md"):
            shutil.copy(ROOT / name, c / name)
        for name in ("areal_kit", "train_scripts", "evaluation"):
            shutil.copytree(ROOT / name, c / name, ignore=shutil.ignore_patterns("__pycache__"))
        t0 = time.monotonic()
        api = docker.APIClient(base_url=docker_host, timeout=600)
        out = []
        for chunk in api.build(path=ctx, dockerfile="docker/Dockerfile", tag=IMAGE_TAG, rm=True,
                               network_mode="host", decode=True,
                               buildargs={"BASE_IMAGE": BASE_TAG, "ACCELERATOR": "cpu", "PY_ENV": "storage",
                                          "VENV": venv}):
            if "stream" in chunk:
                out.append(chunk["stream"])
            if "error" in chunk:
                raise RuntimeError(f"docker build failed: {chunk['error']}\n{''.join(out)[-3000:]}")
        api.close()
        times["build"] = time.monotonic() - t0
    t0 = time.monotonic()
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["/usr/bin/docker", "save", "-o", str(out_tar), IMAGE_TAG], check=True, env=env,
                   capture_output=True)
    times["save"] = time.monotonic() - t0
    log("  ".join(f"{k} {v:.1f}s" for k, v in times.items()))
    return times


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]))

"""areal-kit's own runtime image, for clusters that no registry serves: its build context, tag and commands.

`areal-kit setup` without --image builds docker/Dockerfile once on the head host, saves the image to
the shared storage and has every other node `docker load` it (the `image` step in cluster/steps.py).
This module makes, on the controller, what that build needs: the build context as one tarball,
assembled from the installed package (a source checkout, or a wheel that carries no pyproject.toml),
the tag, the tarball's path on storage, and the docker commands. To build the same image by hand:

    python -m areal_kit.cluster.image ctx.tar [cpu|cuda]    # prints the tag and the docker build line
    docker build --network host -t TAG -f docker/Dockerfile --build-arg ACCELERATOR=cpu ... - < ctx.tar
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import sys
import tarfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from areal_kit import stack
from areal_kit.cluster.options import q
from areal_kit.errors import ExitCode

PKG = Path(__file__).resolve().parents[1]  # the installed areal_kit package
# pyproject.toml's package-dir: folders at the top of a checkout that ship inside the package
# (a wheel installs them under areal_kit/; the Dockerfile COPYs them from the context's top).
MAPPED = {"train_scripts": "areal_kit.train_scripts", "evaluation": "areal_kit.evaluation",
          "docker": "areal_kit.docker"}
TOP_FILES = ("pyproject.toml", "setup.py", "README.md")
SKIP = {"__pycache__", ".venv", ".git", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
DOCKERFILE = "docker/Dockerfile"
# Fixed and after 1980: the context's bytes (hence the tag) depend on the files' contents alone, and
# the wheel that pip builds from it in the image cannot hold ZIP timestamps before 1980.
MTIME = 1577836800
_EXTRA = re.compile(r'^(?P<req>.+?)\s*;\s*(?:\((?P<marker>.+)\)\s+and\s+)?extra\s*==\s*"(?P<extra>[^"]+)"$')


def checkout() -> Path | None:
    """The source checkout this package runs from (an editable install), or None (a wheel)."""
    root = PKG.parent
    return root if all((root / f).is_file() for f in (*TOP_FILES, DOCKERFILE)) else None


def version() -> str:
    root = checkout()
    if root:
        return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    return importlib.metadata.version("areal-kit")


def accelerator(facts: list[dict]) -> str:
    """cuda when any host has a GPU (nvidia-smi, from preflight), else cpu."""
    def gpus(v: int | str) -> int:  # nvidia-smi's count, as JSON gave it
        return v if isinstance(v, int) else int(v) if str(v).isdigit() else 0
    return "cuda" if any(gpus(f.get("gpus", 0)) > 0 for f in facts) else "cpu"


def _generated_top_files() -> dict[str, bytes]:
    """pyproject.toml, setup.py and README.md for a wheel install, from the package's metadata."""
    dist = importlib.metadata.distribution("areal-kit")
    md = dist.metadata
    base: list[str] = []
    extras: dict[str, list[str]] = {}
    for req in md.get_all("Requires-Dist") or []:
        m = _EXTRA.match(req)
        if not m:
            base.append(req)
        else:
            extras.setdefault(m["extra"], []).append(m["req"] + (f"; {m['marker']}" if m["marker"] else ""))
    s = json.dumps  # a TOML basic string is a JSON string
    lines = ['[build-system]', 'requires = ["setuptools>=77"]', 'build-backend = "setuptools.build_meta"', '',
             '[project]', f'name = {s(md["Name"])}', f'version = {s(md["Version"])}',
             f'requires-python = {s(md["Requires-Python"] or ">=3.11")}', f'dependencies = {s(base)}', '',
             '[project.optional-dependencies]', *(f'{s(k)} = {s(v)}' for k, v in extras.items()), '',
             '[project.scripts]', *(f'{s(e.name)} = {s(e.value)}' for e in dist.entry_points
                                    if e.group == "console_scripts"), '',
             '[tool.setuptools.package-dir]', *(f'{s(p)} = {s(d)}' for d, p in MAPPED.items()), '',
             '[tool.setuptools.package-data]', '"*" = ["*.yaml", "*.json", "Dockerfile"]', '']
    setup_py = ('from setuptools import find_packages, setup\n\n'
                f'setup(packages=[*find_packages(include=["areal_kit", "areal_kit.*"]), *{list(MAPPED.values())!r}])\n')
    readme = f"# {md['Name']} {md['Version']}\n\n{md['Summary'] or ''}\n"
    return {"pyproject.toml": "\n".join(lines).encode(), "setup.py": setup_py.encode(), "README.md": readme.encode()}


def _walk(root: Path, skip_top: set[str]) -> Iterator[tuple[Path, Path | None]]:
    """(relative path, file or None for a folder) under root, sorted, without caches and venvs."""
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root)
        dirs[:] = sorted(x for x in dirs if x not in SKIP and not x.endswith(".egg-info")
                         and not (rel == Path(".") and x in skip_top))
        if rel != Path("."):
            yield rel, None
        for f in sorted(files):
            if not f.endswith((".pyc", ".pyo")):
                yield rel / f, Path(d) / f


def context_files() -> list[tuple[str, bytes | None, bool]]:
    """Every entry of the build context: (path in the context, bytes or None for a folder, executable)."""
    root = checkout()
    top = {f: (root / f).read_bytes() for f in TOP_FILES} if root else _generated_top_files()
    entries: list[tuple[str, bytes | None, bool]] = [(f, data, False) for f, data in top.items()]
    folders = {"areal_kit": PKG, **{d: (root or PKG) / d for d in MAPPED}}
    for name, where in folders.items():
        entries.append((name, None, False))
        # A wheel installs the mapped folders inside areal_kit/: they go to the context's top.
        for rel, path in _walk(where, set(MAPPED) if name == "areal_kit" else set()):
            if path is None:
                entries.append((f"{name}/{rel}", None, False))
            else:
                entries.append((f"{name}/{rel}", path.read_bytes(), os.access(path, os.X_OK)))
    # The Dockerfile COPYs these folders, which a wheel install does not have.
    for d in ("docker/certs", "docker/wheels"):
        if not any(e[0] == d for e in entries):
            entries.append((d, None, False))
    return sorted(entries, key=lambda e: e[0])


def context_tar() -> bytes:
    """The build context as an uncompressed tarball, byte for byte the same for the same files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, executable in context_files():
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755 if executable else 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass(frozen=True)
class OwnImage:
    """areal-kit's own image for one cluster: what to build, its tag, where its tarball goes."""

    tag: str  # areal-kit:VERSION-ACCELERATOR-DIGEST
    accelerator: str  # cpu | cuda
    build_args: dict[str, str]
    context: bytes  # the build context tarball


def tarball_path(storage: str, tag: str) -> str:
    """Where the image is saved on the shared storage: STORAGE/images/areal-kit-VERSION-ACC-DIGEST.tar."""
    return f"{storage.rstrip('/')}/images/{tag.replace(':', '-')}.tar"


def resolve(accel: str, user_args: list[str]) -> OwnImage:
    """The image for these hosts: ACCELERATOR from their GPUs unless --build-arg names it; for cpu the
    stack's Debian base unless BASE_IMAGE is given. The tag's digest covers the context and the build
    args, so a changed source or argument builds a new image and never reuses an old one."""
    given = dict(a.split("=", 1) for a in user_args)
    accel = given.get("ACCELERATOR", accel)
    args = {"ACCELERATOR": accel}
    if accel == "cpu":
        args["BASE_IMAGE"] = stack.versions("cpu")["base_image"]
    args.update(given)
    ctx = context_tar()
    digest = hashlib.sha256(ctx + json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    return OwnImage(f"areal-kit:{version()}-{accel}-{digest}", accel, args, ctx)


def build_cmd(own: OwnImage, context_path: str) -> str:
    """docker build reading the context tarball on stdin (-f names a path inside it); host network,
    as the Ray containers use, so RUN steps reach the network where a bridge would not."""
    args = [a for k, v in own.build_args.items() for a in ("--build-arg", f"{k}={v}")]
    return q("docker", "build", "--network", "host", "-t", own.tag, "-f", DOCKERFILE, *args, "-") + \
        " < " + shlex.quote(context_path)


def save_cmd(tag: str, path: str, token: str) -> str:
    """docker save to a temporary name, renamed when complete: a crash never leaves a partial tarball
    under the name the other nodes (and later runs) load."""
    tmp = f"{path}.partial-{token}"
    # docker save writes 0600; root on the other nodes may be another user on NFS (root_squash).
    return (f"{q('mkdir', '-p', os.path.dirname(path))} && {q('docker', 'save', '-o', tmp, tag)} && "
            f"{q('chmod', '644', tmp)} && {q('mv', '-f', tmp, path)} || {{ rc=$?; rm -f {shlex.quote(tmp)}; exit $rc; }}")


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2 or (argv[1:] and argv[1] not in ("cpu", "cuda")):
        print("usage: python -m areal_kit.cluster.image OUT.tar [cpu|cuda]", file=sys.stderr)
        return ExitCode.BAD_INPUT
    own = resolve(argv[1] if argv[1:] else "cuda", [])
    Path(argv[0]).write_bytes(own.context)
    print(own.tag)
    print(build_cmd(own, argv[0]))
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

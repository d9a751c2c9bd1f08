"""areal-kit's own runtime image reaches every node with no registry: the build context made from the
installed package (a checkout or a wheel), the CPU/GPU choice, the tag, the crash-safe save, and the
setup step per host (build on the head, load on the others, present the second time), all without a
host or a docker daemon.

    .venv/bin/python -m pytest tests/unit/test_cluster_image.py
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest
from cli_run import cli

from areal_kit.cluster import image, steps
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import Step, run_steps
from areal_kit.cluster.remote import HostLog, Result
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.console import make_console
from areal_kit.errors import UserError

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kit_home")]
ROOT = Path(__file__).resolve().parents[2]


def members(ctx: bytes) -> dict[str, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(ctx)) as t:
        return {m.name: t.extractfile(m).read() if m.isfile() else None for m in t.getmembers()}


def host_blocks(out: str) -> dict[str, str]:
    return {b.split()[0]: b for b in ("\n" + out).split("\n# ")[1:]}


# -- the build context -----------------------------------------------------------------------
def test_the_context_holds_the_dockerfile_and_the_sources_and_no_venv_or_caches():
    (ROOT / "areal_kit" / "__pycache__").mkdir(exist_ok=True)  # as any import leaves it
    files = members(image.context_tar())
    assert files["docker/Dockerfile"] == (ROOT / "docker" / "Dockerfile").read_bytes()
    for name in ("pyproject.toml", "setup.py", "README.md", "areal_kit/cluster/image.py", "areal_kit/stack.py",
                 "train_scripts/tiny.yaml", "evaluation/manifest.yaml"):
        assert files[name] == (ROOT / name).read_bytes(), name
    bad = [n for n in files if "__pycache__" in n or ".venv" in n or n.endswith(".pyc") or ".egg-info" in n]
    assert bad == []


def test_every_source_the_dockerfile_copies_is_in_the_context():
    files = members(image.context_tar())
    copies = re.findall(r"^COPY (.+) \S+$", (ROOT / "docker" / "Dockerfile").read_text(), re.MULTILINE)
    sources = [s.rstrip("/") for line in copies for s in line.split()]
    assert sources and all(s in files for s in sources), [s for s in sources if s not in files]


def test_the_context_is_the_same_bytes_each_time_so_the_tag_is_too():
    assert image.context_tar() == image.context_tar()
    assert image.resolve("cpu", []).tag == image.resolve("cpu", []).tag


def test_the_mapped_folders_are_pyprojects():
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {d: p for p, d in mapped.items()} == image.MAPPED


def test_a_wheel_install_gets_a_generated_pyproject_and_its_folders_at_the_context_top(tmp_path, monkeypatch):
    """A wheel has no pyproject.toml, setup.py or README.md, and holds the mapped folders inside areal_kit/."""
    pkg = tmp_path / "site-packages" / "areal_kit"
    shutil.copytree(ROOT / "areal_kit", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("train_scripts", "evaluation"):
        shutil.copytree(ROOT / folder, pkg / folder)
    (pkg / "docker").mkdir()
    shutil.copy(ROOT / "docker" / "Dockerfile", pkg / "docker" / "Dockerfile")
    monkeypatch.setattr(image, "PKG", pkg)
    assert image.checkout() is None
    files = members(image.context_tar())
    assert files["train_scripts/tiny.yaml"] == (ROOT / "train_scripts" / "tiny.yaml").read_bytes()
    assert not any(n.startswith(("areal_kit/train_scripts", "areal_kit/evaluation", "areal_kit/docker")) for n in files)
    assert files["docker/certs"] is None and files["docker/wheels"] is None  # the Dockerfile COPYs both
    generated = tomllib.loads(files["pyproject.toml"].decode())
    real = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert generated["tool"]["setuptools"]["package-dir"] == real["tool"]["setuptools"]["package-dir"]
    assert generated["project"]["optional-dependencies"]["cpu"] == real["project"]["optional-dependencies"]["cpu"]
    assert generated["project"]["scripts"] == real["project"]["scripts"]
    assert len(generated["project"]["dependencies"]) == len(real["project"]["dependencies"])
    assert b"areal_kit.docker" in files["setup.py"]


# -- CPU or GPU, tag, build args ---------------------------------------------------------------
@pytest.mark.parametrize("facts,want", [
    ([{"gpus": 0}, {"gpus": 8}], "cuda"),
    ([{"gpus": 0}, {"gpus": 0}], "cpu"),
    ([{"gpus": "none"}, {}], "cpu"),  # a host whose preflight stopped early
    ([{"gpus": "4"}], "cuda"),
])
def test_the_accelerator_follows_the_hosts_gpus(facts, want):
    assert image.accelerator(facts) == want


def test_cpu_builds_on_the_stacks_debian_base_and_build_args_win():
    cpu = image.resolve("cpu", [])
    assert cpu.build_args == {"ACCELERATOR": "cpu", "BASE_IMAGE": "debian:bookworm-slim"}
    assert re.fullmatch(rf"areal-kit:{re.escape(image.version())}-cpu-[0-9a-f]{{12}}", cpu.tag)
    assert image.resolve("cuda", []).build_args == {"ACCELERATOR": "cuda"}
    mine = image.resolve("cpu", ["BASE_IMAGE=areal-kit-base:bookworm", "PY_ENV=storage"])
    assert mine.build_args["BASE_IMAGE"] == "areal-kit-base:bookworm"
    assert mine.tag != cpu.tag  # other arguments, another image
    assert image.resolve("cpu", ["ACCELERATOR=cuda"]).accelerator == "cuda"


def test_the_build_reads_the_context_on_stdin_and_names_the_dockerfile_inside_it():
    own = image.resolve("cpu", ["VENV=/x y"])
    cmd, _, ctx = image.build_cmd(own, "/tmp/ctx.tar").partition(" < ")
    words = shlex.split(cmd)
    assert words[:2] == ["docker", "build"] and words[-1] == "-"
    assert words[words.index("-f") + 1] == "docker/Dockerfile"
    assert words[words.index("-t") + 1] == own.tag
    assert "VENV=/x y" in words
    assert ctx == "/tmp/ctx.tar"


def fake_docker(tmp_path, script: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\n" + script)
    (bin_dir / "docker").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_a_save_that_dies_midway_leaves_no_tarball_for_a_later_run_to_trust(tmp_path):
    final = tmp_path / "storage" / "images" / "areal-kit-0.1.0-cpu-abc.tar"
    env = fake_docker(tmp_path, 'printf half > "$3"; exit 137\n')  # docker save -o TMP TAG
    r = subprocess.run(["sh", "-c", image.save_cmd("areal-kit:0.1.0-cpu-abc", str(final), "tok")], env=env,
                       check=False)
    assert r.returncode == 137
    assert list(final.parent.iterdir()) == []


def test_a_complete_save_is_renamed_into_place_readable_by_all(tmp_path):
    final = tmp_path / "storage" / "images" / "areal-kit-0.1.0-cpu-abc.tar"
    env = fake_docker(tmp_path, 'printf image > "$3"; chmod 600 "$3"\n')
    subprocess.run(["sh", "-c", image.save_cmd("areal-kit:0.1.0-cpu-abc", str(final), "tok")], env=env, check=True)
    assert [p.name for p in final.parent.iterdir()] == [final.name]
    assert final.read_text() == "image" and final.stat().st_mode & 0o777 == 0o644


def test_the_tarball_lies_under_storage_images_named_after_the_tag():
    assert image.tarball_path("/storage/", "areal-kit:0.1.0-cuda-0123456789ab") == \
        "/storage/images/areal-kit-0.1.0-cuda-0123456789ab.tar"


# -- setup, dry run ------------------------------------------------------------------------------
def test_dry_run_with_no_image_builds_on_the_head_and_loads_on_the_others(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1", "h2", "h3", "--dry-run", "--n-gpus-per-node", "8")
    assert code == 0
    blocks = host_blocks(out)
    head = blocks["h1"]
    build = next(ln for ln in head.splitlines() if "docker build" in ln)
    assert "--build-arg ACCELERATOR=cuda" in build and "BASE_IMAGE" not in build
    words = shlex.split(build.split("] ", 1)[1].split(" < ")[0])
    tag = words[words.index("-t") + 1]
    tar = image.tarball_path("/storage", tag)
    assert "sftp put" in head and f"docker save -o {tar}.partial-" in head and f" {tar} ||" in head
    assert "docker run -d" in head and f" {tag} python3 -m ray" in head
    for worker in ("h2", "h3"):
        assert f"docker load -i {tar}" in blocks[worker]
        assert "docker build" not in blocks[worker] and "docker pull" not in blocks[worker]
        assert f" {tag} python3 -m ray" in blocks[worker]


def test_dry_run_on_cpu_hosts_passes_the_debian_base_and_the_users_build_args(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2", "--dry-run", "--build-arg", "PY_ENV=storage",
                       "--build-arg", "VENV=/opt/v env")
    assert code == 0
    build = next(ln for ln in out.splitlines() if "docker build" in ln)
    for arg in ("ACCELERATOR=cpu", "BASE_IMAGE=debian:bookworm-slim", "PY_ENV=storage", "'VENV=/opt/v env'"):
        assert f"--build-arg {arg}" in build, arg


def test_dry_run_with_an_image_named_pulls_it_everywhere(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2", "--dry-run", "--image", "ghcr.io/o/areal-kit:0.1.0-cuda")
    assert code == 0
    for block in host_blocks(out).values():
        assert "docker pull ghcr.io/o/areal-kit:0.1.0-cuda" in block
        assert "docker build" not in block and "docker load" not in block


def test_dry_run_with_a_tarball_loads_it_everywhere(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2", "--dry-run", "--image", "areal-kit:cpu-test",
                       "--image-tar", "/storage/images/areal-kit-cpu.tar")
    assert code == 0
    for block in host_blocks(out).values():
        assert "docker load -i /storage/images/areal-kit-cpu.tar" in block
        assert "docker build" not in block and "docker pull" not in block
        assert "areal-kit:cpu-test python3 -m ray" in block


BAD = [
    (["--build-arg", "NOEQUALS"], "--build-arg: expected KEY=VALUE, got 'NOEQUALS'"),
    (["--build-arg", "1X=y"], "--build-arg: expected KEY=VALUE"),
    (["--build-arg", "ACCELERATOR=rocm"], "ACCELERATOR must be cpu or cuda"),
    (["--build-arg", "PY_ENV=storage", "--image", "ghcr.io/o/areal-kit:0.1.0-cpu"], "drop one or the other"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[b[1] for b in BAD])
def test_a_bad_build_arg_is_one_line(capsys, args, needle):
    code, _, err = cli(capsys, "setup", "--hostnames", "h1", "--dry-run", *args)
    assert code == 2
    assert err.startswith("error: ") and needle in err
    assert len(err.strip().splitlines()) == 1


def test_saved_state_from_before_the_own_image_still_loads():
    spec = ClusterSpec(hosts=[HostSpec("n0")])
    old = SetupOptions(spec=spec).to_state()
    del old["build_args"]
    old["image"] = "areal-kit:latest"
    assert SetupOptions.from_state(old).image == "areal-kit:latest"
    assert SetupOptions.from_state(SetupOptions(spec=spec).to_state()).image is None
    assert SetupOptions(spec=spec, image_tar="/storage/x.tar").image == "areal-kit:latest"  # as before
    with pytest.raises(UserError):
        SetupOptions(spec=spec, build_args=["X"])


# -- the step on hosts ---------------------------------------------------------------------------
class DockerHost:
    """A scripted host: its docker images, and the shared storage's files (one dict for all hosts)."""

    def __init__(self, storage: dict[str, str]):
        self.images: set[str] = set()
        self.storage = storage
        self.log = HostLog(None, [])
        self.commands: list[str] = []
        self.uploads: dict[str, bytes] = {}
        self.user, self.is_root = "root", True

    def put_bytes(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.uploads[path] = data

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout: float | None = None) -> Result:
        self.commands.append(cmd)
        w = shlex.split(cmd.split(" < ")[0].split(" && ")[0])
        ok = True
        if w[:3] == ["docker", "image", "inspect"]:
            ok = w[-1] in self.images
        elif w[:2] == ["test", "-f"]:
            ok = w[2] in self.storage
        elif w[:2] == ["docker", "build"]:
            self.images.add(w[w.index("-t") + 1])
        elif w[:2] == ["mkdir", "-p"]:  # the save
            tag, path = re.search(r"docker save -o \S+ (\S+) .* mv -f \S+ (\S+) \|\|", cmd).groups()
            self.storage[path] = tag
        elif w[:2] == ["docker", "load"]:
            self.images.add(self.storage[w[-1]])
        return Result(cmd, 0 if ok else 1, "sha256:0123456789abcdef0123" if ok else "")


def docker_cluster(n: int, gpus: list[int]) -> Cluster:
    spec = ClusterSpec(hosts=[HostSpec(f"n{i}") for i in range(n)])
    storage: dict[str, str] = {}
    hosts = [HostState(spec=h, index=i, remote=DockerHost(storage), facts={"gpus": g})
             for i, (h, g) in enumerate(zip(spec.hosts, gpus, strict=True))]
    return Cluster(opts=SetupOptions(spec=spec), hosts=hosts)


def test_the_head_builds_once_the_others_load_and_a_second_setup_finds_it_present():
    c = docker_cluster(3, [8, 8, 8])
    assert run_steps(c, [Step("image", steps.image, head_first=True)], make_console())
    head, *others = c.hosts
    said = {h.name: h.outcomes["image"] for h in c.hosts}
    tar = image.tarball_path("/storage", c.image)
    assert re.fullmatch(rf"built {re.escape(c.image)} \(cuda\) in \d+ s; saved to {re.escape(tar)}",
                        said["n0"].message)
    assert [said[h.name].message for h in others] == [f"loaded {c.image} from {tar}"] * 2
    assert list(head.remote.uploads.values()) == [image.resolve("cuda", []).context]
    assert any(cmd.startswith("rm -f /tmp/areal-kit-context-") for cmd in head.remote.commands)
    first = c.image
    again = Cluster(opts=c.opts, hosts=c.hosts)
    for h in again.hosts:
        h.outcomes.clear()
    assert run_steps(again, [Step("image", steps.image, head_first=True)], make_console())
    assert again.image == first
    assert [h.outcomes["image"].status for h in again.hosts] == ["ok"] * 3
    assert all("present" in h.outcomes["image"].message for h in again.hosts)
    assert sum("docker build" in cmd for cmd in head.remote.commands) == 1


def test_one_host_builds_and_saves_nothing():
    c = docker_cluster(1, [0])
    assert run_steps(c, [Step("image", steps.image, head_first=True)], make_console())
    assert "(cpu)" in c.hosts[0].outcomes["image"].message
    assert "saved" not in c.hosts[0].outcomes["image"].message
    assert c.hosts[0].remote.storage == {}


def test_a_head_that_has_the_image_writes_the_missing_tarball_for_the_others():
    c = docker_cluster(2, [0, 0])
    c.hosts[0].remote.images.add(image.resolve("cpu", []).tag)
    assert run_steps(c, [Step("image", steps.image, head_first=True)], make_console())
    assert c.hosts[0].outcomes["image"].message.startswith(f"{c.image} present; saved to ")
    assert c.hosts[1].outcomes["image"].message.startswith(f"loaded {c.image}")
    assert not any("docker build" in cmd for cmd in c.hosts[0].remote.commands)

"""`areal-kit setup/status/down` without any host: dry-run output (every command, shell-safe
quoting, no secrets), bad options (exit 2, one line), the step runner's failure handling,
secret masking in logs, and the data fetcher on file:// URIs."""

from __future__ import annotations

import hashlib
import shlex

import pytest

from areal_kit.cli import main
from areal_kit.cluster import fetch
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import Step, StepFailed, run_steps
from areal_kit.cluster.remote import HostLog
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.console import make_console


def cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = main(list(args))
        code = rc or 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def kit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))


def test_dry_run_lists_every_step_per_host(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1", "h2", "h3", "--dry-run", "--train_param", "tiny",
                       "--data", "hf://org/model")
    assert code == 0
    blocks = ("\n" + out).split("\n# ")[1:]
    assert [b.split()[0] for b in blocks] == ["h1", "h2", "h3"]  # the guide's `--hostnames h1 h2 h3`
    head, worker = blocks[0], blocks[1]
    for needle in ("os-release", "apt-get install", "docker image inspect", "docker build --network host -t areal-kit:",
                   "--head --port 6379", "areal_kit.cluster.fetch", "areal_kit.cli train tiny"):
        assert needle in head, needle
    assert "--address h1:6379" in worker
    assert "--head" not in worker
    assert "train tiny" not in worker
    assert "RAY_AUTH_MODE=disabled" in head
    assert "--dashboard-host h1" in head


def test_hostile_paths_are_single_shell_words(capsys):
    storage = "/tmp/a b;touch /tmp/pwned;$(id)"
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2", "--dry-run", "--storage", storage,
                       "--image", "img:1", "--mount", "/x y:/z")
    assert code == 0
    run = next(ln for ln in out.splitlines() if "docker run -d" in ln and "head" in ln)
    words = shlex.split(run.split("] ", 1)[1])
    assert f"{storage}:{storage}" in words
    assert "/x y:/z" in words
    mk = next(ln for ln in out.splitlines() if "shared-check" in ln and "mkdir" in ln)
    words = shlex.split(mk.split("] ", 1)[1])
    assert f"{storage}/.areal-kit" in words  # one word: no `;` or `$(` reaches the shell


def test_secrets_never_printed(capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETVALUE123")
    code, out, err = cli(capsys, "setup", "--hostnames", "h1", "--dry-run", "--wandb-key", "wb_SECRET456",
                         "--train_param", "tiny")
    assert code == 0
    assert "SECRET" not in out + err
    assert "--env-file /root/.areal-kit/areal.env" in out  # they travel in a 0600 file instead


def test_host_runtime_dry_run_has_no_docker(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2", "--dry-run", "--runtime", "host",
                       "--python", "/opt/venv/bin/python")
    assert code == 0
    assert "docker" not in out
    assert "/opt/venv/bin/python -m ray.scripts.scripts start" in out


def test_down_dry_run_from_saved_state_needs_state(capsys):
    code, _, err = cli(capsys, "down", "--dry-run", "--name", "nosuch")
    assert code == 2
    assert "no cluster named 'nosuch'" in err
    code, out, _ = cli(capsys, "down", "--dry-run", "--hostnames", "h1,h2")
    assert code == 0
    assert "docker rm -f" in out


BAD_OPTIONS = [
    (["setup", "--dry-run"], "no hosts"),
    (["setup", "--hostnames", "h1", "--runtime", "podman"], "--runtime"),
    (["setup", "--hostnames", "h1", "--mount", "rel/path"], "--mount"),
    (["setup", "--hostnames", "h1", "--data", "ftp://x/y"], "--data"),
    (["setup", "--hostnames", "h1", "--data", "https://x/y#md5=abc"], "sha256"),
    (["setup", "--hostnames", "h1", "--shm-size", "lots"], "--shm-size"),
    (["setup", "--hostnames", "h1", "--host-key-policy", "yolo"], "--host-key-policy"),
    (["setup", "--hostnames", "h1", "--env", "1BAD=x"], "--env"),
    (["setup", "--hostnames", "h1", "--train_param", "tiny;rm"], "--train_param"),
    (["setup", "--hostnames", "h1", "--ssh_port", "0"], "port"),
    (["setup", "--hostnames", "h1", "--ray-auth-mode", "maybe"], "--ray-auth-mode"),
    (["setup", "--hostnames", "h1", "--private_key_file", "/nonexistent/key"], "does not exist"),
    (["setup", "--hostnames", "h1", "--inventory", "x.yaml"], "not both"),
    (["setup", "--hostnames", "h1", "--ssh-config", "/nonexistent/ssh_config"], "--ssh-config"),
    (["setup", "--hostnames", "h1", "--gateway", "jump host"], "--gateway"),
    (["status", "--hostnames", "h1", "--ssh-config", "/nonexistent/ssh_config"], "--ssh-config"),
]


@pytest.mark.parametrize("args,needle", BAD_OPTIONS, ids=[b[1] for b in BAD_OPTIONS])
def test_bad_options_exit_2_one_line(capsys, args, needle):
    code, _, err = cli(capsys, *args)
    assert code == 2
    assert err.startswith("error: ")
    assert needle in err
    assert len(err.strip().splitlines()) == 1


def test_loose_key_permissions_refused(capsys, tmp_path):
    key = tmp_path / "k"
    key.write_text("x")
    key.chmod(0o644)
    code, _, err = cli(capsys, "setup", "--hostnames", "h1", "--private_key_file", str(key), "--dry-run")
    assert code == 2
    assert "chmod 600" in err


def test_every_option_has_help(capsys):
    for sub in ("setup", "status", "down"):
        code, _, _ = cli(capsys, sub, "--help")
        assert code == 0
    import inspect

    from areal_kit.cluster import cmd

    for fn in (cmd.setup, cmd.status, cmd.down):
        for p in inspect.signature(fn).parameters.values():
            assert getattr(p.default, "help", None), f"{fn.__name__} --{p.name} has no help"


# -- runner ----------------------------------------------------------------------------------
class FakeRemote:
    def __init__(self):
        self.log = HostLog(None, [])

    def close(self):
        pass


def make_cluster(n=3):
    spec = ClusterSpec(hosts=[HostSpec(f"n{i}") for i in range(n)])
    hosts = [HostState(spec=h, index=i, remote=FakeRemote()) for i, h in enumerate(spec.hosts)]
    return Cluster(opts=SetupOptions(spec=spec), hosts=hosts)


def test_runner_failed_host_drops_out_others_go_on(capsys):
    c = make_cluster()
    calls = []

    def a(cl, h):
        calls.append(("a", h.name))
        if h.name == "n2":
            raise StepFailed("boom on n2")
        return Outcome("changed")

    def b(cl, h):
        calls.append(("b", h.name))
        return Outcome("ok")

    ok = run_steps(c, [Step("a", a), Step("b", b)], make_console())
    assert not ok
    assert ("b", "n2") not in calls
    assert ("b", "n0") in calls
    assert ("b", "n1") in calls
    assert c.hosts[2].outcomes["b"].status == "skipped"
    out = capsys.readouterr().out
    assert "FAILED [n2] a: boom on n2" in out
    assert "recap" in out


def test_runner_head_failure_skips_workers_and_head_last_order():
    c = make_cluster()
    order = []

    def step(cl, h):
        order.append(h.name)
        if h.is_head:
            raise StepFailed("head broke")
        return Outcome("ok")

    assert not run_steps(c, [Step("s", step, head_first=True)], make_console())
    assert order == ["n0"]
    assert c.hosts[1].outcomes["s"].status == "skipped"
    c, order = make_cluster(), []
    run_steps(c, [Step("d", lambda cl, h: order.append(h.name) or Outcome("ok"), head_last=True)], make_console())
    assert order[-1] == "n0"
    assert sorted(order) == ["n0", "n1", "n2"]


def test_unexpected_exception_is_a_failure_not_a_crash():
    c = make_cluster(2)

    def step(cl, h):
        if h.name == "n1":
            raise KeyError("surprise")
        return Outcome("ok")

    assert not run_steps(c, [Step("s", step)], make_console())
    assert c.hosts[1].outcomes["s"].status == "failed"
    assert "surprise" in c.hosts[1].outcomes["s"].message


def test_host_log_masks_secrets(tmp_path):
    log = HostLog(tmp_path / "h.log", ["tok_ABC"])
    log.write("$ echo tok_ABC\nvalue tok_ABC here")
    text = (tmp_path / "h.log").read_text()
    assert "tok_ABC" not in text
    assert text.count("***") == 2


# -- data fetcher ----------------------------------------------------------------------------
def test_fetch_file_uri_once_with_checksum(tmp_path, capsys):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    dest = tmp_path / "store" / "datasets" / "src.bin"
    uri = f"file://{src}#sha256={digest}"
    assert fetch.main(["--check", uri, str(dest)]) == 1
    assert fetch.main([uri, str(dest)]) == 0
    assert dest.read_bytes() == src.read_bytes()  # a file lands as a file
    assert fetch.main(["--check", uri, str(dest)]) == 0
    dest.write_bytes(b"short")  # damaged: size differs
    assert fetch.main(["--check", uri, str(dest)]) == 1
    assert fetch.main([f"file://{src}#sha256={'0' * 64}", str(tmp_path / "other")]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    assert not (tmp_path / "other").exists()
    assert not (tmp_path / ".other.partial").exists()


def test_fetch_directory_and_verify(tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"abc")
    dest = tmp_path / "models" / "model"
    assert fetch.main([f"file://{src}", str(dest)]) == 0
    assert fetch.main(["--check", "--verify", f"file://{src}", str(dest)]) == 0
    (dest / "sub" / "w.bin").write_bytes(b"abd")  # same size, other bytes
    assert fetch.main(["--check", f"file://{src}", str(dest)]) == 0
    assert fetch.main(["--check", "--verify", f"file://{src}", str(dest)]) == 1


def test_data_destinations():
    from areal_kit.cluster.data import dest_for

    assert dest_for("/s", "hf://org/Model-1.5B") == "/s/models/Model-1.5B"
    assert dest_for("/s/", "hf://datasets/org/math") == "/s/datasets/math"
    assert dest_for("/s", "https://x.org/a/b.jsonl#sha256=" + "0" * 64) == "/s/datasets/b.jsonl"

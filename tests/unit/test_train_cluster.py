"""`areal-kit train PRESET --cluster NAME`: setup's train and train_wait steps alone, on the cluster setup
saved, with the fileroot and storage setup used; refused (exit 2) while the run's driver runs on the head;
and the runtime's environment, which gives `areal-kit train PRESET` run on the head the same places.

The head is this machine, as a host-runtime head: its commands run here through a local stand-in for
the SSH connection (no sshd here). The run's lock is the real one (rl/driver/launch.py hold_run_lock); the
driver is a stand-in with the real driver's command line that writes the run's own log lines (a real
run needs the cluster's Ray: tests/cluster/test_guide_cluster.py runs one)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import assert_one_line_error, cli

from areal_kit import runlog
from areal_kit.cluster import cmd as cluster_cmd
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions, save_state
from areal_kit.cluster.ray_cluster import docker_run_args
from areal_kit.cluster.remote import ConnectError, HostLog, Result
from areal_kit.cluster.target import Hosts
from areal_kit.config.loader import RUN_ENV, load_config
from areal_kit.rl.driver import launch

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kit_home")]
# A preset no one trains on this CPU machine: `pgrep` for its driver finds only this test's.
PRESET = "7B_n1_lora"
READY = "Workers ready in 1.0s: 1 trainer rank(s), 1 rollout engine(s), weight sync broadcast: gloo."


def saved(name: str, storage: str, runtime: str = "docker", python: str = "python3", **more) -> SetupOptions:
    """What a setup of `name` saved: its hosts, runtime, storage (fileroot under it), setup's own preset."""
    opts = SetupOptions(spec=Hosts(hostnames=["h1", "h2"], name=name, storage=storage).spec(), runtime=runtime,
                        python=python, train_param="tiny_storage", train_args=["actor.lr=9e-9"], **more)
    save_state(opts)
    return opts


def commands(out: str) -> list[str]:
    return [ln.strip() for ln in out.splitlines() if ln.startswith("  [")]


# -- the commands, as a dry run -----------------------------------------------------------------
def test_the_head_runs_setups_start_with_this_preset_and_overrides(capsys):
    saved("lab", "/mnt/st")
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "lab", "--dry-run", "--fresh", "actor.lr=1e-3")
    assert code == 0, err
    cmds = commands(out)
    assert cmds[0] == "[connect] ssh root@h1"
    start = [c for c in cmds if c.startswith("[run] docker exec -d areal-lab-head sh -c ")]
    assert len(start) == 1, cmds
    inner = shlex.split(start[0])[-1]
    log = f"/mnt/st/ray/experiments/logs/lab-{PRESET}.log"
    assert inner == (f"mkdir -p /mnt/st/ray/experiments/logs && cd /mnt/st && exec python3 -m areal_kit.cli train "
                     f"{PRESET} ray_address=auto fileroot=/mnt/st/ray/experiments storage_root=/mnt/st actor.lr=1e-3 "
                     f"--fresh >> {log} 2>&1")
    assert "9e-9" not in out  # setup's --train-arg stay setup's
    # first the run's driver is looked for (its preset's, and whoever holds the run's lock), then the log waited on
    check = out[out.index("[check]"):out.index("[check]", out.index("[check]") + 1)]
    assert "pgrep -o -f" in check and ".driver.lock" in check and f"/mnt/st/ray/experiments ppo-r1-distill {PRESET}'" in check
    assert cmds[-1].startswith("[every 5s, up to 900s] docker exec areal-lab-head") and log in cmds[-1]
    for other in ("docker run", "ray.scripts", "apt-get", "docker load"):  # setup's other steps: none
        assert other not in out, other


def test_on_a_host_runtime_head_the_driver_gets_the_runtime_env_and_setups_secrets(capsys):
    saved("bare", "/st", runtime="host", python="/opt/venv/bin/python")
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "bare", "--dry-run", "--train-wait", "0")
    assert code == 0, err
    start = next(c for c in commands(out) if "setsid" in c)
    assert "if [ -f /root/.areal-kit/bare.env ]; then set -a; . /root/.areal-kit/bare.env; set +a; fi;" in start
    assert "AREAL_KIT_FILEROOT=/st/ray/experiments AREAL_KIT_STORAGE_ROOT=/st AREAL_KIT_RAY_ADDRESS=auto" in start
    assert f"/opt/venv/bin/python -m areal_kit.cli train {PRESET} ray_address=auto" in start
    assert "echo $! > /st/.areal-kit/train-bare.pid" in start
    assert "[every " not in out  # --train-wait 0


@pytest.mark.parametrize("argv,needle", [
    (["--cluster", "nosuch"], "--cluster nosuch: no cluster of that name was set up from here"),
    (["--cluster", "lab", "actor.lrr=1"], "unknown config key 'actor.lrr'"),
    (["--train-wait", "5"], "--train-wait goes with --cluster"),
])
def test_bad_input_is_one_line_before_any_host(capsys, monkeypatch, argv, needle):
    saved("lab", "/mnt/st")
    monkeypatch.setattr(cluster_cmd, "_build", lambda *a: pytest.fail("a host was to be contacted"))
    code, out, err = cli(capsys, "train", PRESET, *argv)
    assert_one_line_error(code, err, needle)
    assert out == ""


def test_an_unknown_cluster_names_the_saved_ones(capsys):
    saved("lab", "/mnt/st")
    saved("lab2", "/mnt/st")
    code, _, err = cli(capsys, "train", PRESET, "--cluster", "areal")
    assert_one_line_error(code, err, "expected the --name given to setup (default areal): lab, lab2")


def test_a_yaml_of_this_machine_is_refused(capsys, tmp_path):
    saved("lab", "/mnt/st")
    mine = tmp_path / "mine.yaml"
    mine.write_text("inherit: tiny\n")
    code, _, err = cli(capsys, "train", str(mine), "--cluster", "lab")
    assert_one_line_error(code, err, "the head reads presets by name from its own package")


# -- on a head: this machine, its commands run through a local stand-in for SSH -----------------
class LocalRemote:
    """The head's commands, run on this machine."""

    user = "root"

    def __init__(self):
        self.log = HostLog(None, [])
        self.ran: list[str] = []

    def connect(self) -> str:
        return "127.0.0.1"

    def run(self, cmd, sudo=False, check=False, timeout=None, quiet=False) -> Result:
        self.ran.append(cmd)
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, check=False)
        return Result(cmd, r.returncode, r.stdout, r.stderr)

    def close(self):
        pass


# The driver's stand-in: run as `PYTHON -m areal_kit.cli train PRESET ...` (pgrep sees the driver's command
# line), it writes its arguments and the run's first lines as its logger does, then stays a while;
# anything else (the lock check) runs on the real Python.
STUB = """#!/bin/sh
if [ "$1" = -m ]; then echo "argv: $*"; cat {lines}; sleep 20; exit 0; fi
exec {python} "$@"
"""


@pytest.fixture
def head(tmp_path, monkeypatch):
    """A host-runtime cluster `here` saved with storage under tmp_path; its head is this machine."""
    storage = tmp_path / "storage"
    (storage / ".areal-kit").mkdir(parents=True)
    lines = tmp_path / "lines"
    lines.write_text("".join(f"{ln}\n" for ln in run_lines(tmp_path, "Run x/y: 3 steps, 3 per epoch", READY)))
    stub = tmp_path / "python"
    stub.write_text(STUB.format(lines=lines, python=sys.executable))
    stub.chmod(0o755)
    opts = saved("here", str(storage), runtime="host", python=str(stub))
    remotes = []

    def build(o, copts, secrets):
        c = Cluster(opts=o, hosts=[HostState(spec=s, index=i, remote=LocalRemote()) for i, s in enumerate(o.spec.hosts)],
                    secrets=secrets)
        remotes.append(c.head.remote)
        return c

    monkeypatch.setattr(cluster_cmd, "_build", build)
    monkeypatch.setattr("areal_kit.cluster.train_start.POLL_S", 0.05)
    yield opts, remotes
    pidfile = storage / ".areal-kit" / "train-here.pid"
    if pidfile.exists():  # the stand-in driver this test started last: its session, by its id (setsid)
        pgid = int(pidfile.read_text().strip())
        subprocess.run(["kill", "--", f"-{pgid}"], check=False)
        end = time.monotonic() + 10  # gone before the next test looks for a running driver
        while _group_running(pgid):
            assert time.monotonic() < end, f"the stand-in driver's group {pgid} outlived SIGTERM"
            time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group pgid is still running: an exited one its parent has not reaped
    yet (a zombie) still answers `kill -0`, and is not."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,stat="], capture_output=True, text=True, check=False).stdout
    return any(int(g) == pgid and not s.startswith("Z") for g, s in (ln.split() for ln in out.splitlines()))


def run_lines(tmp_path, *messages: str) -> list[str]:
    log = runlog.RunLogger(runlog.run_paths(str(tmp_path / "runs"), "e", "t"), tensorboard=False, console=False)
    for msg in messages:
        log.info(msg)
    log.close()
    return Path(log.paths.log_file).read_text().splitlines()


def test_fresh_discard_reaches_the_heads_driver(capsys):
    """--discard (which deletes the run's recover checkpoints) travels with --fresh to the head."""
    saved("lab", "/mnt/st")
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "lab", "--dry-run", "--fresh", "--discard")
    assert code == 0, err
    [start] = [c for c in commands(out) if c.startswith("[run] docker exec -d areal-lab-head sh -c ")]
    assert shlex.split(start)[-1].endswith(f"--fresh --discard >> /mnt/st/ray/experiments/logs/lab-{PRESET}.log 2>&1")


def test_it_starts_the_driver_on_the_head_and_waits_for_its_sign_of_life(head, capsys):
    opts, _ = head
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "here", "--fresh", "actor.lr=1e-3",
                         "--train-wait", "20")
    assert code == 0, out + err
    log = Path(opts.spec.fileroot) / "logs" / f"here-{PRESET}.log"
    assert out.strip().splitlines()[-1] == f"training {PRESET}: workers ready, engines generating; log {log}"
    argv = log.read_text().splitlines()[0]
    assert argv == (f"argv: -m areal_kit.cli train {PRESET} ray_address=auto fileroot={opts.spec.fileroot} "
                    f"storage_root={opts.storage} actor.lr=1e-3 --fresh")


def test_a_second_start_while_its_driver_runs_is_refused(head, capsys):
    opts, remotes = head
    code, out, _ = cli(capsys, "train", PRESET, "--cluster", "here", "--train-wait", "0")
    log = Path(opts.spec.fileroot) / "logs" / f"here-{PRESET}.log"
    assert code == 0 and out.strip().splitlines()[-1] == f"training {PRESET} started; log {log}"
    end = time.monotonic() + 10
    while "Workers ready" not in log.read_text() and time.monotonic() < end:  # the stand-in has written its lines
        time.sleep(0.05)
    size = log.stat().st_size
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "here")
    assert_one_line_error(code, err, f"training {PRESET} is already running on h1 (driver pid ")
    assert "areal-kit status --name here" in err and out == ""
    assert not any("setsid" in c for c in remotes[-1].ran)  # nothing started
    assert log.stat().st_size == size


def test_a_driver_holding_the_runs_lock_refuses_the_start(head, capsys):
    """Another preset's driver, or one started by hand, of the same experiment and trial."""
    opts, remotes = head
    cfg = load_config(PRESET, [f"fileroot={opts.spec.fileroot}"])
    log_dir = runlog.run_paths(cfg.fileroot, cfg.experiment_name, cfg.trial_name).log_dir
    fd = launch.hold_run_lock(log_dir, "x")
    try:
        Path(log_dir, "driver.json").write_text(json.dumps({"pid": 4242, "host": "head-box"}))
        code, out, err = cli(capsys, "train", PRESET, "--cluster", "here")
        assert_one_line_error(code, err, f"run {cfg.experiment_name}/{cfg.trial_name} is already running on h1 "
                                         "(driver pid 4242 on head-box)")
        assert "another trial_name=" in err and out == ""
    finally:
        os.close(fd)
    # the lock released (its driver gone), the same command starts it
    assert cli(capsys, "train", PRESET, "--cluster", "here", "--train-wait", "0")[0] == 0
    assert any("setsid" in c for c in remotes[-1].ran)


def test_a_head_it_cannot_reach_is_one_line_exit_1(head, capsys, monkeypatch):
    def unreachable(self):
        raise ConnectError("unreachable", "h1:22: connection refused")

    monkeypatch.setattr(LocalRemote, "connect", unreachable)
    code, out, err = cli(capsys, "train", PRESET, "--cluster", "here")
    assert code == 1 and out == ""
    assert err.strip() == "error: cluster here, head h1: unreachable: h1:22: connection refused"


# -- the runtime's environment: what `areal-kit train PRESET` on the head reads --------------------
def test_the_runtime_sets_setups_places_and_ray(tmp_path):
    opts = saved("lab", "/mnt/st")
    c = Cluster(opts=opts, hosts=[HostState(spec=s, index=i) for i, s in enumerate(opts.spec.hosts)])
    c.hosts[0].remote, c.image = LocalRemote(), "img"
    args = docker_run_args(c, c.hosts[0])
    env = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-e")
    assert {k: env[v] for k, v in RUN_ENV.items()} == {"fileroot": "/mnt/st/ray/experiments",
                                                         "storage_root": "/mnt/st", "ray_address": "auto"}


def test_the_loader_takes_the_runtimes_places_as_defaults(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for key, value in {"fileroot": "/st/ray/experiments", "storage_root": "/st", "ray_address": "auto"}.items():
        monkeypatch.setenv(RUN_ENV[key], value)
    cfg = load_config("tiny_storage")
    assert (cfg.fileroot, cfg.storage_root, cfg.ray_address) == ("/st/ray/experiments", "/st", "auto")
    assert cfg.actor.path == "/st/models/tiny-toy"  # the preset's paths under it
    cfg = load_config("tiny_storage", ["fileroot=/x", "storage_root=/y", "ray_address="])  # overrides win
    assert (cfg.fileroot, cfg.storage_root, cfg.ray_address, cfg.actor.path) == ("/x", "/y", "", "/y/models/tiny-toy")
    for name in RUN_ENV.values():
        monkeypatch.delenv(name)
    cfg = load_config("tiny_storage")
    assert (cfg.fileroot, cfg.storage_root, cfg.ray_address) == (str(tmp_path / "areal_runs"), "/storage", "")

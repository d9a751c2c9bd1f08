"""setup and `--train_param`: the preset checked against the nodes before anything is installed
(bad input exit 2 before connecting; a preset the nodes cannot run exit 1 right after preflight),
and the started run's log read until a sign of life, its error, or --train-wait.

The log lines come from the run's own writers (its logger's format, logs' line writers, the CLI's
error line). The poll's shell runs here, against a fake driver process, as it runs on a host-runtime head."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cli_run import cli

from areal_kit import logs, runlog
from areal_kit.cluster import steps, train_start
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import Step, StepFailed, run_steps
from areal_kit.cluster.remote import HostLog, Result
from areal_kit.cluster.train_start import Start, classify, train_log_path
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.console import make_console

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kit_home")]
RUN = logs.run_line("ppo-r1-distill/1.5B_n4", 3, 3, 24, 0, "/storage/logs/root/ppo/1.5B_n4")
READY = logs.ready_line(41.2, "16 trainer rank(s) (setup 30.1s, attention sdpa), 16 rollout engine(s) (setup 38.9s), "
                              "weight sync broadcast: nccl")


def run_lines(tmp_path, *messages: tuple) -> list[str]:
    """(level, message[, exception]) as the run's logger writes them (time, level, message[, traceback])."""
    log = runlog.RunLogger(runlog.run_paths(str(tmp_path / "runs"), "exp", "trial"), tensorboard=False, console=False)
    for level, *args in messages:
        getattr(log, level)(*args)
    log.close()
    return Path(log.paths.log_file).read_text().splitlines()


def refused_line(capsys) -> str:
    """The line a run refused at once writes to its output: the CLI's one error line."""
    code, _, err = cli(capsys, "train", "1.5B_n4", "n_nodes=1")
    assert code == 2
    return err.strip()


# -- the log, classified ----------------------------------------------------------------------
def test_a_new_launch_is_starting(tmp_path):
    assert classify(run_lines(tmp_path, ("info", RUN))) == Start("starting")


def test_workers_ready_means_engines_generating(tmp_path):
    lines = run_lines(tmp_path, ("info", RUN), ("info", READY))
    assert classify(lines) == Start("started", "workers ready, engines generating")


def test_a_finished_step_gives_its_global_step(tmp_path):
    epoch = logs.epoch_line(1, 1, 2, 3, 2, 4000.0, 12.5, 30.0, None)
    lines = run_lines(tmp_path, ("info", RUN), ("info", READY), ("info", logs.rpc_line({"task_reward": 0.5})),
                      ("info", epoch))
    assert classify(lines) == Start("started", "at global step 2")


def test_a_refused_run_fails_with_the_clis_error_line(tmp_path, capsys):
    error = refused_line(capsys)
    assert error.startswith("error: vllm.d16p1m1+d8p2m1 needs 16+16=32 GPUs")
    now = classify([*run_lines(tmp_path, ("info", RUN)), error], driver_running=False, last_line=error)
    assert now == Start("failed", error.removeprefix("error: "))


@pytest.mark.parametrize("level,line", [("warning", logs.stopped_line("SIGTERM")),
                                        ("warning", logs.stopped_line("SIGTERM", 3, "/r/globalstep3")),
                                        ("failure", logs.failed_line("Trainer.train_step: ValueError: (x)"))])
def test_the_runs_own_failure_lines_are_failures(tmp_path, level, line):
    said = (level, line, ValueError("(x)")) if level == "failure" else (level, line)  # failure: with its traceback
    lines = run_lines(tmp_path, ("info", RUN), ("info", READY), said)
    assert len(lines) > 3 if level == "failure" else len(lines) == 3
    assert classify(lines) == Start("failed", line)


def test_each_launch_starts_over(tmp_path, capsys):
    old = [*run_lines(tmp_path, ("info", RUN)), refused_line(capsys)]
    assert classify([*old, *run_lines(tmp_path / "b", ("info", RUN))]) == Start("starting")
    assert classify([*old, *run_lines(tmp_path / "c", ("info", RUN), ("info", READY))]).state == "started"


def test_a_driver_gone_without_a_sign_failed_with_its_last_line(tmp_path):
    now = classify(run_lines(tmp_path, ("info", RUN)), driver_running=False, last_line="ValueError: boom")
    assert now.state == "failed"
    assert "before its workers were ready" in now.detail and "ValueError: boom" in now.detail


def test_a_run_that_finished_is_not_a_failure(tmp_path):
    done = logs.finished_line(3, 0.5)
    lines = run_lines(tmp_path, ("info", RUN), ("info", READY), ("info", done))
    assert classify(lines, driver_running=False) == Start("started", "finished, 3 steps")


# -- the preset against the nodes ---------------------------------------------------------------
@pytest.fixture
def no_connect(monkeypatch):
    def connect(c, h):
        raise AssertionError("setup contacted a host")

    monkeypatch.setattr(steps, "connect", connect)


@pytest.mark.parametrize("args,needle", [(["--train_param", "no_such_preset"], "unknown preset 'no_such_preset'"),
                                         (["--train_param", "tiny", "--train-arg", "actor.nosuch=1"],
                                          "unknown config key 'actor.nosuch'")])
def test_bad_preset_or_override_exits_2_before_connecting(capsys, no_connect, args, needle):
    code, _, err = cli(capsys, "setup", "--hostnames", "h1", *args)
    assert code == 2
    assert err.startswith("error: --train_param ") and needle in err
    assert len(err.strip().splitlines()) == 1


def test_a_preset_needing_more_gpus_than_the_nodes_stops_setup_after_preflight(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1", "--n-gpus-per-node", "8", "--train_param", "1.5B_n4",
                       "--dry-run")
    assert code == 1
    assert "nvidia-smi -L" in out  # preflight ran
    for later in ("apt-get install", "docker info", "docker image", "ray.scripts", "areal_kit.cli train"):
        assert later not in out, later
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert failed == [("FAILED preset 1.5B_n4 cannot run on these GPU nodes: vllm.d16p1m1+d8p2m1 needs 16+16=32 "
                       "GPUs, the nodes have 1x8=8; pick a preset for 8 GPUs, or --train-arg allocation_mode=...")]


def test_the_preset_runs_on_more_nodes_than_it_names(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1,h2,h3,h4,h5", "--n-gpus-per-node", "8",
                       "--train_param", "1.5B_n4", "--dry-run")
    assert code == 0
    assert "[local] AREAL_DEVICE=cuda " in out and "-m areal_kit.cli train 1.5B_n4 ray_address=auto" in out
    assert train_start.gpu_shortfall("vllm.d4p1m4+d8p2m1", [8, 8, 8, 8]) == ""
    assert "on one node" in train_start.gpu_shortfall("vllm.d4p1m4+d8p2m1", [2] * 16)


class FakeRemote:
    def __init__(self):
        self.log = HostLog(None, [])
        self.user = "root"

    def close(self):
        pass


def gpu_cluster(preset: str, n: int = 2) -> Cluster:
    spec = ClusterSpec(hosts=[HostSpec(f"n{i}") for i in range(n)])
    hosts = [HostState(spec=h, index=i, remote=FakeRemote()) for i, h in enumerate(spec.hosts)]
    return Cluster(opts=SetupOptions(spec=spec, train_param=preset), hosts=hosts)


def test_a_refused_preset_keeps_every_host_from_installing():
    c, installed = gpu_cluster("7B_n4"), []
    plan = [Step("preflight", lambda cl, h: h.facts.update(gpus=8) or Outcome("ok")),
            Step("preset", functools.partial(train_start.preset, cfg=train_start.load_preset(c.opts)),
                 head_only=True, gate=True),
            Step("install", lambda cl, h: installed.append(h.name) or Outcome("changed"))]
    assert not run_steps(c, plan, make_console())
    assert installed == []
    assert "needs 16+16=32 GPUs, the nodes have 2x8=16" in c.head.outcomes["preset"].message
    assert c.hosts[1].outcomes["install"].message == "preset failed on the head"


REFUSES = ("import sys; print('trace', file=sys.stderr); "
           "print('error: allocation_mode=x: not on GPUs', file=sys.stderr); sys.exit(2)")


@pytest.mark.parametrize("script,refused", [
    (REFUSES, "allocation_mode=x: not on GPUs"),
    ("raise ModuleNotFoundError(\"No module named 'torch'\")", None)])
def test_the_dry_runs_error_line_refuses_the_preset(monkeypatch, script, refused):
    c = gpu_cluster("1.5B_n1", 1)
    c.head.facts["gpus"] = 8
    monkeypatch.setattr(train_start, "dry_run_args", lambda o: [sys.executable, "-c", script])
    cfg = train_start.load_preset(c.opts)
    if refused:
        with pytest.raises(StepFailed, match=f"preset 1.5B_n1 cannot run on these GPU nodes: {refused}$"):
            train_start.preset(c, c.head, cfg)
    else:  # a dry run that cannot run here (no torch on this machine) is no verdict on the preset
        out = train_start.preset(c, c.head, cfg)
        assert out.status == "ok" and "No module named 'torch'" in out.message


# -- the wait, with the poll's shell run here ---------------------------------------------------
class LocalRemote(FakeRemote):
    """The head's commands, run on this machine."""

    def run(self, cmd, sudo=False, check=False, timeout=None, quiet=False) -> Result:
        r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, check=False)
        return Result(cmd, r.returncode, r.stdout, r.stderr)


# A stand-in driver: its command line is the one pgrep looks for; it writes its log lines, then stays.
DRIVER = "import sys, time; open(sys.argv[1], 'a').write(open(sys.argv[2]).read()); time.sleep(float(sys.argv[3]))"


@pytest.fixture
def head(tmp_path, monkeypatch):
    monkeypatch.setattr(train_start, "POLL_S", 0.05)
    spec = ClusterSpec(storage=str(tmp_path), hosts=[HostSpec("n0")])
    preset = f"fake_{uuid.uuid4().hex[:8]}"  # no other process on this machine has this name
    c = Cluster(opts=SetupOptions(spec=spec, runtime="host", train_param=preset, train_wait=5), hosts=[
        HostState(spec=spec.hosts[0], index=0, remote=LocalRemote())])
    log = Path(train_log_path(c))
    log.parent.mkdir(parents=True)
    drivers = []

    def start(lines: list[str], linger: float) -> None:
        src = tmp_path / f"src{len(drivers)}"
        src.write_text("".join(f"{ln}\n" for ln in lines))
        end = (log.stat().st_size if log.exists() else 0) + src.stat().st_size
        drivers.append(subprocess.Popen([sys.executable, "-c", DRIVER, str(log), str(src), str(linger),
                                         "areal_kit.cli", "train", preset, "ray_address=auto"]))
        while not log.exists() or log.stat().st_size < end:  # its lines are written: what a poll reads next
            time.sleep(0.01)
        if not linger:
            drivers[-1].wait(10)

    yield c, log, start
    for p in drivers:
        p.kill()
        p.wait()


def test_wait_reads_only_the_new_launch(head, tmp_path, capsys):
    c, log, start = head
    log.write_text("\n".join([*run_lines(tmp_path, ("info", RUN)), refused_line(capsys)]) + "\n")
    c.head.facts["train_log_from"] = log.stat().st_size
    start(run_lines(tmp_path / "new", ("info", RUN), ("info", READY)), linger=30)
    out = train_start.wait(c, c.head)
    assert out.status == "ok"
    assert out.message == f"training {c.opts.train_param}: workers ready, engines generating; log {log}"


def test_wait_fails_with_the_error_line_of_a_refused_run(head, tmp_path, capsys):
    c, _, start = head
    start([*run_lines(tmp_path, ("info", RUN)), refused_line(capsys)], linger=0)
    with pytest.raises(StepFailed, match=r"failed: vllm.d16p1m1\+d8p2m1 needs 16\+16=32 GPUs, cluster has 1x8=8;"):
        train_start.wait(c, c.head)


def test_a_driver_gone_without_a_line_fails_with_its_log_s_last_line(head):
    c, _, start = head
    start(["Traceback (most recent call last):", '  File "x.py", line 1', "OSError: no dataset at /storage/x"],
          linger=0)
    with pytest.raises(StepFailed, match="exited before its workers were ready; its log's last line: OSError: no "
                                         "dataset at /storage/x; log "):
        train_start.wait(c, c.head)


def test_wait_gives_up_saying_what_it_waited_for(head, tmp_path):
    c, _, start = head
    c.opts.train_wait = 0.3
    start(run_lines(tmp_path, ("info", RUN)), linger=30)
    with pytest.raises(StepFailed) as e:
        train_start.wait(c, c.head)
    msg = str(e.value)
    assert msg.startswith(f"training {c.opts.train_param}: no sign of life within 0.3s (--train-wait): waited for "
                          "'Workers ready' or a finished step")
    assert "may still be starting" in msg and "areal-kit status" in msg and "Run ppo-r1-distill/1.5B_n4" in msg


def test_dry_run_prints_the_wait_as_a_command(capsys):
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1", "--train_param", "tiny", "--dry-run")
    assert code == 0
    wait = [ln for ln in out.splitlines() if "[every 5s, up to 900s]" in ln]
    assert len(wait) == 1 and "pgrep -f" in wait[0] and "areal-tiny.log" in wait[0]
    code, out, _ = cli(capsys, "setup", "--hostnames", "h1", "--train_param", "tiny", "--train-wait", "0", "--dry-run")
    assert code == 0
    assert "[every " not in out

"""`areal-kit down` stops training gracefully first, and `status` says where training stands: their
shell scripts, run for real.

The script runs in a local shell (the cluster suite runs it over SSH in a container, against a
real training run); the "driver" here is a small Python process that, like the real one, finishes
its step on SIGTERM, logs the stop line and exits. It is found through the pidfile setup writes
(host runtime), never by a machine-wide pattern, so these tests cannot signal a real run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_kit.cluster import ray_cluster
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.remote import Result
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec

DRIVER = """
import signal, sys, time
def stop(*_):
    if sys.argv[1] == "ignore":
        return
    if sys.argv[1] == "silent":  # e.g. SIGTERM while it shuts down after its last step
        sys.exit(0)
    print("got SIGTERM", flush=True)
    time.sleep(1.0)  # the step under way, then its checkpoint
    print("20261123-06:18:31 WARNING Run interrupted (SIGTERM) after global step 3, with its recover checkpoint /ckpt/globalstep3; "
          "the same command resumes it from there.", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("20261123-06:18:29 INFO Epoch 1/6 step 3/100 (global step 3) finishes. Average #tokens per batch is 1536. "
      "#End to end# execution time: *0.108*s. Total time consumption: 6.022s. Estimated remaining time: 45.796s.",
      flush=True)
while True:
    time.sleep(0.05)
"""


class LocalShell:
    """Runs the step's commands in a local shell, as Remote would on the host."""

    def run(self, cmd, sudo=False, check=False, timeout=None, quiet=False) -> Result:
        p = subprocess.run(["sh", "-c", cmd], check=False, capture_output=True, text=True, timeout=timeout)
        return Result(cmd, p.returncode, p.stdout, p.stderr)


@pytest.fixture
def head(tmp_path):
    spec = ClusterSpec(hosts=[HostSpec("n0")], storage=str(tmp_path / "storage"))
    h = HostState(spec=spec.hosts[0], index=0, remote=LocalShell())
    return Cluster(opts=SetupOptions(spec=spec, runtime="host"), hosts=[h]), h


@pytest.fixture
def started():
    """Drivers a test started: any still running at its end is killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def start_driver(c: Cluster, tmp_path, mode: str, reaped: bool = False, started: list | None = None) -> subprocess.Popen:
    """The driver, as this process's child (a zombie once it exits, until wait()), or with
    reaped=True as the child of a shell that reaps it at once (gone without a trace)."""
    log = open(tmp_path / "train.log", "w")  # noqa: SIM115 (the child holds it)
    # setup appends to one log per preset: an earlier run's stop is in it already
    log.write("20261123-06:10:00 WARNING Run interrupted (SIGTERM) after global step 1, with its recover checkpoint /ckpt/globalstep1; "
              "the same command resumes it from there.\n")
    log.flush()
    # argv carries "areal_kit.cli train", as the real driver's does
    argv = [sys.executable, "-c", DRIVER, mode, "areal_kit.cli", "train", "tiny"]
    if reaped:
        p = subprocess.Popen(["sh", "-c", '"$@" & echo $! >&2; wait', "sh", *argv], stdout=log, stderr=subprocess.PIPE,
                             text=True)
        pid = int(p.stderr.readline())
    else:
        p = subprocess.Popen(argv, stdout=log)
        pid = p.pid
    pidfile = tmp_path / "storage" / ".areal-kit" / f"train-{c.opts.spec.cluster_name}.pid"
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.write_text(f"{pid}\n")
    if started is not None:
        started.append(p)
    for _ in range(100):  # its signal handler is in place once it has logged
        if "finishes" in (tmp_path / "train.log").read_text():
            break
        time.sleep(0.05)
    return p


@pytest.mark.slow
@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_down_waits_for_the_step_and_reports_the_checkpoint(head, tmp_path, reaped, started):
    """Once the driver has exited, whether its parent has reaped it yet or not, the wait ends."""
    c, h = head
    p = start_driver(c, tmp_path, "stop", reaped, started)
    t0 = time.monotonic()
    o = ray_cluster.stop_training(c, h, grace=30)
    assert o.status == "changed", o.message
    assert o.message == ("training stopped after SIGTERM: Run interrupted (SIGTERM) after global step 3, with its "
                         "recover checkpoint /ckpt/globalstep3; the same command resumes it from there.")
    assert time.monotonic() - t0 >= 1.0, "down must wait for the step to finish"
    assert p.wait(timeout=5) == (0 if reaped else 143)


def test_down_reports_only_what_the_log_said_after_the_sigterm(head, tmp_path, started):
    c, h = head
    p = start_driver(c, tmp_path, "silent", started=started)
    o = ray_cluster.stop_training(c, h, grace=30)
    assert o.status == "changed", o.message
    assert "global step 1," not in o.message, o.message
    assert o.message.startswith("training stopped after SIGTERM: its log's last line: ")
    assert o.message.endswith("Estimated remaining time: 45.796s.")
    assert p.wait(timeout=5) == 0


@pytest.mark.slow
def test_down_gives_up_after_the_grace_period(head, tmp_path, started):
    c, h = head
    p = start_driver(c, tmp_path, "ignore", started=started)
    o = ray_cluster.stop_training(c, h, grace=1)
    assert o.status == "changed"
    assert "still running 1s after SIGTERM" in o.message
    assert p.poll() is None


def test_grace_zero_skips_the_stop(head, tmp_path, started):
    c, h = head
    p = start_driver(c, tmp_path, "stop", started=started)
    o = ray_cluster.stop_training(c, h, grace=0)
    assert o.status == "skipped"
    assert p.poll() is None


def test_status_names_the_step_and_the_log(head, tmp_path, started):
    c, h = head
    start_driver(c, tmp_path, "stop", started=started)
    assert ray_cluster.training_state(c, h) == (f"running, global step 3 finished, about 45.796s to go; "
                                            f"log {tmp_path / 'train.log'}")


@pytest.mark.slow
def test_hosts_replacing_containers_at_once_stop_training_once(tmp_path, started):
    """setup's hosts replace their containers in parallel threads, and training's actors may be in
    any of them: the first host SIGTERMs the training and waits for its checkpoint, the others wait
    for that, and the driver gets one SIGTERM (a second would stop it at once, mid-step)."""
    spec = ClusterSpec(hosts=[HostSpec(f"n{i}") for i in range(3)], storage=str(tmp_path / "storage"))
    hosts = [HostState(spec=s, index=i, remote=LocalShell()) for i, s in enumerate(spec.hosts)]
    c = Cluster(opts=SetupOptions(spec=spec, runtime="host"), hosts=hosts)
    p = start_driver(c, tmp_path, "stop", started=started)
    with ThreadPoolExecutor(3) as pool:
        said = list(pool.map(lambda h: ray_cluster._stop_training_once(c, h), hosts))
    first = [s for s in said if s.startswith("; first, training stopped after SIGTERM: Run interrupted (SIGTERM) "
                                             "after global step 3")]
    assert len(first) == 1, said
    assert sorted(said) == sorted(first + [f"; after training was stopped for {c.training_stop[0]}'s container"] * 2)
    assert (tmp_path / "train.log").read_text().count("got SIGTERM") == 1
    assert p.wait(timeout=5) == 143

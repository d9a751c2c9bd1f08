"""End to end, docker runtime: image from docker/Dockerfile (ACCELERATOR=cpu) on a locally imported base,
`areal-kit setup --runtime docker` on 3 hosts, Ray sees 3 nodes, a re-run changes nothing,
status, and one training stopped and resumed through setup (workers replaced, then every container)
and down. (Trainer ranks and the engine on three different hosts: `areal-kit doctor --rl-step` in
test_doctor_cluster.py.)

Each check looks at the nodes directly (plain ssh, docker, a Ray driver) rather than trusting
areal-kit's own report.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kit import lines, setup_args

RAY_NODES = """
import json, ray
ray.init(address="auto", logging_level="ERROR")
print(json.dumps(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
"""
RAY_NODE_IDS = """
import json, ray
ray.init(address="auto", logging_level="ERROR")
print(json.dumps(sorted([n["NodeManagerAddress"], n["NodeID"]] for n in ray.nodes() if n["Alive"])))
"""
RAY_ACTORS = """
import json, ray
ray.init(address="auto", logging_level="ERROR")
print(json.dumps([[a.get("ActorClassName"), a.get("Address", {}).get("IPAddress")]
                  for a in ray._private.state.actors().values()]))
"""
HEAD = "areal-areal-head"


def head_python(tb, code: str, timeout: float = 120) -> str:
    from image import venv_mounts

    venv, _ = venv_mounts()
    import shlex

    r = tb.ssh(1, f"docker exec {HEAD} {venv}/bin/python -c {shlex.quote(code)}", timeout=timeout)
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def docker_cluster(testbed, cpu_image, tmp_path_factory):
    from kit import Kit

    kit = Kit(tmp_path_factory.mktemp("kit-docker"), testbed)
    # a "model" to fetch onto storage once, through the data step (file:// with a checksum)
    src = testbed.storage / "src" / "tiny-model.bin"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(b"weights" * 1000)
    for name in ("tiny-model.bin", ".tiny-model.bin.areal-kit.json"):
        (testbed.storage / "datasets" / name).unlink(missing_ok=True)
    kit.args = [*kit.conn_args(), *setup_args(testbed, "docker"),
                "--data", f"file://{src}#sha256={hashlib.sha256(src.read_bytes()).hexdigest()}"]
    r = kit.run("setup", *kit.args)
    yield kit, r
    kit.run("down", "--known-hosts", str(kit.known_hosts))
    for i in (1, 2, 3):  # never leave containers behind for the other tests
        testbed.ssh(i, "docker rm -f $(docker ps -aq) 2>/dev/null; true", check=False)


def test_image_built_from_dockerfile_cpu(cpu_image, testbed):
    _, tar, times = cpu_image
    assert tar.stat().st_size > 50e6, "image tarball suspiciously small"
    assert times["build"] < 300


def test_setup_docker_three_nodes(docker_cluster, testbed):
    kit, r = docker_cluster
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Ray reports 3 nodes" in r.stdout
    # every non-head node had to load the image from the tarball on shared storage
    assert len([ln for ln in lines(r, "changed") if "] image: loaded" in ln]) == 3
    nodes = json.loads(head_python(testbed, RAY_NODES))
    assert nodes == sorted(testbed.ips)
    for i in (1, 2, 3):
        ps = testbed.ssh(i, "docker ps --format '{{.Names}} {{.Image}}'").stdout
        assert "areal-kit:cpu-test" in ps
        assert ("areal-areal-head" if i == 1 else "areal-areal-worker") in ps
    # the data step fetched the file once onto storage, as a file, with its record beside it
    assert (testbed.storage / "datasets" / "tiny-model.bin").read_bytes() == b"weights" * 1000
    assert (testbed.storage / "datasets" / ".tiny-model.bin.areal-kit.json").exists()
    assert any("] data: fetched" in ln for ln in lines(r, "changed"))
    # host keys were recorded (accept-new), one line per host
    assert len(kit.known_hosts.read_text().splitlines()) == 3


def test_rerun_is_idempotent(docker_cluster, testbed):
    kit, _ = docker_cluster
    ids = testbed.ssh(1, f"docker inspect -f '{{{{.Id}}}}' {HEAD}").stdout
    r = kit.run("setup", *kit.args)
    assert r.returncode == 0
    assert lines(r, "changed") == [], "a re-run must not redo anything"
    assert any("] data: present" in ln for ln in lines(r, "ok"))
    assert testbed.ssh(1, f"docker inspect -f '{{{{.Id}}}}' {HEAD}").stdout == ids


def test_status_reports_every_host(docker_cluster):
    kit, _ = docker_cluster
    r = kit.run("status", "--known-hosts", str(kit.known_hosts))
    assert r.returncode == 0
    assert "Ray reports 3 alive node(s)" in r.stdout
    assert "training: not running" in r.stdout
    assert r.stdout.count("yes") >= 3


def wait_for(path, text: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and text in path.read_text():
            return path.read_text()
        time.sleep(2)
    raise AssertionError(f"{text!r} not in {path} after {timeout:.0f}s:\n" +
                         (path.read_text()[-3000:] if path.exists() else "(no log)"))


def training(steps: int) -> list[str]:
    """setup's arguments that start training: the tiny preset, its rollout engines on the workers."""
    return ["--train_param", "tiny", "--train-arg", "spread_roles=true", "--train-arg",
            f"exp_ctrl.total_train_steps={steps}"]


@pytest.mark.skipif(importlib.util.find_spec("areal_kit.rl.driver.controller") is None,
                    reason="training engine (areal_kit.rl.driver.controller) not built yet")
def start_training(kit, steps: int, *more: str):
    """setup again, now with training (as a user would add --train_param); returns setup's result.
    Without doctor's checks (--skip-doctor): they are the first setup's subject, and would add ~15 s
    to every run here."""
    r = kit.run("setup", *kit.args, *more, "--skip-doctor", *training(steps))
    assert r.returncode == 0, r.stdout
    assert any("] train: training tiny started" in ln for ln in lines(r, "changed")), r.stdout
    return r


def resumed(log, step: int, until: int) -> None:
    """The run after the last stop resumed from step's checkpoint and did steps step+1..until, once each."""
    text = wait_for(log, f"(global step {until}) finishes", 600).split("Run interrupted (SIGTERM)")[-1]
    assert re.search(rf"Will recover from: \S+/globalstep{step} ", text), text[-3000:]
    done = [int(n) for n in re.findall(r"\(global step (\d+)\) finishes", text)]
    assert done[:until - step] == list(range(step + 1, until + 1)), done


def stopped_at(r, log, where: str) -> int:
    """The step a SIGTERMed training stopped after, as setup or down reported it; its checkpoint exists."""
    said = [ln for ln in lines(r, "changed") if where in ln]
    assert len(said) == 1, r.stdout
    assert "Run interrupted (SIGTERM) after global step" in said[0], r.stdout
    step = int(re.search(r"after global step (\d+)", said[0]).group(1))
    text = log.read_text()
    # setup waits for the training it starts again to show a sign of life: the log may go on past
    # the stop, so what the stopped run did is what comes before its stop line
    upto = text[:text.rindex(f"Run interrupted (SIGTERM) after global step {step},")]
    assert f"(global step {step}) finishes" in upto
    assert f"(global step {step + 1}) finishes" not in upto
    ckpt = re.search(r"recover checkpoint (\S+?);", text.split("Run interrupted (SIGTERM)")[-1]).group(1)
    assert ckpt.endswith(f"globalstep{step}"), ckpt
    assert Path(ckpt).is_dir(), ckpt  # storage: same path inside
    return step


def wait_not_running(kit) -> None:
    """After its last line the driver stops its workers, then exits: wait until status says so."""
    for _ in range(30):
        if "training: not running" in kit.run("status", "--known-hosts", str(kit.known_hosts)).stdout:
            return
        time.sleep(2)
    raise AssertionError("status never said the finished training is not running")


def outdate_workers(kit, testbed) -> str:
    """Replaces the workers' containers by hand with the very `docker run` setup's dry run shows, under
    another config label, as after a change that touches workers only; returns the dry run's command
    that starts training (setup's own) once the new workers are Ray's nodes."""
    from image import venv_mounts

    venv, _ = venv_mounts()
    dry = kit.run("setup", *kit.args, "--dry-run", *training(100000))
    cmds = [ln.split("[run] ", 1)[1] for ln in dry.stdout.splitlines() if "[run] docker " in ln]
    workers = [cmd for cmd in cmds if cmd.startswith("docker run ") and "areal-kit.role=worker" in cmd]
    train = [cmd for cmd in cmds if cmd.startswith("docker exec -d ")]
    assert len(workers) == 2, dry.stdout
    assert len(train) == 1, dry.stdout
    old_ids = {node_id for _, node_id in json.loads(head_python(testbed, RAY_NODE_IDS))}

    def replace(i: int, cmd: str) -> None:
        digest = re.search(r"areal-kit[.]config=(\w+)", cmd).group(1)
        label = testbed.ssh(i, 'docker inspect --format \'{{index .Config.Labels "areal-kit.config"}}\' '
                               'areal-areal-worker').stdout.strip()
        assert label == digest, "the dry run shows the container setup started"
        # Leave Ray first, as setup does: a raylet killed with its container stays an alive node
        # until its heartbeats are missed, and the training started below could be placed on it.
        testbed.ssh(i, f"docker exec areal-areal-worker {venv}/bin/python -m ray.scripts.scripts stop; "
                       f"docker rm -f areal-areal-worker && {cmd.replace(digest, 'out-of-date')}")

    with ThreadPoolExecutor(2) as pool:  # both at once, as setup replaces them
        list(pool.map(replace, (2, 3), workers))
    for _ in range(60):
        alive = json.loads(head_python(testbed, RAY_NODE_IDS))
        workers_now = [node_id for addr, node_id in alive if addr != testbed.ips[0]]
        if sorted(addr for addr, _ in alive) == sorted(testbed.ips) and not old_ids & set(workers_now):
            return train[0]  # each node once, and the workers are the new raylets
        time.sleep(2)
    raise AssertionError("the replaced workers did not rejoin Ray")


# long: CI stops and resumes a run on the testbed in test_guide_cluster; this goes through setup's changes too.
@pytest.mark.long
def test_training_survives_setup_changes_and_down_without_losing_a_step(docker_cluster, testbed):
    """Training keeps every step through what stops it: each stop is a SIGTERM, on which it finishes
    its step and checkpoints it, and the next start resumes from that checkpoint.
    - A setup re-run that replaces only the workers' containers, where the rollout actors live (their
      options are out of date, the head's are not), SIGTERMs the training once, before the first
      removal, and starts it again (--train_param).
    - setup with other options replaces the head container the training runs in: the same.
    - down SIGTERMs it the same way before removing everything, and setup again resumes it.
    One run goes through the three stops, and each start after a stop is the resume that stop's
    check needs: a training start costs ~30 s here, and a setup run as much again.

    The workers' containers are made out of date by hand (outdate_workers). The first training
    then starts by setup's own command, run by hand, since setup would first bring the workers up
    to date."""
    kit, _ = docker_cluster
    shutil.rmtree(testbed.storage / "ray" / "experiments", ignore_errors=True)  # storage outlives a session
    log = testbed.storage / "ray" / "experiments" / "logs" / "areal-tiny.log"
    testbed.ssh(1, outdate_workers(kit, testbed))
    wait_for(log, "(global step 2) finishes", 600)
    rollout_ips = {ip for cls, ip in json.loads(head_python(testbed, RAY_ACTORS)) if "Rollout" in (cls or "")}
    assert rollout_ips, "spread_roles puts the engines on the workers"
    assert testbed.ips[0] not in rollout_ips, "spread_roles puts the engines on the workers"

    r = start_training(kit, 100000)  # replaces the workers only
    assert any("] ray: areal-areal-head running" in ln for ln in lines(r, "ok")), "the head is not replaced"
    step = stopped_at(r, log, "] ray: areal-areal-worker started (stopped or started with other options; first, "
                              "training stopped after SIGTERM")
    after = [ln for ln in lines(r, "changed") if "; after training was stopped for " in ln]
    assert len(after) == 1, r.stdout
    assert "] ray: areal-areal-worker started" in after[0], r.stdout
    resumed(log, step, step + 2)
    r = kit.run("status", "--known-hosts", str(kit.known_hosts))
    assert re.search(rf"training: running, global step \d+ finished, about \S+ to go; log {log}", r.stdout), r.stdout

    r = start_training(kit, 100000, "--shm-size", "600m")  # every container is replaced
    step = stopped_at(r, log, "] ray: areal-areal-head started (stopped or started with other options; first, "
                              "training stopped after SIGTERM")
    resumed(log, step, step + 2)

    r = kit.run("down", "--known-hosts", str(kit.known_hosts))
    assert r.returncode == 0, r.stdout
    step = stopped_at(r, log, "] stop training: training stopped after SIGTERM")
    assert len([ln for ln in lines(r, "changed") if "] down: " in ln]) == 3
    for i in (1, 2, 3):
        assert testbed.ssh(i, "docker ps -aq").stdout.strip() == ""

    start_training(kit, step + 2)
    resumed(log, step, step + 2)
    wait_not_running(kit)
    r = kit.run("down", "--known-hosts", str(kit.known_hosts))
    assert r.returncode == 0, r.stdout
    assert any("] stop training: no training running" in ln for ln in lines(r, "ok")), r.stdout
    r = kit.run("down", "--known-hosts", str(kit.known_hosts))
    assert r.returncode == 0, "down twice: nothing left to do"
    assert lines(r, "changed") == [], "down twice: nothing left to do"
    assert any("] stop training: no training running" in ln for ln in lines(r, "ok")), "nor a head container"

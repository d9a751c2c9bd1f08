"""Slurm: presets submitted with `areal-kit train --slurm` to a real Slurm (slurm.py: Debian's
slurmctld, a slurmd in every testbed node, munge), Ray across the job's nodes, the driver on the
first one, all from the Python environment on the storage every node shares:

- the tiny preset across the 3 nodes is signalled as the time limit signals it (USR1 to the batch
  shell alone: `scancel --signal=USR1 --batch`, what the script's --signal=B:USR1@S sends),
  checkpoints, requeues and resumes: every step once, `grep Epoch` and `grep task_reward` read
  the job's log, `status --slurm` and `logs` know the job;
- scancel stops a run at once and cleanly: no Ray left on any node, its checkpoint kept (and while
  it ran, a second submission of it was refused);
- a partition too small for the run is refused before submission, in one line, nothing written;
- doctor --slurm passes, then names node3 alone when its storage is masked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from kit import Kit
from slurm import PARTITION, SMALL, Slurm

# Three nodes, one "GPU" slot each (CPU here): the engine on one, two trainer ranks on the others.
ACROSS = ["n_nodes=3", "n_gpus_per_node=1", "allocation_mode=vllm.d1p1m1+d2p1m1", "spread_roles=true"]
REQUIRED = bool(os.environ.get("CI") or os.environ.get("AREAL_REQUIRE_CLUSTER_TESTS"))
DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch")


@pytest.fixture(scope="module")
def slurm(testbed, tmp_path_factory):
    absent = [d for d in DAEMONS if not os.path.exists(d)]
    if absent:
        why = f"missing {', '.join(absent)}: run `bash .ci/cluster_deps.sh`"
        pytest.fail(why) if REQUIRED else pytest.skip(why)
    for i in (1, 2, 3):  # the nodes as a Slurm cluster finds them: no Ray or container of an earlier module
        testbed.ssh(i, "docker rm -f $(docker ps -aq) >/dev/null 2>&1; pkill -9 -f '[r]aylet|[g]cs_server'; true",
                    check=False)
    s = Slurm(testbed).up()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(s.conf)  # the Slurm commands areal-kit runs find this cluster
    kit = Kit(tmp_path_factory.mktemp("kit-slurm"), testbed)
    kit.fileroot = testbed.storage / "slurm-runs"
    shutil.rmtree(kit.fileroot, ignore_errors=True)  # an earlier session's runs would resume
    yield s, kit
    s.down()
    if before is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = before


def submit(kit: Kit, trial: str, steps: int, *more: str):
    r = kit.run("train", "tiny", "--slurm", f"trial_name={trial}", f"exp_ctrl.total_train_steps={steps}",
                f"fileroot={kit.fileroot}", *ACROSS, *more)
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"submitted Slurm job (\d+)", r.stdout)
    assert job, r.stdout
    return job[1], kit.fileroot / "logs" / "root" / "tiny" / trial


def wait_for(what, timeout: float, every: float = 1.0):
    end = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < end, f"timed out after {timeout:g} s"
        time.sleep(every)
    return got


def state(s: Slurm, job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", s.cmd(f"scontrol show job -o {job}").stdout))


def steps_of(run) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(ln)["global_step"] for ln in path.read_text().splitlines()] if path.exists() else []


# long: CI runs the same batch script's TERM trap through scancel below, and the script's requeue lines in tests/unit/test_slurm.py.
@pytest.mark.long
def test_tiny_across_nodes_requeues_at_the_time_limit_signal(slurm, testbed):
    s, kit = slurm
    job, run = submit(kit, "requeue", 40)
    wait_for(lambda: len(steps_of(run)) >= 10, 300)
    st = kit.run("status", "--slurm")
    assert f"slurm job {job}: RUNNING" in st.stdout and "global step" in st.stdout, st.stdout
    s.cmd(f"scancel --signal=USR1 --batch {job}")
    wait_for(lambda: state(s, job)["JobState"] == "COMPLETED", 420, every=2)
    assert state(s, job)["Restarts"] == "1"
    assert steps_of(run) == list(range(1, 41))  # every step once, across the two starts
    log = (run / "slurm.log").read_text()
    assert f"areal-kit: requeued job {job}" in log and f"areal-kit: job {job} start 2 on node1 node2 node3" in log
    assert "Ray has 3 nodes" in log
    assert len(re.findall(r"^\S+ INFO Epoch \d+/\d+ step", log, re.MULTILINE)) == 40, "grep Epoch: one line a step"
    assert len(re.findall(r"'task_reward': ", log)) == 40
    assert re.search(r"Will recover from: .*globalstep\d+", log)
    logs = kit.run("logs", str(run))
    assert f"slurm job {job}: COMPLETED" in logs.stdout and "requeued 1x" in logs.stdout, logs.stdout


def test_scancel_stops_the_run_cleanly(slurm, testbed):
    s, kit = slurm
    job, run = submit(kit, "cancel", 5000)
    wait_for(lambda: len(steps_of(run)) >= 3, 300)
    again = kit.run("train", "tiny", "--slurm", "trial_name=cancel", f"fileroot={kit.fileroot}", *ACROSS)
    assert again.returncode == 2 and f"run tiny/cancel is Slurm job {job} already (RUNNING)" in again.stderr
    s.cmd(f"scancel {job}")
    # Slurm's KillWait (120 s on the testbed, slurm.py) bounds the stop: the testbed's two cores may
    # be shared with the integration tests, and a driver's stop there can take longer than 30 s.
    wait_for(lambda: state(s, job)["JobState"] == "CANCELLED" and
             all(testbed.ssh(i, "pgrep -f '[r]aylet|areal_kit[.]cli'", check=False).returncode == 1
                 for i in (1, 2, 3)), 300, every=2)
    log = (run / "slurm.log").read_text()
    assert "Run interrupted (SIGTERM); the same command resumes it from the last recover checkpoint" in log
    assert "Traceback" not in log.split("INFO Epoch")[-1].split("srun:")[0], log[-3000:]
    assert list((kit.fileroot / "recover" / "root" / "tiny" / "cancel").glob("globalstep*"))


def test_a_partition_too_small_is_refused_before_submission(slurm):
    _, kit = slurm
    r = kit.run("train", "tiny", "--slurm", "--partition", SMALL, "trial_name=small", f"fileroot={kit.fileroot}",
                *ACROSS)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: partition {SMALL} has 1 node(s), tiny (3 node(s)) needs 3 (n_nodes); "
                                "expected a partition with 3 or more, or n_nodes=1 with an allocation_mode that fits")
    assert not (kit.fileroot / "logs" / "root" / "tiny" / "small").exists()
    dry = kit.run("train", "tiny", "--slurm", "--dry-run", "--time", "1:00:00", f"fileroot={kit.fileroot}", *ACROSS)
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --nodes=3" in dry.stdout and "#SBATCH --time=1:00:00" in dry.stdout
    assert "--gres" not in dry.stdout  # these nodes have no GPUs
    assert f"fits (partition {PARTITION}, 3 node(s) up)" in dry.stdout


def test_doctor_checks_every_node_through_srun(slurm, testbed):
    _, kit = slurm
    args = ["doctor", "--slurm", "--preset", "tiny", "--storage", str(testbed.storage), "--json"]
    ok = kit.run(*args)
    rep = json.loads(ok.stdout)
    assert ok.returncode == 0 and rep["ok"] and sorted(rep["nodes"]) == ["node1", "node2", "node3"], ok.stdout
    assert all(n["storage"] and n["python"] for n in rep["nodes"].values())
    testbed.ssh(3, f"mount -t tmpfs -o size=16m tmpfs {testbed.storage}")
    try:
        bad = kit.run(*args)
    finally:
        testbed.ssh(3, f"umount {testbed.storage}", check=False)
    rep = json.loads(bad.stdout)
    assert bad.returncode == 1
    assert [(f["host"], f["check"]) for f in rep["findings"]] == [("node3", "storage")]  # its Python is elsewhere

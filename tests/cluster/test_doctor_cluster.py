"""`areal-kit doctor` on the 3-host testbed (SSH + Docker + Ray, gloo): every check passes on the
healthy cluster, with --preset tiny (its placement groups, one of its vLLM engines generating) and
--rl-step (2 trainer ranks and an engine on three hosts, a weight sync, engine logprobs equal to the
trainers'); then faults injected for real are each named on the right host, and only there:
  - node3's link rate-limited with tc (tbf on its interface: this kernel has no netem),
  - node3's storage path not shared (a tmpfs mounted over it inside its container),
  - node2's /dev/shm shrunk (remounted inside its container),
  - node2's Ray worker down (its container stopped).
`areal-kit setup` runs doctor's fast checks at its end and starts no training after a failed one; the dry run's weight-sync estimate reads the
figures doctor saved.
"""

from __future__ import annotations

import json

import pytest
from kit import Kit, setup_args

# long: CI runs doctor on every node of the testbed through srun (test_slurm_cluster) and setup's fast
# checks in every setup; this one injects a fault of each kind and trains one RL step.
pytestmark = pytest.mark.long
WORKER = "areal-areal-worker"


@pytest.fixture(scope="module")
def cluster(testbed, cpu_image, tmp_path_factory):
    kit = Kit(tmp_path_factory.mktemp("kit-doctor"), testbed)
    kit.args = [*kit.conn_args(), *setup_args(testbed, "docker")]
    r = kit.run("setup", *kit.args)
    assert r.returncode == 0, r.stdout + r.stderr
    yield kit, r
    kit.run("down", "--known-hosts", str(kit.known_hosts))
    for i in (1, 2, 3):
        testbed.ssh(i, "docker rm -f $(docker ps -aq) 2>/dev/null; true", check=False)


def doctor(kit, *more):
    r = kit.run("doctor", "--known-hosts", str(kit.known_hosts), "--min-shm-gb", "0.25", "--min-nofile", "10000", "--min-disk-gb", "1",
                "--net-mb", "8", "--json", *more, timeout=600)
    return r, json.loads(r.stdout)


def in_container(tb, i: int, cmd: str) -> None:
    """A command in the mount namespace of node i's Ray container (as root on the node)."""
    tb.ssh(i, f"nsenter -t $(docker inspect -f '{{{{.State.Pid}}}}' {WORKER}) -m sh -c '{cmd}'")


def named(rep) -> set[tuple[str, str]]:
    return {(f["host"], f["check"]) for f in rep["findings"]}


def test_a_healthy_cluster_passes_and_faults_are_named_on_their_host(cluster, testbed, tmp_path):
    kit, setup = cluster
    ips = testbed.ips
    assert "] host: /dev/shm" in setup.stdout and "] in-ray: alive in Ray" in setup.stdout  # setup's fast checks

    r, rep = doctor(kit, "--preset", "tiny", "--rl-step")
    assert r.returncode == 0, r.stderr[-3000:]
    assert rep["ok"] and rep["findings"] == []
    assert set(rep["hosts"]) == set(ips)
    net = rep["network"]
    assert net["backend"] == "gloo" and sorted(net["nodes"]) == sorted(ips)
    assert len(net["links_gbps"]) == 6 and all(v > 0 for v in net["links_gbps"].values())
    assert net["all_reduce_busbw_gbps"] > 0 and net["placement"] == ""
    assert net["interfaces"] == [f"eth0 ({ip})" for ip in sorted(ips)]  # gloo on each node's cluster address
    assert net["engine"] == "" and 1 <= net["engine_tokens"] <= 8
    rl = rep["rl_step"]
    assert rl["rl_step"] == "" and rl["logprob_gap"] < 1e-3, rl
    assert len(set(rl["trainer_ips"])) == 2 and len(rl["engine_ips"]) == 1, rl
    assert set(rl["trainer_ips"] + rl["engine_ips"]) == set(ips), "trainer ranks on two hosts, the engine on the third"
    # weight_sync=auto falls back to the gloo broadcast: no shared memory across hosts.
    with open(rl["log"]) as f:  # on the shared storage, the same path here
        assert "weight sync auto: broadcast over gloo (an engine is on another node)" in f.read()
    healthy = min(net["links_gbps"].values())

    # The dry run's weight-sync estimate comes from these figures.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 10_000_000)
    dry = kit.run("train", "tiny", "--dry-run", f"actor.path={model}", f"ref.path={model}")
    assert "weight sync estimate: 0.01 GB a step," in dry.stdout, dry.stdout + dry.stderr

    node2, node3 = ips[1], ips[2]
    testbed.ssh(3, "tc qdisc add dev eth0 root tbf rate 100mbit burst 64kb latency 200ms")
    in_container(testbed, 3, f"mount -t tmpfs tmpfs {testbed.storage}")
    in_container(testbed, 2, "mount -o remount,size=64m /dev/shm")
    try:
        r, rep = doctor(kit)
        # setup runs the fast checks at its end and starts no training after a failed one
        refused = kit.run("setup", *kit.args, "--train_param", "tiny")
    finally:
        testbed.ssh(3, "tc qdisc del dev eth0 root", check=False)
        in_container(testbed, 3, f"umount {testbed.storage}")
        in_container(testbed, 2, "mount -o remount,size=512m /dev/shm")
    assert r.returncode == 1
    assert named(rep) == {(node3, "network"), (node3, "shared-storage"), (node2, "shm")}, rep["findings"]
    slow = {k: v for k, v in rep["network"]["links_gbps"].items() if k.startswith(node3)}
    assert max(slow.values()) < healthy / 2, rep["network"]
    for f in rep["findings"]:
        assert f["measured"] and f["expected"] and f["fix"]
    assert refused.returncode == 1
    assert f"doctor's checks failed on {node2}, {node3} (see FAIL lines): training not started" in refused.stdout
    assert f"FAIL {node2} shm: " in refused.stdout and f"FAIL {node3} shared-storage: " in refused.stdout
    assert testbed.ssh(1, "docker exec areal-areal-head pgrep -af 'areal_kit[.]cli train' || true").stdout.strip() == ""

    testbed.ssh(2, f"docker stop {WORKER}")
    r, rep = doctor(kit)
    assert r.returncode == 1
    assert named(rep) == {(node2, "runtime"), (node2, "ray")}, rep["findings"]
    text = kit.run("doctor", "--known-hosts", str(kit.known_hosts), "--min-shm-gb", "0.25", "--min-nofile", "10000", "--min-disk-gb", "1",
                   "--net-mb", "1")
    fails = [ln for ln in text.stdout.splitlines() if ln.startswith("FAIL ")]
    assert len(fails) == 2 and all(ln.startswith(f"FAIL {node2} ") and "; fix: " in ln for ln in fails), text.stdout
    assert "point-to-point bandwidth, GB/s (gloo)" in text.stdout

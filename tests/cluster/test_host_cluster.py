"""`--runtime host` (Ray straight on the hosts, no containers), and one host failing while the
others go on: node3's shared storage is masked by a local tmpfs (as when NFS is not mounted
on one machine), so node3 fails the storage check and the cluster forms from node1 and
node2; after the mount is fixed, a re-run redoes only node3, and doctor with the same hosts named
again probes the host runtime setup saved.
"""

from __future__ import annotations

import json
import shlex

import pytest
from kit import lines, setup_args

# long: CI starts Ray straight on the testbed's hosts under Slurm (test_slurm_cluster); this is setup's
# host runtime with one host failing and then redone alone.
pytestmark = pytest.mark.long

ALIVE = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
         "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")


def alive_nodes(tb) -> list[str]:
    from image import venv_mounts

    venv, _ = venv_mounts()
    r = tb.ssh(1, f"RAY_AUTH_MODE=disabled {venv}/bin/python -c {shlex.quote(ALIVE)}", timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def masked_node3(testbed):
    s = shlex.quote(str(testbed.storage))
    testbed.ssh(3, f"mount -t tmpfs -o size=4g tmpfs {s}")
    yield
    testbed.ssh(3, f"umount {s}", check=False)


def test_host_runtime_with_one_failing_host(testbed, kit, masked_node3):
    ips = testbed.ips
    args = [*kit.conn_args(), *setup_args(testbed, "host")]
    try:
        r = kit.run("setup", *args)
        assert r.returncode == 1, "a failed host must make the exit code non-zero"
        assert f"FAILED [{ips[2]}] storage" in r.stdout
        assert "is not the filesystem the head" in r.stdout
        assert "exit code: 1" in r.stdout  # the failing command is shown with its exit code
        assert "Ray reports 2 nodes" in r.stdout  # the other hosts went on
        assert alive_nodes(testbed) == ips[:2]
        log = next(kit.home.glob(f"logs/areal/*/{ips[2]}.log")).read_text()
        assert "FAILED storage" in log

        testbed.ssh(3, f"umount {shlex.quote(str(testbed.storage))}")
        r = kit.run("setup", *args)
        assert r.returncode == 0
        changed = lines(r, "changed")
        assert [ln.split("]")[0] for ln in changed] == [f"changed: [{ips[2]}"], changed  # only node3 redone
        assert alive_nodes(testbed) == ips
        # raylets run inside each node (own PID namespace), with the cluster address
        assert testbed.ssh(2, "pgrep -af '[r]aylet'").stdout.count(f"--gcs-address={ips[0]}:6379") >= 1
        # The same hosts named again, as a new user would: doctor probes the host runtime setup saved.
        doc = kit.run("doctor", *kit.conn_args(), "--username", "root", "--min-shm-gb", "0.25", "--min-nofile",
                      "10000", "--min-disk-gb", "1", "--net-mb", "1", "--json")
        rep = json.loads(doc.stdout)
        assert rep["fault"] == "" and set(rep["hosts"]) == set(ips), doc.stderr[-3000:]
        assert not [f for f in rep["findings"] if f["check"] == "runtime"], rep["findings"]
    finally:
        d = kit.run("down", "--known-hosts", str(kit.known_hosts))
    assert d.returncode == 0
    for i in (1, 2, 3):
        assert testbed.ssh(i, "pgrep -f '[r]aylet'", check=False).returncode == 1, f"raylet left on node{i}"

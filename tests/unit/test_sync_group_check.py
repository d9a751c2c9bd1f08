"""The all-reduce across nodes over the weight sync's own group (rl/preflight.py `net`), how doctor
judges it (cluster/doctor.py network_step), and setup running it in its fast checks and starting
no training after it failed (cluster/cmd.py, cluster/train_start.py).

The GPU edge is faked: the peers' all_reduce answers (seconds, the sum) as the NCCL group's ranks
do, or raises, or never returns; Ray's wait/get are stand-ins that read those answers. The real
group runs in tests/cluster/test_doctor_cluster.py (gloo across the testbed's nodes).

    .venv/bin/python -m pytest tests/unit/test_sync_group_check.py -q
"""

import json

import pytest
from test_doctor import Head  # the head's connection, answering with the line the check prints

from areal_kit.cluster import cmd, doctor, train_start
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import Limits, SetupOptions
from areal_kit.cluster.parallel import StepFailed
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.rl import preflight

pytestmark = pytest.mark.unit

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


class Ref:
    def __init__(self, value=None, error=None, ready=True):
        self.value, self.error, self.ready = value, error, ready


class FakeRay:
    @staticmethod
    def wait(refs, num_returns, timeout):
        return [r for r in refs if r.ready], [r for r in refs if not r.ready]

    @staticmethod
    def get(ref):
        if ref.error:
            raise ref.error
        return ref.value


class Peer:
    def __init__(self, ref):
        self.all_reduce = type("M", (), {"remote": staticmethod(lambda nbytes: ref)})


def across(monkeypatch, *refs):
    monkeypatch.setattr(preflight, "ray", FakeRay)
    return preflight.all_reduce_across([Peer(r) for r in refs], [A, B, C][:len(refs)], 32 << 20, timeout_s=5)


def test_a_sound_all_reduce_reports_the_slowest_ranks_bus_bandwidth(monkeypatch):
    got = across(monkeypatch, Ref((0.01, 3.0)), Ref((0.02, 3.0)), Ref((0.015, 3.0)))
    assert got["seconds"] == 0.02 and "error" not in got
    assert got["busbw_gbps"] == pytest.approx(round(2 * 2 / 3 * (32 << 20) / 0.02 / 1e9, 4))


@pytest.mark.parametrize("bad, words", [
    (Ref(error=RuntimeError("NCCL error: unhandled system error")), "RuntimeError: NCCL error"),
    (Ref((0.01, 2.0)), "reduced to 2, expected 3 (the sum over the nodes)"),
    (Ref(ready=False), "did not finish within 5s"),
])
def test_the_node_that_fails_the_all_reduce_is_named(monkeypatch, bad, words):
    got = across(monkeypatch, Ref((0.01, 3.0)), bad, Ref((0.01, 3.0)))
    assert got["failed"] == [B] and words in got["error"] and "busbw_gbps" not in got


def cluster(train_param=None):
    spec = ClusterSpec(cluster_name="t", storage="/storage", n_gpus_per_node=8,
                       hosts=[HostSpec(hostname=f"node{i}") for i in range(1, 4)])
    hosts = [HostState(spec=h, index=i, ip=ip) for i, (h, ip) in enumerate(zip(spec.hosts, (A, B, C)))]
    c = Cluster(opts=SetupOptions(spec=spec, train_param=train_param), hosts=hosts)
    c.doctor.hosts = {h.name: {} for h in hosts}  # the host step reached them
    return c


def network(all_reduce: dict) -> dict:
    return {"backend": "nccl", "nodes": {ip: {"CPU": 64, "GPU": 8} for ip in (A, B, C)},
            "interfaces": ["eth0"] * 3, "all_reduce": all_reduce,
            **({"all_reduce_busbw_gbps": all_reduce["busbw_gbps"]} if "busbw_gbps" in all_reduce else {})}


def test_setup_runs_the_all_reduce_alone_and_doctor_reports_its_bus_bandwidth():
    c = cluster()
    head = c.hosts[0]
    head.remote = Head("PROBE " + json.dumps(network({"nodes": 3, "mb": 32, "seconds": 0.01, "busbw_gbps": 4.47})))
    out = doctor.network_step(c, head, Limits(quick_network=True))
    assert out.status == "ok"
    assert "all-reduce over the weight sync's nccl group across 3 nodes 4.47 GB/s bus bandwidth" in out.message
    assert "net --address" in head.remote.cmds[0] and "--quick" in head.remote.cmds[0]
    assert doctor.report(c, True)["network"]["all_reduce"]["busbw_gbps"] == 4.47
    names = [s.name for s in cmd._setup_plan(c.opts, [], "", None, Limits())]
    assert names.index("in-ray") < names.index("network") < names.index("train")


def test_a_failed_all_reduce_is_one_line_on_the_node_that_failed_with_the_fix():
    c = cluster()
    c.doctor.network = network({"nodes": 3, "mb": 32, "error": "RuntimeError: NCCL error", "failed": [B]})
    outs = {h.ip: doctor.network_step(c, h, Limits()) for h in c.hosts[1:]}
    assert outs[B].status == "failed" and outs[C].status == "ok"
    [f] = c.doctor.findings
    assert f.line() == ("node2 sync-group: nccl all-reduce over the weight sync's group across 3 nodes failed here: "
                        "RuntimeError: NCCL error, expected the sum over every node; fix: check that the nodes reach "
                        "each other on every TCP port (NCCL opens ephemeral ones), set NCCL_SOCKET_IFNAME to the "
                        "cluster's interface in the runtime's environment, and run it again with NCCL_DEBUG=INFO")


def test_a_group_that_did_not_form_is_the_heads_finding():
    c = cluster()
    head = c.hosts[0]
    head.remote = Head("PROBE " + json.dumps(network({"nodes": 3, "mb": 32, "failed": [],
                                                      "error": "the weight sync's group did not form: timeout"})))
    assert doctor.network_step(c, head, Limits()).status == "failed"
    assert [f.host for f in c.doctor.findings] == ["node1"]


def test_no_training_starts_after_a_failed_network_check():
    c = cluster(train_param="1.5B_n4")
    c.hosts[1].outcomes["network"] = Outcome("failed", "sync-group", blocking=False)
    with pytest.raises(StepFailed, match="doctor's checks failed on node2 .* training not started"):
        train_start.train(c, c.hosts[0])

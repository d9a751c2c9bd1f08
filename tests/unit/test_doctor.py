"""`areal-kit doctor`'s judgements from measured figures, without a cluster: which host a slow link
belongs to, which host disagrees with the others, the one-line findings, the dry run's weight-sync
estimate (netfigures.py), and how the RL step is run: a command on the head, whose one JSON line
doctor reads. The checks on a live 3-host cluster with injected faults are in
tests/cluster/test_doctor_cluster.py.

    .venv/bin/python -m pytest tests/unit/test_doctor.py -q
"""

import json

import pytest

from areal_kit import netfigures
from areal_kit.cluster import doctor
from areal_kit.cluster.context import Cluster, HostState
from areal_kit.cluster.options import SetupOptions
from areal_kit.cluster.parallel import run_steps
from areal_kit.cluster.remote import Result
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec
from areal_kit.console import make_console

pytestmark = pytest.mark.unit

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


def links(slow_egress=None, fast=1.0, slow=0.01):
    """Every ordered pair; a rate limit on one host's egress slows the direction leaving it."""
    return {f"{s}>{d}": (slow if s == slow_egress else fast) for s in (A, B, C) for d in (A, B, C) if s != d}


def test_a_rate_limited_host_is_named_and_only_it():
    assert doctor.host_bandwidth(links(C)) == {A: 1.0, B: 1.0, C: 0.01}
    assert doctor.slow_hosts(links(C)) == {C: (0.01, 1.0)}
    assert doctor.slow_hosts(links()) == {}
    # Two hosts: one link cannot say which end is slow, so none is named.
    two = {f"{A}>{B}": 0.01, f"{B}>{A}": 1.0}
    assert doctor.slow_hosts(two) == {}


def test_a_host_at_60_percent_is_not_slow_at_40_it_is():
    assert doctor.slow_hosts(links(C, slow=0.6)) == {}
    assert set(doctor.slow_hosts(links(C, slow=0.4))) == {C}


def cluster(n=3):
    spec = ClusterSpec(cluster_name="t", storage="/storage", n_gpus_per_node=0,
                       hosts=[HostSpec(hostname=f"node{i}") for i in range(1, n + 1)])
    hosts = [HostState(spec=h, index=i) for i, h in enumerate(spec.hosts)]
    return Cluster(opts=SetupOptions(spec=spec), hosts=hosts)


def facts(**over):
    f = {"shm_gb": 16.0, "nofile": 1048576, "storage_free_gb": 100.0, "ray_tmp_free_gb": 50.0,
         "versions": {"ray": "2.60.0", "torch": "2.13.0", "docker": "20.10"}, "cuda": "12.8",
         "gpus": [{"name": "H100", "memory_gb": 80.0, "driver": "570.1"}] * 8, "storage_io": "", "token": "x",
         "clock_offset_s": 0.01, "clock_uncertainty_s": 0.005}
    return {**f, **over}


def test_the_host_that_differs_from_the_others_is_named():
    c = cluster()
    c.doctor.hosts = {"node1": facts(), "node2": facts(versions={"ray": "2.59.0", "torch": "2.13.0",
                                                                    "docker": "20.10"}),
                         "node3": facts(gpus=[{"name": "H100", "memory_gb": 80.0, "driver": "570.1"}] * 7,
                                        clock_offset_s=3.0)}
    out = {h.name: doctor.agree_step(c, h, doctor.Limits()) for h in c.hosts}
    assert out["node1"].status == "ok"
    assert out["node2"].status == "failed" and not out["node2"].blocking
    lines = [f.line() for f in c.doctor.findings]
    assert lines[0] == ("node2 versions: ray 2.59.0, expected ray 2.60.0 as on the others; fix: one runtime image "
                        "(or environment) on every host: areal-kit setup --image ...")
    assert any(ln.startswith("node3 gpus: 7 GPUs, expected 8;") for ln in lines)
    assert any(ln.startswith("node3 clock: +2.99s from the other hosts' median, expected within 1s;") for ln in lines)
    assert not any(ln.startswith("node1") for ln in lines)


def test_a_failed_check_does_not_stop_the_hosts_later_checks():
    """doctor finds every fault in one run: a host failing one check goes on to the next."""
    c = cluster(2)
    seen = []

    def first(c_, h):
        return doctor._fail(c_, h, [doctor.Finding(h.name, "shm", "small", "big", "grow it")] if h.index else [], "fine")

    def second(c_, h):
        seen.append(h.name)
        return doctor._fail(c_, h, [], "fine")

    from areal_kit.cluster.parallel import Step

    console = make_console(file=open("/dev/null", "w"))  # noqa: SIM115 (the recap is not under test)
    ok = run_steps(c, [Step("one", first, head_first=True), Step("two", second, head_first=True)], console)
    assert not ok
    assert sorted(seen) == ["node1", "node2"]


def test_the_dry_run_estimate_uses_the_measured_links(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path))
    assert netfigures.latest() is None
    (tmp_path / "clusters").mkdir()
    rep = {"cluster": "c1", "time": 1.0e9, "network": {"links_gbps": links(C, fast=2.0, slow=0.5)}}
    (tmp_path / "clusters" / "c1.doctor.json").write_text(json.dumps(rep))
    (tmp_path / "clusters" / "c0.doctor.json").write_text(json.dumps({**rep, "cluster": "c0", "time": 1.0}))
    got = netfigures.latest()
    assert got["cluster"] == "c1"
    line = netfigures.sync_estimate_line(3_000_000_000, got)
    # 3 GB: 1.5 s at the median link (2 GB/s), 6 s at the slowest (0.5 GB/s)
    assert line.startswith("weight sync estimate: 3 GB a step, 1.5s at the median link, 6s at the slowest "
                           "(doctor of cluster c1 at "), line
    assert "model size unknown" in netfigures.sync_estimate_line(None, got)


def test_the_link_matrix_reads_from_row_to_column():
    rows = doctor.link_rows(links(C, fast=2.0, slow=0.5))
    assert rows[0] == ["from \\ to", A, B, C]
    assert rows[1] == [A, "-", "2", "2"]
    assert rows[3] == [C, "0.5", "0.5", "-"]


class Head:
    """The head's connection: records the command, answers with the line the RL step prints."""

    user = "root"

    def __init__(self, line: str):
        self.line, self.cmds = line, []

    def run(self, cmd, sudo=False, timeout=None):
        self.cmds.append(cmd)
        return Result(cmd, 0, "some log line\n" + self.line + "\n")


@pytest.mark.parametrize("runtime, prefix", [("docker", "docker exec areal-t-head python3 -m areal_kit.rl.preflight"),
                                             ("host", "python3 -m areal_kit.rl.preflight")])
def test_the_rl_step_is_a_command_on_the_head_whose_json_doctor_reads(runtime, prefix):
    c = cluster()
    c.opts.runtime = runtime
    head = c.hosts[0]
    got = {"rl_step": "", "logprob_gap": 2e-7, "trainer_ips": ["10.0.0.1", "10.0.0.2"], "engine_ips": ["10.0.0.3"],
           "sync_time": 0.1, "seconds": 42.0, "log": "/storage/train.log", "gpu": False}
    head.remote = Head("PROBE " + json.dumps(got))
    out = doctor.rl_step_step(c, head, doctor.Limits(rl_step=True))
    assert out.status == "ok", out.message
    [cmd] = head.remote.cmds
    assert prefix in cmd and "rlstep --fileroot /storage/.areal-kit/doctor" in cmd
    assert doctor.report(c, True)["rl_step"] == got


def test_a_failed_rl_step_is_a_finding_that_names_its_log():
    c = cluster()
    head = c.hosts[0]
    head.remote = Head("PROBE " + json.dumps({"rl_step": "RuntimeError: boom", "log": "/storage/train.log"}))
    out = doctor.rl_step_step(c, head, doctor.Limits(rl_step=True))
    assert out.status == "failed"
    [f] = doctor.report(c, False)["findings"]
    assert doctor.Finding(**f).line() == ("node1 rl-step: the tiny RL step failed: RuntimeError: boom, expected one "
                                          "step to finish; fix: read its log /storage/train.log")

"""`status`, `down` and `doctor` act on the cluster setup saved: hosts named again change nothing
(runtime, python, storage, each host's user, port and key stay as saved), and a doctor run that saw
no host keeps the figures of the last one that did, its fix pointing at its own settings when those
were not setup's; a command's options are the fields of the dataclasses they fill. No host is
contacted: a scripted remote stands in for SSH.

    .venv/bin/python -m pytest tests/unit/test_cluster_target.py -q
"""

from __future__ import annotations

import inspect
import json

import pytest
from cli_run import cli

from areal_kit import flags, netfigures
from areal_kit.cluster import cmd, steps
from areal_kit.cluster import remote as remote_mod
from areal_kit.cluster.options import Limits, SetupOptions, save_state
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.remote import HostLog, Result
from areal_kit.cluster.target import Target
from areal_kit.config.cluster_spec import ClusterSpec, HostSpec

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kit_home")]


@pytest.fixture
def key(tmp_path):
    k = tmp_path / "id_test"
    k.write_text("not a real key")
    k.chmod(0o600)
    return str(k)


def saved_host_cluster(key: str) -> SetupOptions:
    """What `setup --runtime host --hostnames A B C --private_key_file K --ssh_port 2222 ...` saves."""
    spec = ClusterSpec(storage="/shared", hosts=[HostSpec(h, user="ubuntu", port=2222, key_file=key) for h in "ABC"])
    opts = SetupOptions(spec=spec, runtime="host", python="/opt/venv/bin/python", ray_port=6380)
    save_state(opts)
    return opts


def test_hosts_named_again_keep_what_setup_saved(key):
    saved_host_cluster(key)
    for target in (Target(), Target(hostnames=["A", "B", "C"]), Target(hosts=["A,B", "C"], username="ubuntu")):
        opts = target.options()
        assert (opts.runtime, opts.python, opts.storage, opts.ray_port) == ("host", "/opt/venv/bin/python", "/shared", 6380)
        assert [(h.hostname, h.user, h.port, h.key_file) for h in opts.spec.hosts] == \
            [(h, "ubuntu", 2222, key) for h in "ABC"]


def test_the_command_line_wins_over_the_saved_state(key):
    saved_host_cluster(key)
    opts = Target(hostnames=["A", "B"], username="root", runtime="docker").options()
    assert opts.runtime == "docker" and opts.python == "/opt/venv/bin/python"
    assert [(h.hostname, h.user, h.port) for h in opts.spec.hosts] == [("A", "root", 2222), ("B", "root", 2222)]
    # a cluster setup never saw: setup's defaults
    other = Target(name="other", hostnames=["X"]).options()
    assert (other.runtime, other.python, other.storage, other.spec.hosts[0].port) == ("docker", "python3", "/storage", None)


def test_a_jump_host_setup_saved_is_the_route_unless_hosts_come_with_their_own_ssh_config(key, tmp_path):
    opts = saved_host_cluster(key)
    opts.gateway = "root@login"
    save_state(opts)
    assert Target().options().gateway == "root@login"
    assert Target(ssh_config=str(tmp_path / "cfg")).options().gateway == "root@login"  # the saved hosts
    # aliases of the user's ssh config: its ProxyJump is their route
    assert Target(hosts=["n1", "n2"], ssh_config=str(tmp_path / "cfg")).options().gateway is None
    assert Target(hosts=["n1"], ssh_config=str(tmp_path / "cfg"), gateway="me@jump").options().gateway == "me@jump"


def test_down_with_the_hosts_named_again_stops_the_host_runtime(capsys, key):
    saved_host_cluster(key)
    code, out, _ = cli(capsys, "down", "--dry-run", "--hostnames", "A", "B", "C", "--private_key_file", key,
                       "--username", "ubuntu")
    assert code == 0
    assert "docker" not in out
    assert "ssh -p 2222 ubuntu@A" in out


class ScriptedRemote:
    """Stands in for an SSH session: every host answers, every command fails as on a host without Docker."""

    def __init__(self, host, opts, log):
        self.host, self.log, self.user, self.commands = host, HostLog(None, []), host.user or "root", []

    def connect(self) -> str:
        return f"10.0.0.{ord(self.host.hostname) - ord('A') + 1}"

    def put_text(self, *_):
        pass

    def run(self, cmd: str, sudo: bool = False, check: bool = False, timeout=None, quiet: bool = False) -> Result:
        ScriptedRemote.seen.append(cmd)
        return Result(cmd, 1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock")

    def close(self):
        pass


@pytest.fixture
def scripted(monkeypatch):
    ScriptedRemote.seen = []
    monkeypatch.setattr(remote_mod, "Remote", ScriptedRemote)
    return ScriptedRemote


def good_figures() -> dict:
    rep = {"cluster": "areal", "time": 1.0e9, "ok": True, "network": {"links_gbps": {"10.0.0.1>10.0.0.2": 1.0}}}
    netfigures.save("areal", rep)
    return rep


def test_doctor_with_the_hosts_named_again_probes_the_saved_runtime(capsys, key, scripted):
    saved_host_cluster(key)
    good = good_figures()
    code, _, _ = cli(capsys, "doctor", "--hostnames", "A", "B", "C", "--private_key_file", key, "--username", "root")
    assert code == 1
    probes = [c for c in scripted.seen if "areal_kit.cluster.probe" in c]
    assert probes and not any("docker" in c for c in probes), probes
    assert all("/opt/venv/bin/python -m areal_kit.cluster.probe" in c for c in probes)
    # every host's runtime failed to answer: nothing was measured, the last figures stay
    assert json.loads(netfigures.result_path("areal").read_text()) == good


def test_a_doctor_run_that_reached_no_runtime_keeps_the_figures_and_blames_its_settings(capsys, key, scripted):
    saved_host_cluster(key)
    good = good_figures()
    code, out, _ = cli(capsys, "doctor", "--runtime", "docker", "--min-disk-gb", "1")
    assert code == 1
    fails = [ln for ln in out.splitlines() if ln.startswith("FAIL ")]
    assert len(fails) == 3, out
    assert all("check --runtime and --python (this run: docker" in ln for ln in fails)
    assert "areal-kit setup" not in out  # nor in the recap: the checks after the runtime's are skipped
    assert "the docker runtime (/opt/venv/bin/python) answered on no host" in out
    assert f"the figures in {netfigures.result_path('areal')} are kept" in out
    assert json.loads(netfigures.result_path("areal").read_text()) == good


def test_a_doctor_run_that_reached_no_host_keeps_the_figures(capsys, key, monkeypatch):
    saved_host_cluster(key)
    good = good_figures()

    def unreachable(c, h):
        raise StepFailed(f"unreachable: {h.name}: connection refused")

    monkeypatch.setattr(steps, "connect", unreachable)
    code, out, _ = cli(capsys, "doctor", "--json")
    assert code == 1
    rep = json.loads(out)
    assert rep["fault"] == "no host could be reached over SSH" and not rep["ok"]
    assert json.loads(netfigures.result_path("areal").read_text()) == good


def test_an_option_is_the_field_it_fills():
    """A command's flag, default and help are its dataclass field's: changed there, changed everywhere."""
    setup, doctor = inspect.signature(cmd.setup).parameters, inspect.signature(cmd.doctor).parameters
    assert setup["ray_port"].default.default == SetupOptions.ray_port == 6379
    assert setup["min_nofile"].default is not doctor["min_nofile"].default  # each command its own typer object
    assert setup["min_nofile"].default.help == doctor["min_nofile"].default.help
    assert setup["min_nofile"].default.default == doctor["min_nofile"].default.default == Limits.min_nofile
    with pytest.raises(TypeError, match="declared twice"):
        flags.command(flags.params(Limits), flags.params(Limits, "min_nofile"))(lambda **given: 0)

"""How a host is reached, resolved without connecting: ~/.ssh/config aliases, User, Port,
IdentityFile and ProxyJump, a --gateway for every host, flags winning over the file, root and
22 when nothing says otherwise. Connecting through a real login node is tests/cluster/test_jump_host.py."""

from __future__ import annotations

import pytest

from areal_kit.cli import main
from areal_kit.cluster.remote import ConnectOptions, HostLog, Remote
from areal_kit.config.cluster_spec import HostSpec

SSH_CONFIG = """
Host login
  HostName 10.0.0.1
  User admin
  Port 2222
Host gpu*
  HostName %h.internal
  User ubuntu
  Port 2200
  IdentityFile /keys/gpu
  ProxyJump login
"""


@pytest.fixture
def ssh_config(tmp_path):
    p = tmp_path / "ssh_config"
    p.write_text(SSH_CONFIG)
    return str(p)


def remote(host: HostSpec, tmp_path, **opts) -> Remote:
    return Remote(host, ConnectOptions(known_hosts=str(tmp_path / "kh"), **opts), HostLog(None, []))


def test_alias_user_port_and_proxyjump_come_from_the_ssh_config(ssh_config, tmp_path):
    r = remote(HostSpec("gpu7"), tmp_path, ssh_config=ssh_config)
    assert r.route() == ["admin@10.0.0.1:2222", "ubuntu@gpu7.internal:2200"]
    assert r.conn.connect_kwargs["key_filename"] == ["/keys/gpu"]
    assert r.user == "ubuntu"
    assert r.wrap("docker ps", sudo=True) == "sudo -n sh -c 'docker ps'"  # not root: through sudo


def test_flags_win_over_the_ssh_config(ssh_config, tmp_path):
    r = remote(HostSpec("gpu7", user="root", port=22, key_file="/keys/mine"), tmp_path, ssh_config=ssh_config)
    assert r.route()[-1] == "root@gpu7.internal"
    assert r.conn.connect_kwargs["key_filename"][0] == "/keys/mine"  # the flag's key is tried first
    assert r.wrap("docker ps", sudo=True) == "docker ps"


def test_a_gateway_flag_puts_one_jump_host_in_front_of_every_host(ssh_config, tmp_path):
    r = remote(HostSpec("10.1.0.5"), tmp_path, ssh_config=ssh_config, gateway="ops@bastion:2022")
    assert r.route() == ["ops@bastion:2022", "root@10.1.0.5"]


def test_without_any_config_the_user_is_root_on_port_22(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("")
    assert remote(HostSpec("node1"), tmp_path, ssh_config=str(empty)).route() == ["root@node1"]


def test_dry_run_shows_the_jump_host(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))
    assert not main(["setup", "--hostnames", "n1", "--gateway", "ops@bastion", "--dry-run"])
    assert "ssh -J ops@bastion root@n1" in capsys.readouterr().out

"""A cluster behind a login node: the controller reaches one host (the login node) and the three
nodes only through it, as on many GPU clusters. setup goes through `--gateway`; status and down
go through an OpenSSH config file (aliases, HostName, User, IdentityFile, ProxyJump), with no
host flag but the aliases.
"""

from __future__ import annotations

import pytest
from image import venv_mounts
from kit import lines, setup_args
from test_host_cluster import alive_nodes


@pytest.fixture
def login_node(testbed):
    testbed.jump_up()
    yield testbed
    testbed.jump_down()


def test_setup_status_down_through_a_login_node(login_node, kit, tmp_path):
    tb = login_node
    ips, ctl = tb.ips, tuple(tb.ctl_cmd())
    assert tb.ctl_ssh(tb.jump_ip, "true").returncode == 0, "the controller reaches the login node"
    assert tb.ctl_ssh(ips[0], "true").returncode != 0, "the controller must not reach a node directly"
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host login\n  HostName {tb.jump_ip}\n  User root\n  IdentityFile {tb.key}\n"
                          + "".join(f"Host n{i}\n  HostName {ip}\n" for i, ip in enumerate(ips, 1))
                          + f"Host n*\n  User root\n  IdentityFile {tb.key}\n  ProxyJump login\n")
    try:
        r = kit.run("setup", *kit.conn_args(), "--gateway", f"root@{tb.jump_ip}", *setup_args(tb, "host"),
                    prefix=ctl)
        assert r.returncode == 0, r.stdout[-3000:]
        assert "cluster areal is up" in r.stdout
        connected = [ln for ln in lines(r, "ok") if "] connect:" in ln]
        assert len(connected) == 3, r.stdout
        for ip in ips:  # the node address is the one the nodes use, as the login node sees it
            assert any(f"node address {ip}" in ln for ln in connected), connected
        assert alive_nodes(tb) == ips

        s = kit.run("status", "--ssh-config", str(ssh_config), "--known-hosts", str(kit.known_hosts),
                    "--runtime", "host", "--python", f"{venv_mounts()[0]}/bin/python", "n1", "n2", "n3", prefix=ctl)
        assert s.returncode == 0, s.stdout[-3000:]
        assert "Ray reports 3 alive node(s)" in s.stdout
        for ip in ips:
            assert ip in s.stdout
    finally:
        d = kit.run("down", "--ssh-config", str(ssh_config), "--known-hosts", str(kit.known_hosts), prefix=ctl)
    assert d.returncode == 0, d.stdout[-3000:]
    for i in (1, 2, 3):
        assert tb.ssh(i, "pgrep -f '[r]aylet'", check=False).returncode == 1, f"raylet left on node{i}"

"""Failures against real sshd hosts: each is named per host with what to do, exit code 1,
and fails fast (no hanging on a host that will never answer)."""

from __future__ import annotations

import os
import subprocess

import pytest
from kit import setup_args


def test_unreachable_host_times_out_with_name(testbed, kit):
    bad = testbed.ip(90)  # on the bridge's subnet, nobody there
    r = kit.run("setup", *kit.conn_args([bad]), *setup_args(testbed, "host"),
                "--ssh-wait", "3", "--connect-timeout", "2")
    assert r.returncode == 1
    assert f"FAILED [{bad}] connect: unreachable" in r.stdout
    assert r.seconds < 40


def test_authentication_refused(testbed, kit, tmp_path):
    key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    args = kit.conn_args([testbed.ip(1)])
    args[args.index("--private_key_file") + 1] = str(key)
    r = kit.run("setup", *args, *setup_args(testbed, "host"))
    assert r.returncode == 1
    assert f"FAILED [{testbed.ip(1)}] connect: auth: authentication refused for root@{testbed.ip(1)}" in r.stdout


def test_changed_host_key_is_refused_with_fix(testbed, kit, tmp_path):
    fake = tmp_path / "fake_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(fake)], check=True)
    kit.home.mkdir(parents=True, exist_ok=True)
    kt, b64 = (tmp_path / "fake_host_key.pub").read_text().split()[:2]
    kit.known_hosts.write_text(f"{testbed.ip(1)} {kt} {b64}\n")
    before = kit.known_hosts.read_text()
    r = kit.run("setup", *kit.conn_args([testbed.ip(1)]), *setup_args(testbed, "host"))
    assert r.returncode == 1
    assert "hostkey: host key changed" in r.stdout
    assert f"ssh-keygen -f {kit.known_hosts} -R {testbed.ip(1)}" in r.stdout
    assert kit.known_hosts.read_text() == before, "a changed key must never be overwritten"


def test_strict_policy_refuses_unknown_host(testbed, kit):
    r = kit.run("setup", *kit.conn_args([testbed.ip(1)]), *setup_args(testbed, "host"),
                "--host-key-policy", "strict")
    assert r.returncode == 1
    assert "is not in" in r.stdout
    assert "strict" in r.stdout


@pytest.fixture
def user_without_sudo(testbed):
    name = "aknosudo"
    subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", "-p", "*", name], capture_output=True, check=False)
    yield name
    subprocess.run(["userdel", name], capture_output=True, check=False)


def test_missing_sudo_is_named(testbed, kit, user_without_sudo):
    r = kit.run("setup", *kit.conn_args([testbed.ip(1)]), *setup_args(testbed, "host"),
                "--username", user_without_sudo)
    assert r.returncode == 1
    assert f"FAILED [{testbed.ip(1)}] preflight: missing sudo: {user_without_sudo} is not root" in r.stdout
    assert "NOPASSWD" in r.stdout


def test_private_key_permissions_checked(testbed, kit, tmp_path):
    key = tmp_path / "loose_key"
    key.write_bytes(testbed.key.read_bytes())
    os.chmod(key, 0o644)
    args = kit.conn_args([testbed.ip(1)])
    args[args.index("--private_key_file") + 1] = str(key)
    r = kit.run("setup", *args, *setup_args(testbed, "host"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --private_key_file:")
    assert "chmod 600" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

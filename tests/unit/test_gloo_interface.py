"""Trainer ranks on several hosts: gloo is pointed at the interface of the node's cluster address
(without it, gloo binds where the hostname resolves, 127.0.x.1 in a container, and ranks on other
hosts are told to connect to loopback). The cross-host run itself is `areal-kit doctor --rl-step` on
the testbed (tests/cluster/test_doctor_cluster.py).

    .venv/bin/python -m pytest tests/unit/test_gloo_interface.py -q
"""

import pytest

from areal_kit import hardware

pytestmark = pytest.mark.unit


def test_the_interface_holding_an_address_is_found():
    assert hardware.interface_of("127.0.0.1") == "lo"
    assert hardware.interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_gloo_is_pinned_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert hardware.pin_gloo_interface("127.0.0.1") == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert hardware.pin_gloo_interface("127.0.0.1") == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert hardware.pin_gloo_interface("203.0.113.77") is None

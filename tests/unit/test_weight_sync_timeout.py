"""weight_sync_timeout_s bounds the sync group: a rendezvous whose peer never comes fails after it."""

import socket
import time

import pytest

from areal_kit.config.loader import load_config
from areal_kit.config.schema import ConfigError
from areal_kit.rl.weight_sync import transport


@pytest.mark.slow
def test_a_peer_that_never_joins_fails_the_rendezvous_within_the_timeout():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.time()
    with pytest.raises(Exception):  # noqa: B017 - torch raises DistStoreError or RuntimeError by version
        transport.init_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=2, local_ip="127.0.0.1")
    assert time.time() - t0 < 30


def test_the_timeout_is_a_config_key_with_a_one_line_refusal():
    assert load_config("tiny", ["weight_sync_timeout_s=30"]).weight_sync_timeout_s == 30
    with pytest.raises(ConfigError, match="weight_sync_timeout_s"):
        load_config("tiny", ["weight_sync_timeout_s=0"])

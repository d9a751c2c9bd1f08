"""The watchdog's bound of a call: exp_ctrl.hang_first_s for the first calls of a kind, then
hang_factor x the median of that kind, never under hang_floor_s; off at hang_factor=0. The hang
itself, on real actors and a real run: tests/integration/test_controller_actors.py and
test_hang_relaunch.py."""

import pytest

from areal_kit.config.schema import ConfigError, ExpCtrl
from areal_kit.rl.driver.watchdog import Watchdog


def dog(**kw) -> Watchdog:
    return Watchdog(ExpCtrl(**{"hang_factor": 10, "hang_floor_s": 60, "hang_first_s": 900, "hang_warmup": 3, **kw}),
                    "/unused")


def test_first_calls_get_the_first_bound_then_a_multiple_of_the_median():
    d = dog()
    for t in (40.0, 2.0, 3.0):
        assert d.bound("train_step") == 900
        d.record("train_step", t)
    assert d.bound("train_step") == 60  # 10 x the median 3 s is under the floor
    for t in (20.0, 20.0, 20.0):
        d.record("train_step", t)
    assert d.bound("train_step") == 200  # median of 40, 2, 3, 20, 20, 20 = 20
    assert d.bound("generate") == 900  # every kind warms up on its own


def test_the_median_follows_the_recent_calls():
    d = dog(hang_warmup=1)
    for _ in range(100):
        d.record("generate", 1.0)
    for _ in range(50):
        d.record("generate", 30.0)  # the run slowed down (longer answers): the last 50 calls decide
    assert d.bound("generate") == 300


def test_a_ceiling_caps_the_bound_after_the_warm_up_only():
    d = dog(hang_warmup=1, hang_ceiling_s=120)
    assert d.bound("generate") == 900  # the first calls keep hang_first_s
    d.record("generate", 30.0)
    assert d.bound("generate") == 120  # 10 x 30 s, capped
    assert dog(hang_warmup=1).bound("generate") == 900
    d = dog(hang_warmup=1)
    d.record("generate", 30.0)
    assert d.bound("generate") == 300  # no ceiling by default


def test_off():
    assert dog(hang_factor=0).bound("train_step") is None


@pytest.mark.parametrize("bad", [{"hang_factor": -1}, {"hang_floor_s": 0}, {"hang_first_s": -5}, {"hang_warmup": -1}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError, match=f"exp_ctrl.{next(iter(bad))}="):
        ExpCtrl(**bad)

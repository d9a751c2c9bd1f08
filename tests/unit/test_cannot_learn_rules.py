"""The loop's stop rules for a run that cannot learn: a non-finite loss or gradient at once, rewards that all
fail after the configured number of steps in a row (a step with any reward scored resets it)."""

import pytest

from areal_kit.config.loader import load_config
from areal_kit.rl.driver.controller import CannotLearn, Controller
from areal_kit.rl.driver.job import RunState
from areal_kit.rl.sample import Generated, Sample


def ctrl(limit: int) -> Controller:
    c = Controller.__new__(Controller)  # the checks read only the config and the step counter
    c.cfg = load_config("tiny", [f"exp_ctrl.stop_after_failed_reward_steps={limit}"])
    c.state, c._failed_steps, c._first_failure = RunState(global_step=6), 0, ""
    return c


def step(c: Controller, n_samples: int, failures: dict) -> None:
    samples = [Sample(f"p{i}", i, [1], [2], [-0.1], False, 0, 0.0) for i in range(n_samples)]
    c._check_rewards(samples, [Generated([], 0.0, 0.0, 0, 0, reward_failures=failures)])


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_stops_the_run(loss):
    with pytest.raises(CannotLearn, match="at global step 7"):
        ctrl(3)._check_loss({"actor_loss": loss})
    ctrl(3)._check_loss({"actor_loss": 0.25})  # a finite loss goes on


@pytest.mark.parametrize("norm", [float("nan"), float("inf")])
def test_a_non_finite_gradient_under_a_finite_loss_stops_the_run(norm):
    """The forward can stay finite while the backward overflows: that step's update is poisoned."""
    with pytest.raises(CannotLearn, match="the gradient norm is .* at global step 7"):
        ctrl(3)._check_loss({"actor_loss": 0.09, "grad_norm": norm})
    ctrl(3)._check_loss({"actor_loss": 0.09, "grad_norm": 1.5})


def test_failed_rewards_stop_after_the_limit_and_name_the_first_error():
    c = ctrl(2)
    step(c, 4, {"mine: ValueError": (4, "mine: ValueError: first")})
    assert c._failed_steps == 1
    step(c, 4, {"mine: ValueError": (1, "x"), "mine: timeout": (1, "y")})  # 2 of 4 failed: signal remains
    assert c._failed_steps == 0, "a step with any scored sample ends the streak"
    step(c, 4, {"mine: timeout": (4, "mine: timeout after 5s")})
    with pytest.raises(CannotLearn) as got:
        step(c, 4, {"mine: ValueError": (4, "mine: ValueError: later")})
    assert "in 2 steps in a row" in str(got.value)
    assert "first error: mine: timeout after 5s" in str(got.value)


def test_zero_never_stops():
    c = ctrl(0)
    for _ in range(10):
        step(c, 2, {"mine: ValueError": (2, "e")})
    assert c._failed_steps == 10

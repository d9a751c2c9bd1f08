"""Fixtures the integration tests share: a local Ray whose workers can import the test modules."""

import os

import pytest


@pytest.fixture()
def ray_local():
    """Ray on this machine, 3 CPUs; workers import a test module by name, so its folder is on their path."""
    import ray

    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": here}})
    yield
    ray.shutdown()

"""Shared pytest setup: markers by folder (unit, integration, cluster, gpu); the fake_model and kit_home fixtures."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in ("unit", "integration", "cluster", "gpu"):
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture
def fake_model(tmp_path):
    """A model folder that passes the commands' path checks and loads nothing (bad-input tests)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def kit_home(tmp_path, monkeypatch):
    """A private AREAL_KIT_HOME: cluster state saved by one test is never read by another."""
    monkeypatch.setenv("AREAL_KIT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def pytest_unconfigure(config):
    """pytest's own faulthandler stops at the end of the session; a crash while the interpreter shuts
    down (a native thread of Ray, vLLM, torch or DeepSpeed outliving its test) would then exit 139 with
    no trace. Keep one on until the process is gone, so such a crash names where it happened."""
    import faulthandler
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)

"""Shared pytest setup: markers by folder (unit, integration, cluster, gpu); the fake_model fixture."""

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

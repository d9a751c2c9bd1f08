"""tests/gpu: acceptance on a CUDA GPU node (marker `gpu`), skipped with the reason elsewhere.

In the GPU image the package is installed and the mounted checkout brings the tests only. The
docs/tests.md's `docker run -v $PWD:/w -w /w ... python -m pytest tests/gpu` puts /w first on sys.path,
and the checkout's areal_kit lacks train_scripts and evaluation, which pyproject maps into the
installed package from the top of the repository. So where an installed areal_kit exists elsewhere
on sys.path, the checkout leaves sys.path before any test imports the package. A checkout
installed in editable mode has no other copy and keeps importing its own.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _where(entry: str) -> Path:
    return Path(entry or os.getcwd()).resolve()  # "" is the working directory


def _prefer_the_installed_package() -> None:
    if any(_where(e) != ROOT and (_where(e) / "areal_kit" / "__init__.py").is_file() for e in sys.path):
        sys.path[:] = [e for e in sys.path if _where(e) != ROOT]


_prefer_the_installed_package()


def pytest_configure(config):
    # Registered here too, so `pytest tests/gpu` collects under --strict-markers on its own.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU node; skipped without one")


def pytest_terminal_summary(terminalreporter):
    """The suite's one table of checks with timings (tests/gpu/acceptance.py), for a bug report."""
    from acceptance import TABLE

    if TABLE.rows:
        terminalreporter.write_sep("=", "GPU acceptance: paste this table into a bug report")
        terminalreporter.write_line(TABLE.render())

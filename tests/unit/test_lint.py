"""The tree passes `ruff check` and `mypy` with the project's settings (pyproject.toml; both pinned in
the dev extra so that a new release cannot fail a clean clone by itself)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is not installed; expected it from the dev extra (bash .ci/install.sh --test)"
    proc = subprocess.run([exe, "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_mypy_finds_nothing():
    """The package type-checks clean ([tool.mypy] names it); the cache goes to .mypy_cache at the root."""
    mypy = Path(sys.executable).with_name("mypy")
    exe = str(mypy) if mypy.exists() else shutil.which("mypy")
    assert exe, "mypy is not installed; expected it from the dev extra (bash .ci/install.sh --test)"
    proc = subprocess.run([exe], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_test_files_have_unique_basenames():
    """pytest's default import mode imports test files by basename: two folders holding the same
    name make the whole run stop at collection, which a run of one folder alone does not show."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test files share a basename: " + "; ".join(clashes)

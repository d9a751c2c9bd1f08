"""A non-editable install finds the presets and the eval files: build a wheel, install it into a
fresh venv outside the repository, and from another directory run `areal-kit train PRESET
--dry-run` and load the eval manifest.

    python -m pytest tests/integration/test_wheel_install.py -q

To stay light the venv gets the wheel alone (--no-deps) and sees the heavy dependencies through
a .pth line naming this environment's site-packages. A path in a .pth file is only added to
sys.path (the .pth files inside it are not run), so this checkout's editable install, which is
one of those, never loads there: the test asserts areal_kit comes from the new venv.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a wheel is built from: the files of a clean checkout (`git archive`), not the working tree.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "areal_kit", "train_scripts", "evaluation", "docker")


def run(argv, cwd, env=None) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv with areal-kit installed from a wheel; returns (venv, env for its commands)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", "dist",
         str(src)], cwd=base)
    wheel, = (base / "dist").glob("areal_kit-*.whl")
    venv = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=base)
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
         "--quiet", str(wheel)], cwd=base)
    site = Path(run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    cwd=base).strip())
    (site / "heavy_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AREAL_DEVICE", "AREAL_EVAL_MANIFEST_DIR")}
    env.update(AREAL_USER="tester", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    return venv, env


@pytest.fixture
def elsewhere(tmp_path):
    """A working directory with no train_scripts/ or evaluation/ beside it."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    return d


def test_the_package_comes_from_the_new_venv(installed, elsewhere):
    venv, env = installed
    where = run([str(venv / "bin" / "python"), "-c", "import areal_kit; print(areal_kit.__file__)"],
                cwd=elsewhere, env=env).strip()
    assert Path(where).is_relative_to(venv)


@pytest.mark.parametrize("preset", ["1.5B_n4", "tiny"])
def test_train_dry_run_finds_the_preset(installed, elsewhere, preset):
    venv, env = installed
    out = run([str(venv / "bin" / "areal-kit"), "train", preset, "--dry-run"], cwd=elsewhere, env=env)
    assert "dry run: configuration is valid" in out


def test_the_eval_manifest_and_prompts_load(installed, elsewhere):
    venv, env = installed
    code = textwrap.dedent("""
        from areal_kit.train_scripts import PRESET_DIR, preset_names
        from areal_kit.eval.data import EVAL_DIR, manifest, prompt_templates
        print(EVAL_DIR); print(PRESET_DIR)
        print(",".join(sorted(manifest()))); print(",".join(sorted(prompt_templates())))
        print(",".join(preset_names()))
    """)
    eval_dir, preset_dir, datasets, prompts, presets = \
        run([str(venv / "bin" / "python"), "-c", code], cwd=elsewhere, env=env).splitlines()
    assert Path(eval_dir).is_relative_to(venv)
    assert Path(preset_dir).is_relative_to(venv)
    assert {"math_500", "aime24", "amc23", "gsm8k"} <= set(datasets.split(","))
    assert "deepscaler" in prompts.split(",")
    # Every preset of the checkout ships (the _-prefixed files are bases, not presets).
    shipped = {p.stem for p in (ROOT / "train_scripts").glob("*.yaml") if not p.stem.startswith("_")}
    assert {"tiny", "tiny_dapo", "1.5B_n1", "7B_n16"} <= shipped
    assert set(presets.split(",")) == shipped


def test_the_gpu_tests_collect_in_the_image_way_against_the_installed_copy(installed):
    """The in-image acceptance command (docs/tests.md): the package installed from a wheel, the checkout
    mounted as the working directory, `python -m pytest tests/gpu` (which puts the working
    directory first on sys.path). The checkout's areal_kit has no train_scripts/evaluation
    subpackages (pyproject maps them in at install), so it must not shadow the installed one."""
    venv, env = installed
    env = {**env, "PYTHONDONTWRITEBYTECODE": "1"}
    out = run([str(venv / "bin" / "python"), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "tests/gpu"], cwd=ROOT, env=env)
    assert "tests/gpu/test_gpu_acceptance.py::" in out, out[-2000:]

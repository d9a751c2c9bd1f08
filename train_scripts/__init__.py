"""The preset YAMLs, shipped as the package data `areal_kit.train_scripts` (config/loader.py reads
them); a file whose name starts with `_` is a base the presets inherit, not a preset."""

from importlib import resources
from pathlib import Path

PRESET_DIR = Path(str(resources.files(__name__)))


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("_"))

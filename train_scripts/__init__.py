"""The preset YAMLs, shipped as the package data `areal_kit.train_scripts` (config/loader.py)."""

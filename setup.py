"""Build hook next to pyproject.toml (which holds everything else): the package list.

train_scripts/ (presets) and evaluation/ (eval manifest, prompt templates) stay at the top of the
repository, where the AReaL guide keeps them, and ship inside the package as
areal_kit.train_scripts and areal_kit.evaluation (pyproject's package-dir maps them); docker/ ships
as areal_kit.docker, so `areal-kit setup` can build the runtime image from a wheel install. Listed here
because setuptools' package discovery in pyproject.toml cannot add mapped packages to what it finds.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["areal_kit", "areal_kit.*"]),
                "areal_kit.train_scripts", "areal_kit.evaluation", "areal_kit.docker"])

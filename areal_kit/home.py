"""This machine's areal-kit folder: $AREAL_KIT_HOME, default ~/.areal-kit.

It holds what one command leaves for a later one on this machine: the clusters setup made
(clusters/<name>.json and their Ray tokens), doctor's figures (clusters/<name>.doctor.json,
which the dry run reads) and the per-host logs of setup (logs/<name>/<time>/).

    AREAL_KIT_HOME=/tmp/kit areal-kit status
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("AREAL_KIT_HOME", "~/.areal-kit")).expanduser()

"""The random-number state of a process (python, numpy, torch, and CUDA where it already runs).

A recover checkpoint holds one file per trainer rank and one for the driver, so a resumed run
draws the same numbers as one that never stopped. CUDA's generators are read only in a process
that has initialized CUDA (a trainer rank): reading them starts a CUDA context on every GPU the
process sees, and the driver, which computes nothing on a GPU, would take one (about 0.5 GB) on
each GPU of its node, GPUs the workers already fill.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def restore(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():  # queued by torch until CUDA starts: no context now
        torch.cuda.set_rng_state_all(s["cuda"])


def save(path: str) -> None:
    torch.save(state(), path)


def load(path: str) -> None:
    restore(torch.load(path, weights_only=False))

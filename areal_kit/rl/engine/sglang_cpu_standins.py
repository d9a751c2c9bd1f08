"""CPU-only stand-ins that let SGLang's CPU engine start from PyPI wheels: never used on a GPU.

SGLang's CPU engine needs two things PyPI cannot give a CPU machine:
  - `sgl_kernel`'s CPU build (PyPI ships CUDA builds only), from which SGLang imports kernels at
    module level. The one a plain generation calls, `assign_req_to_token_pool_cpu` (a copy of new
    KV-cache slots into the request-to-token table), is written here in plain torch; any other
    name imports as a function that raises when called (they serve features a rollout does not
    turn on: speculative decoding, KV moves between cache tiers), so a missing one fails loudly;
  - PyPI's torchvision is a CUDA build whose operator library fails to load without CUDA, and
    its import then registers fake kernels for two operators (`nms`, `qnms`) that were never
    defined: they are defined here (schemas only, no kernels) before torchvision imports.

The SGLang installer (sglang_env.py) copies this file into the CPU venv's site-packages with a
`.pth` line that calls install() at interpreter start, which puts a finder on sys.meta_path. The
finder imports nothing itself until `sgl_kernel` or `torchvision` is asked for; a real
`sgl_kernel` found on the path always wins. It imports only the standard library and torch, as
it runs in SGLang's venv, where areal_kit is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

_LIBS: list[Any] = []  # torch.library handles live as long as the operators they define


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any,
                                 end_offset: Any, out_cache_loc: Any, pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc.

    The runs are laid end to end in out_cache_loc in request order (what SGLang's triton kernel
    of the same name does on GPUs); pool_len is the table's row length, implied by its shape here.
    """
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _define_torchvision_ops() -> None:
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBS.append(lib)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]
        module.__getattr__ = _missing_kernel  # type: ignore[method-assign]


def _missing_kernel(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (areal-kit's SGLang CPU test env "
                                  "stands in for assign_req_to_token_pool_cpu only)")
    return missing


class StandinFinder(importlib.abc.MetaPathFinder):
    """Serves `sgl_kernel` where no real one is installed; defines torchvision's ops before it loads."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" and not _LIBS:
            _define_torchvision_ops()
        if name == "sgl_kernel" and importlib.machinery.PathFinder.find_spec(name, path) is None:
            return importlib.machinery.ModuleSpec(name, _Loader())
        return None


def install() -> None:
    if not any(isinstance(f, StandinFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, StandinFinder())

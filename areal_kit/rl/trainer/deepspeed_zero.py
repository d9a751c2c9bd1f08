"""What the trainer asks of DeepSpeed besides its engine: the config (ZeRO stage, fp32 gradient
accumulation for a bf16 model), ZeRO-3's full state gathered a group of parameters at a time, and
the universal format through which a recover checkpoint loads on another number of ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from areal_kit.durable import fsync_dir, fsync_tree
from areal_kit.rl import memory

if TYPE_CHECKING:
    from areal_kit.config.schema import ModelConfig


def deepspeed_config(actor: ModelConfig, dtype: torch.dtype) -> dict:
    """DeepSpeed's config for training `actor` (config.schema's ModelConfig) in dtype.

    The trainer marks each micro-batch's accumulation boundary itself, so DeepSpeed is told of one
    micro-batch a step. A bf16 model accumulates its gradients in fp32 under ZeRO 1-3: DeepSpeed
    would otherwise accumulate in the model's dtype, and a GPU preset's step adds up hundreds of
    micro-batches per rank, whose small late terms bf16's 8-bit mantissa rounds away. Without ZeRO
    DeepSpeed has no fp32 accumulation for a bf16 model (it refuses the mix), so ZeRO-0 keeps bf16's.
    """
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": actor.gradient_clipping,
        "zero_optimization": zero_settings(actor.zero_stage),
        "steps_per_print": 10**9,
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    if dtype == torch.bfloat16 and actor.zero_stage > 0:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def zero_settings(stage: int) -> dict:
    """DeepSpeed's zero_optimization: the stage, the bucket sizes the memory plan counts
    (rl/memory.py), and under ZeRO 1-2 overlap_comm (ZeRO-0 takes none of them).

    ZeRO-2 reduces the gradients at every micro-batch (a step of the 1.5B presets has hundreds a
    rank), and DeepSpeed 0.19.8 turns overlap_comm on only at stage 3: without it each bucket's
    reduction runs on the compute stream and backward waits for it. With it the reduction runs on
    its own stream while backward fills the next bucket, so a micro-batch waits for its last bucket
    alone (100 MB: milliseconds, against seconds of forward and backward), for one more bucket of
    memory. ZeRO-1 would reduce once a step instead, but keeps every fp32 gradient whole: 4 B x
    (N-1)/N of the model more per GPU (6.2 GB for the 1.5B model over 8 ranks), which on shared
    GPUs comes out of vLLM's KV cache, to save what overlap already hides. So the presets stay at
    ZeRO-2, with overlap (ZeRO-1's one reduction a step overlaps the same way).
    """
    if stage == 0:  # no ZeRO: DeepSpeed's all-reduce bucket is fixed (memory.ZERO0_ALLREDUCE_BUCKET)
        return {"stage": 0}
    z = {"stage": stage, "reduce_bucket_size": memory.REDUCE_BUCKET, "allgather_bucket_size": memory.ALLGATHER_BUCKET}
    if stage < 3:  # stage 3 has it on by DeepSpeed's default
        z["overlap_comm"] = True
    return z


def ranks_written(path: str) -> int:
    """How many trainer ranks wrote the recover checkpoint at path (each saves its RNG state)."""
    return len([f for f in os.listdir(path) if f.startswith("rng_rank") and f.endswith(".pt")])


def universal_tag(path: str, rank: int) -> str:
    """The checkpoint's DeepSpeed state in the universal format (any number of ranks loads it):
    converted by rank 0 with DeepSpeed's own ds_to_universal, into a temporary folder then renamed,
    so a conversion cut short is redone, never half-read. Returns the tag to load."""
    tag = "deepspeed_universal"
    out = os.path.join(path, tag)
    if rank != 0 or os.path.isdir(out):
        return tag
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # inject_missing_state: the version record Megatron-style clients write; a plain engine has none.
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           os.path.join(path, "deepspeed"), "--output_folder", tmp, "--num_extract_workers", "1",
           "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"converting {path} to DeepSpeed's universal checkpoint failed: {last}")
    fsync_tree(tmp)
    os.replace(tmp, out)
    fsync_dir(path)
    return tag


def gathered_state(module: torch.nn.Module, keep: bool, group_bytes: int = 512 << 20,
                   only: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """ZeRO-3: the module's full state dict, gathered about group_bytes of parameters at a time
    (every rank must call it, in step); with keep, a copy of every tensor; with only(name), the
    tensors whose name it accepts (a LoRA adapter's, say). A whole-model gather
    would hold the model once more on every rank, on top of the keeper's copy: 4x the bf16 model on
    rank 0 during a sync, where this needs 2x plus one group."""
    import deepspeed

    entries = list(module.state_dict(keep_vars=True).items())  # tied weights: one Parameter, two names
    if only is not None:
        entries = [(name, v) for name, v in entries if only(name)]
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    group: list[tuple[str, torch.Tensor]] = []

    def flush() -> None:
        params = list({id(v): v for _, v in group if hasattr(v, "ds_id")}.values())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, v in group:
                if keep:
                    if id(v) not in copies:
                        copies[id(v)] = v.detach().clone()
                    out[name] = copies[id(v)]
        group.clear()

    size = 0
    for name, v in entries:
        nbytes = getattr(v, "ds_numel", v.numel()) * v.element_size()
        if group and size + nbytes > group_bytes:
            flush()
            size = 0
        group.append((name, v))
        size += nbytes
    if group:
        flush()
    return out

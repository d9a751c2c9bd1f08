"""The trainer's side of SGLang's weight-update group: join it as rank 0, broadcast named tensors.

SGLang's servers join a group of their own name (/init_weights_update_group) through a TCP store
at master_address:master_port, not the default process group: torch keys a group's rendezvous by
its name, so the trainer joins under the same name the same way (what SGLang does on its side),
beside whatever default group its own training uses.

    group = join(("127.0.0.1", port), world_size=1 + n_server_ranks, group_name="weight_update_group")
    names, dtypes, shapes = specs(params)   # what each server's update call is given
    broadcast(group, params)                # while each server runs that call
    destroy(group)

NCCL on GPUs, gloo on CPU (the backend is the one each server was given).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, PrefixStore, _new_process_group_helper, _world, rendezvous


def join(address: tuple[str, int], world_size: int, group_name: str = "weight_update_group",
         backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Rank 0 of group_name; returns once every server rank has joined (they call in at the same time)."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, size = next(rendezvous(f"tcp://{address[0]}:{address[1]}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(size, rank, [], dist.Backend(backend), PrefixStore(group_name, store),
                                         group_name=GroupName(group_name), backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group


def specs(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtypes ("bfloat16") and shapes, as a server's update call lists them."""
    return ([n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            [list(t.shape) for _, t in tensors])


def broadcast(group: dist.ProcessGroup, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Send each tensor from rank 0, in the order specs() listed them."""
    for _, t in tensors:
        dist.broadcast(t.detach().contiguous(), src=0, group=group)


def destroy(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)

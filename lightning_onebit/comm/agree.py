"""Small agreements the strategies and callbacks need across ranks: settings compared before the
first step, GradScaler's overflow flag, the auto phase switch's decision, the buffers' mean.

The layers above call torch.distributed only through comm; these are their collectives. Each is a
no-op in one process (or without an initialised default group): the value comes back as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .dense import group_size

__all__ = ["all_ranks", "gather_objects", "is_distributed", "max_across_", "sum_across_"]


def is_distributed() -> bool:
    """Whether torch.distributed is available and its default group initialised."""
    return dist.is_available() and dist.is_initialized()


def gather_objects(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process.
    Pickled both ways: for small things (settings), not tensors of any size."""
    if not is_distributed():
        return [obj]
    every: list[Any] = [None] * group_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def max_across_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In place: ``t`` <- its element-wise maximum over the ranks. Returns ``t``."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def sum_across_(t: torch.Tensor, group=None) -> torch.Tensor:
    """In place: ``t`` <- its sum over the ranks, in ``t``'s dtype (a division by the world size
    afterwards makes the mean; in fp64 it is exact for fp32 values). Returns ``t``."""
    if is_distributed():
        dist.all_reduce(t, group=group)
    return t


def all_ranks(flag: bool, group=None) -> bool:
    """True on every rank if ``flag`` is true on every rank, else False on every rank (the minimum
    of one int over the ranks): a decision that all ranks must take at the same step."""
    t = torch.tensor([1 if flag else 0])
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t[0])

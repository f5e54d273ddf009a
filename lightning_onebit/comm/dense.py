"""Full-precision collectives of the optimizers: the warm-up mean and small agreements.

The compressed optimizers call torch.distributed only through the comm layer; these are the
uncompressed calls beside :class:`~lightning_onebit.comm.CompressedAllreduce`. Each is a no-op
in one process (or without an initialised default group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .accounting import ByteCounter, ring_allreduce_bytes

__all__ = ["any_across", "group_size", "mean_allreduce", "mean_allreduce_future"]


def group_size(group=None) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def mean_allreduce(t: torch.Tensor, group=None, counter: ByteCounter | None = None) -> torch.Tensor:
    """In place: ``t`` <- the mean of ``t`` over the group, as DDP computes it (each rank divides
    by n, then the sum). Counted as an fp32 ring allreduce."""
    n = group_size(group)
    if n > 1:
        t.div_(n)
        dist.all_reduce(t, group=group)
        if counter is not None:
            counter.add(ring_allreduce_bytes(t.numel(), n, t.element_size()), t.numel(), n)
    return t


def mean_allreduce_future(t: torch.Tensor, group=None,
                          counter: ByteCounter | None = None) -> torch.futures.Future[torch.Tensor]:
    """:func:`mean_allreduce` started asynchronously (a DDP comm hook's return value)."""
    n = group_size(group)
    if n == 1:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(t)
        return fut
    t.div_(n)
    if counter is not None:
        counter.add(ring_allreduce_bytes(t.numel(), n, t.element_size()), t.numel(), n)
    return dist.all_reduce(t, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def any_across(flags: torch.Tensor, group=None, counter: ByteCounter | None = None) -> torch.Tensor:
    """Elementwise OR of a bool tensor over the group (a MAX allreduce of one byte per flag)."""
    n = group_size(group)
    if n == 1:
        return flags
    u8 = flags.to(torch.uint8)
    dist.all_reduce(u8, op=dist.ReduceOp.MAX, group=group)
    if counter is not None:
        counter.add(ring_allreduce_bytes(u8.numel(), n, 1), 0, n)
    return u8.bool()

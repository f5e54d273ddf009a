"""What an optimizer keeps in memory between steps, in bytes (``CommunicationMonitor``'s ``mem/`` figures,
``benchmarks/sharded.py``)."""

from __future__ import annotations

import torch

from ..comm.sharding import local

__all__ = ["state_bytes"]

#: how deep the walk follows containers and the package's objects (bucket -> its sync -> its collective ->
#: its pieces' buffers is four)
_DEPTH = 8


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor ``optimizer`` holds on this rank beyond the parameters and their gradients:
    ``state`` (moments, step counts), and what the package's optimizers keep besides (flat buckets, the
    collectives' error state and buffers, DiLoCo's anchor, outer momentum and scratch). Each storage counts
    once, whole; a DTensor counts its local shard. Walks the optimizer's attributes and the package's objects
    below them, not other libraries' objects."""
    skip: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in (local(p), local(p.grad)):
                if t is not None:
                    skip.add(t.untyped_storage().data_ptr())
    seen = set(skip)
    attrs = {k: v for k, v in vars(optimizer).items() if k not in ("param_groups", "defaults")}
    return _walk(dict(optimizer.state), seen, set(), 0) + _walk(attrs, seen, set(), 0)


def _walk(obj, seen: set[int], visited: set[int], depth: int) -> int:
    if depth > _DEPTH or obj is None or isinstance(obj, str | bytes | int | float | bool):
        return 0
    if isinstance(obj, torch.Tensor):
        t = local(obj)
        if t.device.type == "meta" or t.is_sparse:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()
    if id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, dict):
        return sum(_walk(v, seen, visited, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return sum(_walk(v, seen, visited, depth + 1) for v in obj)
    if type(obj).__module__.startswith("lightning_onebit.") and hasattr(obj, "__dict__"):
        return sum(_walk(v, seen, visited, depth + 1) for k, v in vars(obj).items() if k != "params")
    return 0

"""Flat buffers for state that the kernels stream every step.

On the CPU, a large buffer comes from numpy's allocator (wrapped by ``torch.from_numpy``, so it is
an ordinary tensor), which asks Linux for transparent huge pages (``madvise(MADV_HUGEPAGE)``, the
system default ``madvise`` mode); torch's own allocator does not, unless the process sets
``THP_MEM_ALLOC_ENABLE=1``. A compressed step streams four to six bucket-sized buffers at once,
and with 4 KiB pages their TLB misses slow the reductions down (``benchmarks/optimizer_step.py``
times the step; ``THP_MEM_ALLOC_ENABLE=1`` gives torch's buffers huge pages too, to compare).
Elsewhere (a GPU, a small buffer) it is ``torch.zeros``/``torch.empty``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["flat_buffer"]

_HUGE_FROM = 1 << 21  # bytes: below one huge page there is nothing to gain
_NP = {torch.float32: np.float32, torch.float64: np.float64, torch.uint8: np.uint8, torch.int64: np.int64}


def flat_buffer(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", *, zero: bool = True) -> torch.Tensor:
    """A contiguous buffer (zeros, or uninitialised with ``zero=False``) on huge pages where that helps."""
    device = torch.device(device)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or dtype not in _NP or nbytes < _HUGE_FROM:
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return torch.from_numpy((np.zeros if zero else np.empty)(shape, _NP[dtype]))

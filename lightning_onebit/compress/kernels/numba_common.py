"""Index arithmetic written once for both numba targets.

Plain Python functions over arrays and integers, which numba compiles twice: with ``njit`` into the
CPU kernels (:mod:`.numba_tiles`, :mod:`.numba_source`, :mod:`.numba_cpu`) and with
``cuda.jit(device=True)`` into the CUDA ones (:mod:`.numba_cuda_source`, :mod:`.numba_cuda_kernels`).
Nothing here may use what only one target has (numpy calls, ``cuda.*``), so that both backends
find the same blocks and combine the same partial sums, which their bit-identity rests on.
"""

from __future__ import annotations

import math

from .layout import MINMAX_U8

__all__ = ["combine_block", "first_at_least", "last_at_most"]


def last_at_most(a, pos):
    """The last j < a.size - 1 with a[j] <= pos (``a`` non-decreasing, its last entry an end): the
    block of a row that holds element ``pos`` from the row's block starts, or the group of a position
    from a source's group bounds (empty blocks before it are skipped: they start at or before it too)."""
    lo = 0
    hi = a.size - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[mid] <= pos:
            lo = mid
        else:
            hi = mid
    return lo


def first_at_least(a, v):
    """The first j with a[j] >= v in the sorted array ``a`` (``a.size`` if there is none)."""
    lo = 0
    hi = a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


def combine_block(kind, ptr, partials, totals, b):
    """Block b's totals from its tiles' partials ``partials[ptr[b]:ptr[b + 1]]``, tiles in order (the
    layout's summation order): the sum, or (min, max, sum of the finiteness probes)."""
    if kind >= MINMAX_U8:
        mn = math.inf
        mx = -math.inf
        probe = 0.0
        for t in range(ptr[b], ptr[b + 1]):
            mn = min(mn, partials[t, 0])
            mx = max(mx, partials[t, 1])
            probe += partials[t, 2]
        totals[b, 0] = mn
        totals[b, 1] = mx
        totals[b, 2] = probe
    else:
        acc = 0.0
        for t in range(ptr[b], ptr[b + 1]):
            acc += partials[t, 0]
        totals[b, 0] = acc

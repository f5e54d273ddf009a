"""The per-tile arithmetic of the numba CPU backend: scale sums, sign and min-max codes, decoding.

Every function here works on one tile (a few thousand elements of one row, or of one scale
block) and is inlined into the parallel kernels of :mod:`.numba_cpu`. Loops run over slices from
index 0 in fixed-size chunks (``CH`` elements): with a provably non-negative index numba drops the
negative-index wraparound and LLVM vectorises, and each chunk prefetches the data ``PF`` elements
ahead (see :mod:`.numba_intrinsics`). The value encoded is ``v = xs + a * ss`` with ``a`` in
{0, 1, -1} (plain / error feedback / Markov), exact for every mode.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .layout import ERROR_FEEDBACK, KIND_BITS, KIND_PER_BYTE, MARKOV, REDUCE_LANES, SIGN_L2
from .numba_common import last_at_most
from .numba_intrinsics import prefetch

LANES = REDUCE_LANES
CH = 32  # elements per vectorised chunk: two 64-byte cache lines of fp32
PF = 1024  # prefetch distance in elements (4 KiB of fp32 per stream)
MM_LANES = 16  # independent min/max lanes: LLVM vectorises these, not a scalar min reduction
TILE = 8192  # elements per encode/decode work item; a multiple of 8 so tiles start on a code byte
_F32 = np.float32


@njit(inline="always", cache=True)
def ahead(arr, i):
    """Prefetch the two cache lines of ``arr`` that a chunk ``PF`` elements after ``i`` reads."""
    prefetch(arr, i + PF)
    prefetch(arr, i + PF + 16)


@njit(inline="always", cache=True)
def tile_span(t, per_row, seg_len):
    """Row and element range [lo, hi) of work item ``t`` (``per_row`` tiles of TILE per row)."""
    r = t // per_row
    lo = (t - r * per_row) * TILE
    return r, lo, min(lo + TILE, seg_len)


# --- scale reductions ---------------------------------------------------------------------


@njit(inline="always", cache=True)
def _lanes_chunk(kind, a, xc, sc, acc):
    if kind == SIGN_L2:  # v * v is exact in fp64 (v is fp32): no rounding to fuse or reorder
        for j in range(LANES):
            v = np.float64(xc[j] + a * sc[j])
            acc[j] += v * v
    else:
        for j in range(LANES):
            acc[j] += abs(np.float64(xc[j] + a * sc[j]))


@njit(inline="always", cache=True)
def lanes_add(kind, a, xs, ss, acc):
    """Add v^2 (SIGN_L2) or |v| of elements i of xs, ss to lane i % LANES of ``acc`` (fp64), in order:
    a tile's canonical sum (see layout.REDUCE_*) accumulated over consecutive pieces of it, each
    piece but the last a multiple of LANES long."""
    n = xs.size
    one = np.float32(1.0)
    for c in range(n // LANES):
        o = c * LANES
        ahead(ss, o)
        # a constant a (error feedback's 1 above all) lets LLVM drop the multiply
        if a == one:
            _lanes_chunk(kind, one, xs[o:o + LANES], ss[o:o + LANES], acc)
        else:
            _lanes_chunk(kind, a, xs[o:o + LANES], ss[o:o + LANES], acc)
    m = n - n % LANES
    for j in range(n - m):
        v = np.float64(xs[m + j] + a * ss[m + j])
        acc[j] += v * v if kind == SIGN_L2 else abs(v)


@njit(inline="always", cache=True)
def lanes_add_plain(kind, xs, acc):
    """:func:`lanes_add` of v = xs (no state). A separate loop, not ``lanes_add(kind, 0, xs, xs)``:
    LLVM would merge the two copies into one loop over either array, which it does not vectorise."""
    n = xs.size
    for c in range(n // LANES):
        o = c * LANES
        ahead(xs, o)
        xc = xs[o:o + LANES]
        if kind == SIGN_L2:
            for j in range(LANES):
                v = np.float64(xc[j])
                acc[j] += v * v
        else:
            for j in range(LANES):
                acc[j] += abs(np.float64(xc[j]))
    m = n - n % LANES
    for j in range(n - m):
        v = np.float64(xs[m + j])
        acc[j] += v * v if kind == SIGN_L2 else abs(v)


@njit(inline="always", cache=True)
def lanes_total(acc):
    """The lanes combined by the canonical halving tree (``acc`` is overwritten)."""
    h = LANES // 2
    while h > 0:
        for j in range(h):
            acc[j] += acc[j + h]
        h //= 2
    return acc[0]


@njit(inline="always", cache=True)
def minmax_add(a, xs, ss, mn, mx, probe):
    """Fold the min, max and finiteness probe of v over xs, ss into the lanes mn, mx, probe (exact
    in any order; the probe only tells NaN from not)."""
    m = xs.size - xs.size % MM_LANES
    for c in range(m // MM_LANES):
        o = c * MM_LANES
        ahead(ss, o)
        xc, sc = xs[o:o + MM_LANES], ss[o:o + MM_LANES]
        for j in range(MM_LANES):
            v = xc[j] + a * sc[j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            probe[j] += v * np.float32(0.0)  # NaN iff some v is NaN or inf
    for i in range(m, xs.size):
        v = xs[i] + a * ss[i]
        mn[0] = v if v < mn[0] else mn[0]
        mx[0] = v if v > mx[0] else mx[0]
        probe[0] += v * np.float32(0.0)


@njit(inline="always", cache=True)
def minmax_add_plain(xs, mn, mx, probe):
    """:func:`minmax_add` of v = xs (no state; a loop of its own, see :func:`lanes_add_plain`)."""
    m = xs.size - xs.size % MM_LANES
    for c in range(m // MM_LANES):
        o = c * MM_LANES
        ahead(xs, o)
        xc = xs[o:o + MM_LANES]
        for j in range(MM_LANES):
            v = xc[j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            probe[j] += v * np.float32(0.0)
    for i in range(m, xs.size):
        v = xs[i]
        mn[0] = v if v < mn[0] else mn[0]
        mx[0] = v if v > mx[0] else mx[0]
        probe[0] += v * np.float32(0.0)


# --- block walk ---------------------------------------------------------------------------------

#: The block of a row that holds element ``pos``: ``block_at(starts_r, pos)`` (see :func:`.numba_common.last_at_most`)
block_at = njit(inline="always", cache=True)(last_at_most)


# --- encode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def sign_bits_run(mode, a, xs, ss, s, bits):
    """A run of elements that share the scale s: their signs (v = xs + a*ss >= 0 -> 1) into ``bits``
    (a uint8 each) and their state in the same loop (EF: ss = v - dec; Markov: ss += dec; plain and
    diff: none). One loop reads and writes the state: reading it in one pass and writing it in
    another let a parallel kernel compute codes from the updated state."""
    n = xs.size
    if mode == ERROR_FEEDBACK:
        for c in range(n // CH):
            o = c * CH
            ahead(xs, o)
            ahead(ss, o)
            xc, sc, bc = xs[o:o + CH], ss[o:o + CH], bits[o:o + CH]
            for j in range(CH):
                v = xc[j] + sc[j]
                pos = v >= 0
                bc[j] = pos
                sc[j] = v - s if pos else v + s
        for i in range(n - n % CH, n):
            v = xs[i] + ss[i]
            pos = v >= 0
            bits[i] = pos
            ss[i] = v - s if pos else v + s
    elif mode == MARKOV:
        for i in range(n):
            pos = xs[i] - ss[i] >= 0
            bits[i] = pos
            ss[i] += s if pos else -s
    else:
        for i in range(n):
            bits[i] = xs[i] + a * ss[i] >= 0


@njit(inline="always", cache=True)
def sign_bits_plain(xs, bits):
    """The signs of xs (no state) into ``bits`` (a loop of its own, see :func:`lanes_add_plain`)."""
    n = xs.size
    for c in range(n // CH):
        o = c * CH
        ahead(xs, o)
        xc, bc = xs[o:o + CH], bits[o:o + CH]
        for j in range(CH):
            bc[j] = xc[j] >= 0
    for i in range(n - n % CH, n):
        bits[i] = xs[i] >= 0


@njit(inline="always", cache=True)
def pack_bits(bits, n, cs):
    """Pack bits[0:n] (uint8 0/1) into the bytes cs, little-endian within a byte."""
    for k in range(n >> 3):
        bk = bits[8 * k:8 * k + 8]
        byte = np.uint8(0)
        for j in range(8):
            byte |= bk[j] << np.uint8(j)
        cs[k] = byte
    if n & 7:
        byte = np.uint8(0)
        for i in range(n & ~7, n):
            byte |= bits[i] << np.uint8(i & 7)
        cs[n >> 3] = byte


@njit(inline="always", cache=True)
def pack_codes(qs, n, kind, cs):
    """Pack the codes qs[0:n] (uint8, each at most the kind's top code) into the bytes cs, element i
    at bit (i * bits) % 8 of byte i * bits // 8, as :func:`pack_bits` packs signs."""
    bits = KIND_BITS[kind]
    per = KIND_PER_BYTE[kind]
    full = n // per
    for k in range(full):
        byte = np.uint8(0)
        for j in range(per):
            byte |= qs[per * k + j] << np.uint8(bits * j)
        cs[k] = byte
    if n > full * per:
        byte = np.uint8(0)
        for i in range(full * per, n):
            byte |= qs[i] << np.uint8(bits * (i - full * per))
        cs[full] = byte


@njit(inline="always", cache=True)
def minmax_run_plain(xs, cs, sc0, sc1, top):
    """:func:`minmax_run` of v = xs, no state (a loop of its own, see :func:`lanes_add_plain`)."""
    smin = np.float64(sc0)
    rng = np.float64(sc1) - smin
    inv = top / rng if rng > 0 else 0.0
    for i in range(xs.size):
        cs[i] = np.uint8(min(max(np.rint((np.float64(xs[i]) - smin) * inv), 0.0), top))


@njit(inline="always", cache=True)
def minmax_run(mode, a, xs, ss, cs, sc0, sc1, top):
    """Min-max codes (one uint8 each, ``top`` the kind's largest, a float) of a run of elements that
    share the scales (sc0, sc1) into ``cs``, and their state in the same loop (see sign_bits_run)."""
    smin = np.float64(sc0)
    rng = np.float64(sc1) - smin
    inv = top / rng if rng > 0 else 0.0
    step = rng / top
    for i in range(xs.size):
        v = xs[i] + a * ss[i]
        q = min(max(np.rint((np.float64(v) - smin) * inv), 0.0), top)
        cs[i] = np.uint8(q)
        dec = _F32(smin + q * step)
        if mode == ERROR_FEEDBACK:
            ss[i] = v - dec
        elif mode == MARKOV:
            ss[i] += dec

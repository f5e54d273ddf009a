"""The two passes of every encode in the numba CPU backend: the scale reduction, then the encode.

Reductions follow the summation order defined in :mod:`.layout` (tiles of ``REDUCE_TILE`` from
each block's start, ``REDUCE_LANES`` lanes, a halving tree, tiles added in order), which the
CUDA backend follows too: a scale does not depend on how many threads numba runs or on the
machine, which keeps the simulated cluster bit-identical to real ranks and a resumed run
identical to an uninterrupted one.

Encode works on byte-aligned tiles of a row and walks the scale blocks that meet the tile, so a
block may start anywhere (inside a code byte): the sign codes of a tile do not depend on its
scales, and the state update and the decoded values use each block's own.

Both read their input, a tensor or a payload :class:`~..source.Source` (or the server stage's mean
of the workers' rows), through :func:`.numba_source.fill`, per piece of ``SUB`` elements into a
cache-resident scratch buffer: the payload and the mean are never written to memory. The per-tile
arithmetic is in :mod:`.numba_tiles`; the torch-facing wrappers are in :mod:`.numba_cpu`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .layout import KIND_BITS
from .numba_common import combine_block
from .numba_decode import mm_top
from .numba_source import SCRATCH
from .numba_source import fill as _fill
from .numba_tiles import (
    LANES,
    MM_LANES,
    TILE,
    block_at,
    lanes_add,
    lanes_add_plain,
    lanes_total,
    minmax_add,
    minmax_add_plain,
    minmax_run,
    minmax_run_plain,
    pack_bits,
    pack_codes,
    sign_bits_plain,
    sign_bits_run,
    tile_span,
)
from .threads import parallel_and_serial, variant

__all__ = ["BATCH", "SUB"]

BATCH = 16  # reduction tiles per parallel work item
SUB = 512  # elements a source is evaluated in at a time: two KiB, which stay in the L1 cache


# --- reduction ----------------------------------------------------------------------------------


# The reduction comes in a sign and a min-max version, and both passes run their tile loops in a
# copy with the state and a copy without, chosen once per work item: a branch on the codec kind, or
# on the state, inside the loops keeps LLVM from vectorising them (``benchmarks/codecs.py`` times
# the kernels). The tile loops are functions of their own, called once per tile: the parallel and
# the serial kernel share one compiled copy (inlined, they made each kernel's compile much longer).


@njit(cache=True)
def _sum_tiles(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out, t0, t1, acc, buf):
    for t in range(t0, t1):
        pos = t_row[t] * seg_len + t_lo[t]
        n = t_hi[t] - t_lo[t]
        acc[:] = 0.0
        for o in range(0, n, SUB):  # the source in cache-sized pieces (SUB: a multiple of LANES)
            k = min(SUB, n - o)
            xs = _fill(src, rws, kind, pos + o, k, buf)
            if st is None:
                lanes_add_plain(kind, xs, acc)
            else:
                lanes_add(kind, a, xs, st[pos + o : pos + o + k], acc)
        out[t, 0] = lanes_total(acc)


@parallel_and_serial
def _reduce_sign(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out):
    # work items of BATCH tiles share their scratch arrays: small blocks make many small tiles
    for bt in prange((t_row.size + BATCH - 1) // BATCH):
        acc = np.empty(LANES, np.float64)
        buf = np.empty(SUB + SCRATCH, np.float32)
        t0, t1 = bt * BATCH, min((bt + 1) * BATCH, t_row.size)
        if st.size:
            _sum_tiles(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out, t0, t1, acc, buf)
        else:
            _sum_tiles(kind, a, src, rws, None, seg_len, t_row, t_lo, t_hi, out, t0, t1, acc, buf)


@njit(cache=True)
def _minmax_tiles(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out, t0, t1, mn, mx, probe, buf):
    for t in range(t0, t1):
        pos = t_row[t] * seg_len + t_lo[t]
        n = t_hi[t] - t_lo[t]
        mn[:] = np.inf
        mx[:] = -np.inf
        probe[:] = 0.0
        for o in range(0, n, SUB):
            k = min(SUB, n - o)
            xs = _fill(src, rws, kind, pos + o, k, buf)
            if st is None:
                minmax_add_plain(xs, mn, mx, probe)
            else:
                minmax_add(a, xs, st[pos + o : pos + o + k], mn, mx, probe)
        out[t, 0] = mn.min()
        out[t, 1] = mx.max()
        out[t, 2] = probe.sum()


@parallel_and_serial
def _reduce_minmax(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out):
    for bt in prange((t_row.size + BATCH - 1) // BATCH):
        mn = np.empty(MM_LANES, np.float32)
        mx = np.empty(MM_LANES, np.float32)
        probe = np.empty(MM_LANES, np.float32)
        buf = np.empty(SUB + SCRATCH, np.float32)
        t0, t1 = bt * BATCH, min((bt + 1) * BATCH, t_row.size)
        if st.size:
            _minmax_tiles(kind, a, src, rws, st, seg_len, t_row, t_lo, t_hi, out, t0, t1, mn, mx, probe, buf)
        else:
            _minmax_tiles(kind, a, src, rws, None, seg_len, t_row, t_lo, t_hi, out, t0, t1, mn, mx, probe, buf)


_combine_block = njit(inline="always", cache=True)(combine_block)


@parallel_and_serial
def _combine(kind, ptr, partials, totals):
    """Per-block totals from the tile partials, tiles in order (minmax: min, max, probe sum)."""
    for b in prange(ptr.size - 1):
        _combine_block(kind, ptr, partials, totals, b)


# --- encode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _encode_sign_piece(kind, mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, bits):
    """Sign codes of elements [lo, hi) of row r (a piece that starts on a code byte) and the state
    of each scale block's run; padding (from ends[r]) decodes to 0, so its state stays (zero)."""
    nb = starts.shape[1] - 1
    end = max(lo, min(hi, ends[r]))
    if ss is None:
        sign_bits_plain(xs, bits)
    else:
        j = block_at(starts[r], lo)
        while j < nb and starts[r, j] < end:
            p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
            if q > p:
                sign_bits_run(mode, a, xs[p - lo:q - lo], ss[p - lo:q - lo], scales[r * nb + j], bits[p - lo:q - lo])
            j += 1
        for i in range(end - lo, hi - lo):
            bits[i] = xs[i] + a * ss[i] >= 0
    pack_bits(bits, hi - lo, codes[r, lo >> 3:(hi + 7) >> 3])


@njit(inline="always", cache=True)
def _encode_minmax_piece(kind, mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, qs):
    """Min-max codes of elements [lo, hi) of row r (a piece that starts on a code byte) and the state.
    8-bit codes go straight to the row; narrower ones to ``qs`` (a uint8 each), then packed."""
    nb = starts.shape[1] - 1
    j = block_at(starts[r], lo)
    end = min(hi, ends[r])
    top = mm_top(kind)
    direct = KIND_BITS[kind] == 8
    while j < nb and starts[r, j] < end:
        p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
        if q > p:
            g = r * nb + j
            sc0, sc1 = scales[2 * g], scales[2 * g + 1]
            if direct:
                if ss is None:
                    minmax_run_plain(xs[p - lo : q - lo], codes[r, p:q], sc0, sc1, top)
                else:
                    minmax_run(mode, a, xs[p - lo : q - lo], ss[p - lo : q - lo], codes[r, p:q], sc0, sc1, top)
            elif ss is None:
                minmax_run_plain(xs[p - lo : q - lo], qs[p - lo : q - lo], sc0, sc1, top)
            else:
                minmax_run(mode, a, xs[p - lo : q - lo], ss[p - lo : q - lo], qs[p - lo : q - lo], sc0, sc1, top)
        j += 1
    if direct:
        if end < hi:
            codes[r, max(end, lo) : hi] = 0  # padding: defined bytes on the wire (sign codes: +1)
    else:
        if end < hi:
            qs[max(end, lo) - lo : hi - lo] = 0
        bits = KIND_BITS[kind]
        pack_codes(qs, hi - lo, kind, codes[r, (lo * bits) >> 3 : (hi * bits + 7) >> 3])


def _encode_tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf, qs):
    """Codes and state of elements [t_lo, t_hi) of row r: the source in cache-sized pieces that start
    on a code byte (SUB: a multiple of 8), each encoded by the variant's ``_piece``."""
    base = r * seg_len
    for lo in range(t_lo, t_hi, SUB):
        hi = min(lo + SUB, t_hi)
        xs = _fill(src, rws, kind, base + lo, hi - lo, buf)
        ss = None if st is None else st[base + lo : base + hi]
        _piece(kind, mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, qs)


def _encode(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes):
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(starts.shape[0] * per_row):
        r, t_lo, t_hi = tile_span(t, per_row, seg_len)
        buf = np.empty(SUB + SCRATCH, np.float32)
        qs = np.empty(SUB, np.uint8)  # a piece's sign bits or narrow min-max codes, before packing
        if st.size:
            _tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf, qs)
        else:
            _tile(kind, mode, a, src, rws, None, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf, qs)


# One encode source, a kernel per family of codes (sign, min-max), each with only its own pieces
# inlined: a fit compiles the encode of the codes it sends, not of every kind.
_piece = _tile = None  # bound in each variant
_encode_sign_tile = njit(cache=True)(variant(_encode_tile, "_encode_sign_tile", _piece=_encode_sign_piece))
_encode_minmax_tile = njit(cache=True)(variant(_encode_tile, "_encode_minmax_tile", _piece=_encode_minmax_piece))
_encode_sign = parallel_and_serial(variant(_encode, "_encode_sign", _tile=_encode_sign_tile))
_encode_minmax = parallel_and_serial(variant(_encode, "_encode_minmax", _tile=_encode_minmax_tile))

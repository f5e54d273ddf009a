"""Numba CPU backend: ``njit(parallel=True)`` kernels over fixed-size tiles.

Reductions follow the summation order defined in :mod:`.layout` (tiles of ``REDUCE_TILE`` from
each block's start, ``REDUCE_LANES`` lanes, a halving tree, tiles added in order), which the
CUDA backend follows too: a scale does not depend on how many threads numba runs or on the
machine, which keeps the simulated cluster bit-identical to real ranks and a resumed run
identical to an uninterrupted one. Every entry point runs under :func:`.threads.parallel_kernel`
(the per-rank thread budget; torch's thread count left alone).

Encode and decode work on byte-aligned tiles of a row and walk the scale blocks that meet the
tile, so a block may start anywhere (inside a code byte): the sign codes of a tile do not
depend on its scales, and the state update and the decoded values use each block's own.

The input of ``reduce`` and ``encode`` is a tensor or a payload :class:`~..source.Source`,
evaluated per tile into a cache-resident scratch buffer (:mod:`.numba_source`), and the server
stage reads the mean of the workers' rows the same way (``rows=``): the payload and the mean are
never written to memory. The per-tile arithmetic is in :mod:`.numba_tiles`.

Each op is one compiled function for all codec kinds, modes and sources (small integer
arguments, loop-invariant branches), so numba compiles a handful of functions once and caches
them on disk instead of one per combination.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ..source import Source
from .layout import DIFF, ERROR_FEEDBACK, MARKOV, MINMAX_U4, MINMAX_U8, PLAIN, REDUCE_TILE, Layout, is_sign
from .numba_decode import decode_run, mean_run, mm_top
from .numba_source import NO_ROWS, SCRATCH, mean_of_rows, pack
from .numba_source import apply_sink as _apply_sink
from .numba_source import fill as _fill
from .numba_source import pack_sink as _pack_sink
from .numba_source import readable as _readable
from .numba_source import rows as _rows_tuple
from .numba_source import sink_readable as _sink_readable
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
from .threads import parallel_and_serial, parallel_kernel

BATCH = 16  # reduction tiles per parallel work item
SUB = 512  # elements a source is evaluated in at a time: two KiB, which stay in the L1 cache
_F32 = np.float32
#: ``reduce``/``encode`` evaluate a :class:`~..source.Source` and the rows' mean (``rows=``) in place
FUSES_SOURCES = True


# --- reduction ----------------------------------------------------------------------------------


# The kernels come in a sign and a min-max version, and run their tile loops in a copy with the
# state and a copy without, chosen once per work item: a branch on the codec kind, or on the state,
# inside the loops keeps LLVM from vectorising them (14.1 against 17.9 and 18.9 ms for a reduction
# of 17M elements). The tile loops are functions of their own, called once per tile: the parallel
# and the serial kernel share one compiled copy (numba's inlining made each kernel take ~20 s).


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


@parallel_and_serial
def _combine(kind, ptr, partials, totals):
    """Per-block totals from the tile partials, tiles in order (minmax: min, max, probe sum)."""
    for b in prange(ptr.size - 1):
        if kind >= MINMAX_U8:
            mn, mx, probe = np.inf, -np.inf, 0.0
            for t in range(ptr[b], ptr[b + 1]):
                mn = min(mn, partials[t, 0])
                mx = max(mx, partials[t, 1])
                probe += partials[t, 2]
            totals[b, 0], totals[b, 1], totals[b, 2] = mn, mx, probe
        else:
            acc = 0.0
            for t in range(ptr[b], ptr[b + 1]):
                acc += partials[t, 0]
            totals[b, 0] = acc


# --- encode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _encode_sign_piece(mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, bits):
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
    8-bit codes go straight to the row; 4- and 2-bit ones to ``qs`` (a uint8 each), then packed."""
    nb = starts.shape[1] - 1
    j = block_at(starts[r], lo)
    end = min(hi, ends[r])
    top = mm_top(kind)
    while j < nb and starts[r, j] < end:
        p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
        if q > p:
            g = r * nb + j
            sc0, sc1 = scales[2 * g], scales[2 * g + 1]
            if kind == MINMAX_U8:
                if ss is None:
                    minmax_run_plain(xs[p - lo : q - lo], codes[r, p:q], sc0, sc1, top)
                else:
                    minmax_run(mode, a, xs[p - lo : q - lo], ss[p - lo : q - lo], codes[r, p:q], sc0, sc1, top)
            elif ss is None:
                minmax_run_plain(xs[p - lo : q - lo], qs[p - lo : q - lo], sc0, sc1, top)
            else:
                minmax_run(mode, a, xs[p - lo : q - lo], ss[p - lo : q - lo], qs[p - lo : q - lo], sc0, sc1, top)
        j += 1
    if kind == MINMAX_U8:
        if end < hi:
            codes[r, max(end, lo) : hi] = 0  # padding: defined bytes on the wire (sign codes: +1)
    else:
        if end < hi:
            qs[max(end, lo) - lo : hi - lo] = 0
        bits = 4 if kind == MINMAX_U4 else 2
        pack_codes(qs, hi - lo, bits, codes[r, (lo * bits) >> 3 : (hi * bits + 7) >> 3])


@njit(cache=True)
def _encode_sign_tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf, bits):
    base = r * seg_len
    for lo in range(t_lo, t_hi, SUB):  # the source in cache-sized pieces that start on a code byte
        hi = min(lo + SUB, t_hi)
        xs = _fill(src, rws, kind, base + lo, hi - lo, buf)
        ss = None if st is None else st[base + lo:base + hi]
        _encode_sign_piece(mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, bits)


@parallel_and_serial
def _encode_sign(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes):
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(starts.shape[0] * per_row):
        r, t_lo, t_hi = tile_span(t, per_row, seg_len)
        buf = np.empty(SUB + SCRATCH, np.float32)
        bits = np.empty(SUB, np.uint8)
        if st.size:
            _encode_sign_tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf,
                              bits)
        else:
            _encode_sign_tile(kind, mode, a, src, rws, None, seg_len, starts, ends, scales, codes, r, t_lo, t_hi,
                              buf, bits)


@njit(cache=True)
def _encode_minmax_tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf, qs):
    base = r * seg_len
    for lo in range(t_lo, t_hi, SUB):  # pieces start on a code byte (SUB: a multiple of 8)
        hi = min(lo + SUB, t_hi)
        xs = _fill(src, rws, kind, base + lo, hi - lo, buf)
        ss = None if st is None else st[base + lo : base + hi]
        _encode_minmax_piece(kind, mode, a, xs, ss, r, lo, hi, starts, ends, scales, codes, qs)


@parallel_and_serial
def _encode_minmax(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes):
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(starts.shape[0] * per_row):
        r, t_lo, t_hi = tile_span(t, per_row, seg_len)
        buf = np.empty(SUB + SCRATCH, np.float32)
        qs = np.empty(SUB, np.uint8)
        if st.size:
            _encode_minmax_tile(kind, mode, a, src, rws, st, seg_len, starts, ends, scales, codes, r, t_lo, t_hi, buf,
                                qs)
        else:
            _encode_minmax_tile(kind, mode, a, src, rws, None, seg_len, starts, ends, scales, codes, r, t_lo, t_hi,
                                buf, qs)


# --- decode -------------------------------------------------------------------------------------


@parallel_and_serial
def _decode_rows(kind, codes, scales, seg_len, starts, ends, out, accumulate, snk):
    nseg, nb = starts.shape[0], starts.shape[1] - 1
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(nseg * per_row):
        r, lo, hi = tile_span(t, per_row, seg_len)
        dst = out[r * seg_len + lo : r * seg_len + hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        end = max(lo, min(hi, ends[r]))
        j = block_at(starts[r], lo)
        while j < nb and starts[r, j] < end:
            p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
            if q > p:
                decode_run(kind, codes[r], scales[r], j, p, q, buf[p - lo : q - lo])
            j += 1
        buf[end - lo :] = 0.0  # padding
        if accumulate:
            for i in range(dst.size):
                dst[i] += buf[i]
        elif snk[7]:  # a sink: the decoded tile is still in the cache
            _apply_sink(snk, r * seg_len + lo, dst)


@parallel_and_serial
def _decode_mean(kind, codes, scales, seg_len, starts_r, end_r, out, accumulate):
    nb = starts_r.size - 1
    for t in prange((seg_len + TILE - 1) // TILE):
        lo = t * TILE
        hi = min(lo + TILE, seg_len)
        dst = out[lo:hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        lut = np.empty(SCRATCH, np.float32)
        end = max(lo, min(hi, end_r))
        j = block_at(starts_r, lo)
        while j < nb and starts_r[j] < end:
            p, q = max(lo, starts_r[j]), min(end, starts_r[j + 1])
            if q > p:
                mean_run(kind, codes, scales, j, p, q, buf[p - lo : q - lo], lut)
            j += 1
        buf[end - lo :] = 0.0  # padding
        if accumulate:
            for i in range(dst.size):
                dst[i] += buf[i]


# --- mean of full-precision rows (a node's shards in the two-level collective) ---------


@parallel_and_serial
def _mean_rows(x, out):
    """out[i] = fp32((x[0, i] + x[1, i] + ...) / L), summed in fp64 in row order: the same bits as
    the torch formulation, in one pass over memory. Row-major loops over a tile so LLVM vectorises
    the adds and the divide (a per-element scalar fp64 divide alone costs ~50 ms at 12.5M)."""
    nrows, n = x.shape
    for t in prange((n + TILE - 1) // TILE):
        lo = t * TILE
        m = min(lo + TILE, n) - lo
        acc = np.empty(m, np.float64)
        x0 = x[0, lo:lo + m]
        for i in range(m):
            acc[i] = x0[i]
        for r in range(1, nrows):
            xr = x[r, lo:lo + m]
            for i in range(m):
                acc[i] += xr[i]
        o = out[lo:lo + m]
        for i in range(m):
            o[i] = np.float32(acc[i] / nrows)


# --- torch-facing wrappers ------------------------------------------------------------


def _rows(codes: torch.Tensor) -> np.ndarray:
    """Codes as a C-contiguous 2-D array. Codes that are row views into a packed buffer
    (``[codes | scales]`` rows) are widened to the full row stride: numba types slices of
    a C array as contiguous and vectorises them, slices of a strided view it does not."""
    if codes.is_contiguous() or codes.dim() != 2 or codes.stride(1) != 1:
        return codes.numpy() if codes.is_contiguous() else codes.contiguous().numpy()
    n, stride = codes.shape[0], codes.stride(0)
    return torch.as_strided(codes, (n, stride), (stride, 1)).numpy()


def _scales2d(scales: torch.Tensor, nrows: int) -> np.ndarray:
    # scales of a pipeline piece are a view into a packed row: a few bytes, copied so numba sees a C array
    return scales.reshape(nrows, -1).contiguous().numpy()


def _mode_factor(mode: int) -> np.float32:
    return np.float32({PLAIN: 0.0, ERROR_FEEDBACK: 1.0, MARKOV: -1.0, DIFF: -1.0}[mode])


class RowsMean:
    """The server stage's input: the mean over the rows of ``messages`` (an Encoded whose rows are
    cut alike), read by ``reduce`` and ``encode`` tile by tile instead of from a buffer."""

    def __init__(self, messages) -> None:
        self.messages = messages
        self.device = messages.codes.device

    def numel(self) -> int:
        return self.messages.seg_len

    def packed(self) -> tuple[tuple, tuple]:
        m = self.messages
        lay = m.layout
        # a writable copy of the (read-only) starts: numba would compile every kernel again for the
        # read-only array type
        return mean_of_rows(), _rows_tuple(_rows(m.codes), _scales2d(m.scales, m.codes.shape[0]),
                                           np.array(lay.starts[0], np.int64), int(lay.data_ends[0]))


def accepts(x) -> bool:
    """Whether ``reduce``/``encode`` read ``x`` where it is (else the caller materialises it)."""
    return not isinstance(x, Source) or _readable(x)


def _source(x, st) -> tuple[tuple, tuple, np.ndarray]:
    """(source tuple, rows tuple, state array) for the kernels; the state is empty without one."""
    if isinstance(x, RowsMean):
        src, rws = x.packed()
    else:
        src, rws = pack(x), NO_ROWS
    return src, rws, (np.zeros(0, np.float32) if st is None else st.numpy())


@parallel_kernel
def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    t_row, t_lo, t_hi, ptr = layout.reduce_tiles(REDUCE_TILE)
    width = 1 if is_sign(kind) else 3
    partials = np.empty((t_row.size, width), np.float64)
    src, rws, sa = _source(x, st)
    n = layout.nseg * layout.seg_len
    kernel = _reduce_sign if is_sign(kind) else _reduce_minmax
    kernel(n, kind, _mode_factor(mode), src, rws, sa, layout.seg_len, t_row, t_lo, t_hi, partials)
    totals = np.empty((layout.nblocks, width), np.float64)
    _combine(t_row.size * 64, kind, ptr, partials, totals)  # a few tiles per block: parallel only for many
    return torch.from_numpy(totals)


@parallel_kernel
def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    src, rws, sa = _source(x, st)
    kernel = _encode_sign if is_sign(kind) else _encode_minmax
    kernel(layout.nseg * layout.seg_len, kind, mode, _mode_factor(mode), src, rws, sa, layout.seg_len, layout.starts,
           layout.data_ends, scales.reshape(-1).contiguous().numpy(), _rows(codes))


def accepts_sink(sink) -> bool:
    """Whether ``decode`` applies ``sink`` in its pass (see :class:`~..source.Sink`)."""
    return _sink_readable(sink)


@parallel_kernel
def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False,
           sink=None) -> None:
    mc, ms = _rows(codes), _scales2d(scales, codes.shape[0])
    n = codes.shape[0] * layout.seg_len
    if mean_rows:
        _decode_mean(n, kind, mc, ms, layout.seg_len, layout.starts[0], layout.data_ends[0], out.numpy(), accumulate)
    else:
        _decode_rows(n, kind, mc, ms, layout.seg_len, layout.starts, layout.data_ends, out.numpy(), accumulate,
                     _pack_sink(sink))


@parallel_kernel
def mean_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the fp32 mean of the rows of the 2-D fp32 ``x`` (fp64 sum in row order, / rows)."""
    _mean_rows(x.numel(), x.numpy(), out.numpy())


__all__ = ["FUSES_SOURCES", "RowsMean", "accepts", "accepts_sink", "decode", "encode", "mean_rows", "reduce"]

"""Numba CPU backend: ``njit(parallel=True)`` kernels over fixed-size tiles, behind torch-facing wrappers.

The scale reduction and the encode (the two passes of every encode op) are in :mod:`.numba_encode`;
this module holds the decode kernels (one row per message row, or the mean of the rows), the mean
of full-precision rows, and the wrappers the codecs call. Every entry point runs under
:func:`.threads.parallel_kernel` (the per-rank thread budget; torch's thread count left alone).

The input of ``reduce`` and ``encode`` is a tensor or a payload :class:`~..source.Source`,
evaluated per tile into a cache-resident scratch buffer (:mod:`.numba_source`), and the server
stage reads the mean of the workers' rows the same way (``rows=``): the payload and the mean are
never written to memory. ``decode`` applies a :class:`~..source.Sink` to each decoded tile while
it is in the cache.

Each op is one compiled function for all codec kinds, modes and sources (small integer
arguments, loop-invariant branches), so numba compiles a handful of functions once and caches
them on disk instead of one per combination.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from ..source import Source
from .layout import DIFF, ERROR_FEEDBACK, FORMATS, MARKOV, PLAIN, REDUCE_TILE, Layout, is_sign
from .numba_decode import decode_run, rows_mean
from .numba_encode import BATCH as BATCH  # the reduction and encode kernels moved there
from .numba_encode import SUB as SUB
from .numba_encode import _combine, _encode_minmax, _encode_sign, _reduce_minmax, _reduce_sign
from .numba_source import NO_ROWS, SCRATCH, mean_of_rows, pack
from .numba_source import apply_sink as _apply_sink
from .numba_source import pack_sink as _pack_sink
from .numba_source import readable as _readable
from .numba_source import rows as _rows_tuple
from .numba_source import sink_readable as _sink_readable
from .numba_tiles import TILE, block_at, tile_span
from .threads import parallel_and_serial, parallel_kernel

#: ``reduce``/``encode`` evaluate a :class:`~..source.Source` and the rows' mean (``rows=``) in place
FUSES_SOURCES = True
#: a Source's per-tensor ends are read where they are, through their addresses (numba_source.pack)
READS_ENDS_IN_PLACE = True


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
    for t in prange((seg_len + TILE - 1) // TILE):
        lo = t * TILE
        hi = min(lo + TILE, seg_len)
        dst = out[lo:hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        rows_mean(kind, codes, scales, starts_r, end_r, lo, hi, buf, np.empty(SCRATCH, np.float32))
        if accumulate:
            for i in range(dst.size):
                dst[i] += buf[i]


# --- mean of full-precision rows (a node's shards in the two-level collective) ---------


@parallel_and_serial
def _mean_rows(x, out):
    """out[i] = fp32((x[0, i] + x[1, i] + ...) / L), summed in fp64 in row order: the same bits as
    the torch formulation, in one pass over memory. Row-major loops over a tile so LLVM vectorises
    the adds and the divide (a scalar fp64 divide per element would not; the two-level calls of
    ``benchmarks/collectives.py`` run this kernel)."""
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
    cut alike), read by ``reduce`` and ``encode`` tile by tile instead of from a buffer (``out``, the
    buffer the CUDA backend's writes it into, is not used: both passes decode it)."""

    def __init__(self, messages, out: torch.Tensor | None = None) -> None:
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
    width = FORMATS[kind].totals
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


__all__ = ["FUSES_SOURCES", "READS_ENDS_IN_PLACE", "RowsMean", "accepts", "accepts_sink", "decode", "encode",
           "mean_rows", "reduce"]

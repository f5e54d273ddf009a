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

Each op is one compiled function for all codec kinds and modes (small integer arguments,
loop-invariant branches), so numba compiles a handful of functions once and caches them
on disk instead of one per combination.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .layout import (
    DIFF,
    ERROR_FEEDBACK,
    MARKOV,
    MINMAX_U8,
    PLAIN,
    REDUCE_LANES,
    REDUCE_TILE,
    SIGN_L2,
    Layout,
    is_sign,
)
from .threads import parallel_and_serial, parallel_kernel

TILE = 8192  # elements per encode/decode work item; a multiple of 8 so tiles start on a code byte
LANES = REDUCE_LANES
MM_LANES = 16  # independent min/max lanes: LLVM vectorises these, not a scalar min reduction
BATCH = 16  # reduction tiles per parallel work item
_F32 = np.float32


# --- reduction ------------------------------------------------------------------------------
# Every loop runs over slices from index 0: with a provably non-negative index numba drops the
# negative-index wraparound and LLVM vectorises. The value encoded is v = xs + a * ss with a in
# {0, 1, -1} (plain / error feedback / Markov), exact for every mode.


@njit(inline="always", cache=True)
def _tile_sum(kind, a, xs, ss, acc):
    """The canonical fp64 sum of v^2 (SIGN_L2) or |v| over one tile (see layout.REDUCE_*);
    ``acc`` is LANES of scratch."""
    acc[:] = 0.0
    n = xs.size
    m = n - n % LANES
    if kind == SIGN_L2:  # v * v is exact in fp64 (v is fp32): no rounding to fuse or reorder
        for k in range(0, m, LANES):
            for j in range(LANES):
                v = np.float64(xs[k + j] + a * ss[k + j])
                acc[j] += v * v
        for j in range(n - m):
            v = np.float64(xs[m + j] + a * ss[m + j])
            acc[j] += v * v
    else:
        for k in range(0, m, LANES):
            for j in range(LANES):
                acc[j] += abs(np.float64(xs[k + j] + a * ss[k + j]))
        for j in range(n - m):
            acc[j] += abs(np.float64(xs[m + j] + a * ss[m + j]))
    h = LANES // 2
    while h > 0:
        for j in range(h):
            acc[j] += acc[j + h]
        h //= 2
    return acc[0]


@njit(inline="always", cache=True)
def _tile_minmax(a, xs, ss, out, t, mn, mx, probe):
    mn[:] = np.inf
    mx[:] = -np.inf
    probe[:] = 0.0
    m = xs.size - xs.size % MM_LANES
    for k in range(0, m, MM_LANES):
        for j in range(MM_LANES):
            v = xs[k + j] + a * ss[k + j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            probe[j] += v * np.float32(0.0)  # NaN iff some v is NaN or inf
    for i in range(m, xs.size):
        v = xs[i] + a * ss[i]
        mn[0] = v if v < mn[0] else mn[0]
        mx[0] = v if v > mx[0] else mx[0]
        probe[0] += v * np.float32(0.0)
    out[t, 0] = mn.min()  # min/max are exact in any order; the probe only tells NaN from not
    out[t, 1] = mx.max()
    out[t, 2] = probe.sum()


@parallel_and_serial
def _reduce_tiles(kind, a, x, st, seg_len, t_row, t_lo, t_hi, out):
    # work items of BATCH tiles share their scratch arrays: small blocks make many small tiles
    for bt in prange((t_row.size + BATCH - 1) // BATCH):
        acc = np.empty(LANES, np.float64)
        mn = np.empty(MM_LANES, np.float32)
        mx = np.empty(MM_LANES, np.float32)
        probe = np.empty(MM_LANES, np.float32)
        for t in range(bt * BATCH, min((bt + 1) * BATCH, t_row.size)):
            base = t_row[t] * seg_len
            xs = x[base + t_lo[t] : base + t_hi[t]]
            ss = st[base + t_lo[t] : base + t_hi[t]]
            if kind == MINMAX_U8:
                _tile_minmax(a, xs, ss, out, t, mn, mx, probe)
            else:
                out[t, 0] = _tile_sum(kind, a, xs, ss, acc)


@parallel_and_serial
def _combine(kind, ptr, partials, totals):
    """Per-block totals from the tile partials, tiles in order (minmax: min, max, probe sum)."""
    for b in prange(ptr.size - 1):
        if kind == MINMAX_U8:
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


# --- block walk ---------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _block_at(starts_r, pos):
    """The block of a row that holds element ``pos``: the last j with starts_r[j] <= pos (empty
    blocks before it are skipped because they start at or before it too)."""
    lo, hi = 0, starts_r.size - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts_r[mid] <= pos:
            lo = mid
        else:
            hi = mid
    return lo


# --- encode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _sign_codes(a, xs, ss, cs):
    """Pack the signs of v = xs + a*ss (v >= 0 -> 1) into whole bytes cs (xs starts on a byte)."""
    n = xs.size
    for k in range(n >> 3):
        byte = np.uint8(0)
        for j in range(8):
            byte |= np.uint8(xs[8 * k + j] + a * ss[8 * k + j] >= 0) << np.uint8(j)
        cs[k] = byte
    if n & 7:
        byte = np.uint8(0)
        for i in range(n & ~7, n):
            byte |= np.uint8(xs[i] + a * ss[i] >= 0) << np.uint8(i & 7)
        cs[n >> 3] = byte


@njit(inline="always", cache=True)
def _sign_state(mode, xs, ss, s):
    """State update of a run of elements that share the scale s (EF: ss = v - dec; Markov: ss += dec)."""
    if mode == ERROR_FEEDBACK:
        for i in range(xs.size):
            v = xs[i] + ss[i]
            ss[i] = v - s if v >= 0 else v + s
    elif mode == MARKOV:
        for i in range(xs.size):
            ss[i] += s if xs[i] - ss[i] >= 0 else -s


@njit(inline="always", cache=True)
def _minmax_run(mode, a, xs, ss, cs, sc0, sc1):
    smin = np.float64(sc0)
    rng = np.float64(sc1) - smin
    inv = 255.0 / rng if rng > 0 else 0.0
    step = rng / 255.0
    for i in range(xs.size):
        v = xs[i] + a * ss[i]
        q = min(max(np.rint((np.float64(v) - smin) * inv), 0.0), 255.0)
        cs[i] = np.uint8(q)
        dec = _F32(smin + q * step)
        if mode == ERROR_FEEDBACK:
            ss[i] = v - dec
        elif mode == MARKOV:
            ss[i] += dec


@njit(cache=True, inline="always")
def _tile_span(t, per_row, seg_len):
    """Row and element range [lo, hi) of work item ``t`` (``per_row`` tiles of TILE per row)."""
    r = t // per_row
    lo = (t - r * per_row) * TILE
    return r, lo, min(lo + TILE, seg_len)


@parallel_and_serial
def _encode(kind, mode, a, x, st, seg_len, starts, ends, scales, codes):
    nseg, nb = starts.shape[0], starts.shape[1] - 1
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(nseg * per_row):
        r, lo, hi = _tile_span(t, per_row, seg_len)
        base = r * seg_len
        xs = x[base + lo : base + hi]
        ss = st[base + lo : base + hi]
        if kind != MINMAX_U8:
            _sign_codes(a, xs, ss, codes[r, lo >> 3 : (hi + 7) >> 3])
        # sign codes need no scale: only a state update (EF / Markov) walks the blocks; padding
        # (from ends[r]) decodes to 0, so its state stays as it is (zero)
        walk = kind == MINMAX_U8 or mode == ERROR_FEEDBACK or mode == MARKOV
        j = _block_at(starts[r], lo) if walk else nb
        end = min(hi, ends[r])
        while j < nb and starts[r, j] < end:
            p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
            if q > p:
                g = r * nb + j
                if kind == MINMAX_U8:
                    _minmax_run(mode, a, xs[p - lo : q - lo], ss[p - lo : q - lo], codes[r, p:q],
                                scales[2 * g], scales[2 * g + 1])
                else:
                    _sign_state(mode, xs[p - lo : q - lo], ss[p - lo : q - lo], scales[g])
            j += 1
        if kind == MINMAX_U8 and end < hi:
            codes[r, max(end, lo) : hi] = 0  # padding: defined bytes on the wire (sign codes: +1)


# --- decode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def _sign_run(cw, s, p, q, out):
    """out[0 : q - p] = decode of elements [p, q) of a row whose codes are cw, all with scale s."""
    i, k = p, 0
    while i < q and i & 7:  # head up to a byte boundary
        out[k] = s if (cw[i >> 3] >> (i & 7)) & 1 else -s
        i += 1
        k += 1
    nbytes = (q - i) >> 3
    cs = cw[i >> 3 : (i >> 3) + nbytes]
    o = out[k : k + 8 * nbytes]
    for m in range(nbytes):  # byte-wise with a fixed inner trip count: vectorises
        byte = cs[m]
        for j in range(8):
            o[8 * m + j] = s if (byte >> j) & 1 else -s
    i += 8 * nbytes
    k += 8 * nbytes
    while i < q:
        out[k] = s if (cw[i >> 3] >> (i & 7)) & 1 else -s
        i += 1
        k += 1


@njit(inline="always", cache=True)
def _minmax_dec_run(cw, sc0, sc1, p, q, out):
    smin = np.float64(sc0)
    step = (np.float64(sc1) - smin) / 255.0
    cs = cw[p:q]
    for i in range(q - p):
        out[i] = _F32(smin + np.float64(cs[i]) * step)


@njit(inline="always", cache=True)
def _decode_run(kind, cw, sc, g, p, q, out):
    if kind == MINMAX_U8:
        _minmax_dec_run(cw, sc[2 * g], sc[2 * g + 1], p, q, out)
    else:
        _sign_run(cw, sc[g], p, q, out)


@parallel_and_serial
def _decode_rows(kind, codes, scales, seg_len, starts, ends, out, accumulate):
    nseg, nb = starts.shape[0], starts.shape[1] - 1
    per_row = (seg_len + TILE - 1) // TILE
    for t in prange(nseg * per_row):
        r, lo, hi = _tile_span(t, per_row, seg_len)
        dst = out[r * seg_len + lo : r * seg_len + hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        end = max(lo, min(hi, ends[r]))
        j = _block_at(starts[r], lo)
        while j < nb and starts[r, j] < end:
            p, q = max(lo, starts[r, j]), min(end, starts[r, j + 1])
            if q > p:
                _decode_run(kind, codes[r], scales[r], j, p, q, buf[p - lo : q - lo])
            j += 1
        buf[end - lo :] = 0.0  # padding
        if accumulate:
            for i in range(dst.size):
                dst[i] += buf[i]


@njit(inline="always", cache=True)
def _sel(p, a, b):
    return b if p else a


@njit(inline="always", cache=True)
def _mean_elem(kind, mc, ms, j, i):
    """Element i of the mean over the rows (workers 0..n-1 summed in order in fp64, then / n)."""
    nw = mc.shape[0]
    acc = 0.0
    for w in range(nw):
        if kind == MINMAX_U8:
            smin = np.float64(ms[w, 2 * j])
            acc += np.float64(_F32(smin + np.float64(mc[w, i]) * ((np.float64(ms[w, 2 * j + 1]) - smin) / 255.0)))
        else:
            s = ms[w, j]
            acc += np.float64(s if (mc[w, i >> 3] >> (i & 7)) & 1 else -s)
    return _F32(acc / nw)


@njit(inline="always", cache=True)
def _mean_sign_lut(mc, ms, j, k0, nbytes, out):
    """The mean of 1-4 sign rows over whole code bytes k0..k0+nbytes by table: with one scale per
    row and block, an element's mean is one of 2^n values fixed by its n sign bits. Each entry is
    computed exactly as _mean_elem computes it, so the result is bit-identical; per element it is
    then a select tree instead of n fp64 additions."""
    nw = mc.shape[0]
    t = np.zeros(16, np.float32)
    for p in range(1 << nw):
        acc = 0.0
        for w in range(nw):
            s = ms[w, j]
            acc += np.float64(s if (p >> w) & 1 else -s)
        t[p] = _F32(acc / nw)
    # scalars, not t[...] in the loop: LLVM vectorises the select tree only over locals
    t0, t1, t2, t3 = t[0], t[1], t[2], t[3]
    if nw <= 2:
        c0, c1 = mc[0, k0 : k0 + nbytes], mc[nw - 1, k0 : k0 + nbytes]
        m1 = np.uint8(1) if nw == 2 else np.uint8(0)  # one row: p1 = 0, t0/t1 are -s/+s
        for k in range(nbytes):
            x0 = c0[k]
            x1 = c1[k]
            for b in range(8):
                p0 = (x0 >> b) & 1
                p1 = (x1 >> b) & m1
                out[8 * k + b] = (t3 if p0 else t2) if p1 else (t1 if p0 else t0)
    else:
        t4, t5, t6, t7, t8, t9, t10, t11 = t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11]
        t12, t13, t14, t15 = t[12], t[13], t[14], t[15]
        c0, c1, c2 = mc[0, k0 : k0 + nbytes], mc[1, k0 : k0 + nbytes], mc[2, k0 : k0 + nbytes]
        c3 = mc[nw - 1, k0 : k0 + nbytes]  # with 3 rows: any row, its bit is masked off below
        m3 = np.uint8(1) if nw == 4 else np.uint8(0)
        for k in range(nbytes):
            x0, x1, x2, x3 = c0[k], c1[k], c2[k], c3[k]
            for b in range(8):
                p0, p1, p2, p3 = (x0 >> b) & 1, (x1 >> b) & 1, (x2 >> b) & 1, (x3 >> b) & m3
                lo2 = _sel(p2, _sel(p1, _sel(p0, t0, t1), _sel(p0, t2, t3)),
                           _sel(p1, _sel(p0, t4, t5), _sel(p0, t6, t7)))
                hi2 = _sel(p2, _sel(p1, _sel(p0, t8, t9), _sel(p0, t10, t11)),
                           _sel(p1, _sel(p0, t12, t13), _sel(p0, t14, t15)))
                out[8 * k + b] = _sel(p3, lo2, hi2)


@njit(inline="always", cache=True)
def _mean_run(kind, mc, ms, j, p, q, out):
    """out[0 : q - p] = mean over the rows of elements [p, q), all in block j."""
    nw = mc.shape[0]
    if kind != MINMAX_U8 and nw <= 4:
        i, k = p, 0
        while i < q and i & 7:
            out[k] = _mean_elem(kind, mc, ms, j, i)
            i += 1
            k += 1
        nbytes = (q - i) >> 3
        _mean_sign_lut(mc, ms, j, i >> 3, nbytes, out[k : k + 8 * nbytes])
        i += 8 * nbytes
        k += 8 * nbytes
        while i < q:
            out[k] = _mean_elem(kind, mc, ms, j, i)
            i += 1
            k += 1
        return
    n = q - p
    acc = np.zeros(n, np.float64)
    o = out[:n]
    for w in range(nw):
        _decode_run(kind, mc[w], ms[w], j, p, q, o)
        for i in range(n):
            acc[i] += np.float64(o[i])
    for i in range(n):
        o[i] = _F32(acc[i] / nw)


@parallel_and_serial
def _decode_mean(kind, codes, scales, seg_len, starts_r, end_r, out, accumulate):
    nb = starts_r.size - 1
    for t in prange((seg_len + TILE - 1) // TILE):
        lo = t * TILE
        hi = min(lo + TILE, seg_len)
        dst = out[lo:hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        end = max(lo, min(hi, end_r))
        j = _block_at(starts_r, lo)
        while j < nb and starts_r[j] < end:
            p, q = max(lo, starts_r[j]), min(end, starts_r[j + 1])
            if q > p:
                _mean_run(kind, codes, scales, j, p, q, buf[p - lo : q - lo])
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


@parallel_kernel
def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    t_row, t_lo, t_hi, ptr = layout.reduce_tiles(REDUCE_TILE)
    width = 1 if is_sign(kind) else 3
    partials = np.empty((t_row.size, width), np.float64)
    xa = x.numpy()
    n = layout.nseg * layout.seg_len
    _reduce_tiles(n, kind, _mode_factor(mode), xa, xa if st is None else st.numpy(), layout.seg_len,
                  t_row, t_lo, t_hi, partials)
    totals = np.empty((layout.nblocks, width), np.float64)
    _combine(n, kind, ptr, partials, totals)
    return torch.from_numpy(totals)


@parallel_kernel
def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    xa = x.numpy()
    _encode(layout.nseg * layout.seg_len, kind, mode, _mode_factor(mode), xa, xa if st is None else st.numpy(),
            layout.seg_len, layout.starts, layout.data_ends, scales.reshape(-1).contiguous().numpy(), _rows(codes))


@parallel_kernel
def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    mc, ms = _rows(codes), _scales2d(scales, codes.shape[0])
    n = codes.shape[0] * layout.seg_len
    if mean_rows:
        _decode_mean(n, kind, mc, ms, layout.seg_len, layout.starts[0], layout.data_ends[0], out.numpy(), accumulate)
    else:
        _decode_rows(n, kind, mc, ms, layout.seg_len, layout.starts, layout.data_ends, out.numpy(), accumulate)


@parallel_kernel
def mean_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the fp32 mean of the rows of the 2-D fp32 ``x`` (fp64 sum in row order, / rows)."""
    _mean_rows(x.numel(), x.numpy(), out.numpy())


__all__ = ["reduce", "encode", "decode", "mean_rows"]

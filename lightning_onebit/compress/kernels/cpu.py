"""Numba CPU backend: ``njit(parallel=True)`` kernels over fixed-size tiles.

Work is split into tiles that never straddle a scale block, so the per-tile partial sums
are combined in the same order whatever the thread count: results do not depend on how
many threads numba runs, which keeps the simulated cluster bit-identical to real ranks.

Each op is one compiled function for all codec kinds and modes (small integer arguments,
loop-invariant branches), so numba compiles a handful of functions once and caches them
on disk instead of one per combination.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from .layout import DIFF, ERROR_FEEDBACK, MARKOV, MINMAX_U8, PLAIN, SIGN_L2, Layout, is_sign

name = "numba"
TILE = 8192  # elements per parallel work item; a multiple of 8 so tiles start on a code byte

_F32 = np.float32


@njit(inline="always", cache=True)
def _tile_bounds(t, tpb, tile_len, bps, block, seg_len):
    g = t // tpb
    r = g // bps
    b = g - r * bps
    lo = b * block + (t - g * tpb) * tile_len
    hi = min(lo + tile_len, (b + 1) * block, seg_len)
    return g, r, b, lo, hi


# --- per-tile bodies ---------------------------------------------------------------------
# Every loop runs over slices from index 0: with a provably non-negative index numba drops
# the negative-index wraparound and LLVM vectorises (8x faster than range(lo, hi)). The
# value encoded is v = xs + a * ss with a in {0, 1, -1} (plain / error feedback / Markov),
# exact for every mode. fp64 sums may be reassociated (vectorised): their order is fixed
# per machine and tile, and each scale is computed by one rank and sent, so no two ranks
# ever need to agree on a sum.

LANES = 16  # independent min/max lanes: LLVM vectorises these, not a scalar min reduction


@njit(inline="always", cache=True)
def _tile_reduce(kind, a, xs, ss, out, t):
    if kind == MINMAX_U8:
        mn = np.full(LANES, np.inf, np.float32)
        mx = np.full(LANES, -np.inf, np.float32)
        probe = np.zeros(LANES, np.float32)
        m = xs.size - xs.size % LANES
        for k in range(0, m, LANES):
            for j in range(LANES):
                v = xs[k + j] + a * ss[k + j]
                mn[j] = v if v < mn[j] else mn[j]
                mx[j] = v if v > mx[j] else mx[j]
                probe[j] += v * np.float32(0.0)  # NaN iff some v is NaN or inf
        for i in range(m, xs.size):
            v = xs[i] + a * ss[i]
            mn[0] = v if v < mn[0] else mn[0]
            mx[0] = v if v > mx[0] else mx[0]
            probe[0] += v * np.float32(0.0)
        out[t, 0] = mn.min()
        out[t, 1] = mx.max()
        out[t, 2] = probe.sum()
    elif kind == SIGN_L2:
        acc = 0.0
        for i in range(xs.size):
            v = np.float64(xs[i] + a * ss[i])
            acc += v * v
        out[t, 0] = acc
    else:
        acc = 0.0
        for i in range(xs.size):
            acc += abs(np.float64(xs[i] + a * ss[i]))
        out[t, 0] = acc


@njit(inline="always", cache=True)
def _tile_encode(kind, mode, a, xs, ss, cs, sc0, sc1):
    """Codes of v = xs + a*ss into cs; state update (EF: ss = v - dec, Markov: ss += dec)."""
    n = xs.size
    if kind == MINMAX_U8:
        smin = np.float64(sc0)
        rng = np.float64(sc1) - smin
        inv = 255.0 / rng if rng > 0 else 0.0
        step = rng / 255.0
        for i in range(n):
            v = xs[i] + a * ss[i]
            q = min(max(np.rint((np.float64(v) - smin) * inv), 0.0), 255.0)
            cs[i] = np.uint8(q)
            dec = _F32(smin + q * step)
            if mode == ERROR_FEEDBACK:
                ss[i] = v - dec
            elif mode == MARKOV:
                ss[i] += dec
        return
    s = sc0
    # codes first (reads only), then the state update: simple loops vectorise
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
    if mode == ERROR_FEEDBACK:
        for i in range(n):
            v = xs[i] + ss[i]
            ss[i] = v - s if v >= 0 else v + s
    elif mode == MARKOV:
        for i in range(n):
            ss[i] += s if xs[i] - ss[i] >= 0 else -s


@njit(inline="always", cache=True)
def _tile_decode_row(kind, cw, sc0, sc1, lo, out):
    """Decode elements [lo, lo + out.size) of one message row into fp32 ``out``."""
    n = out.size
    if kind == MINMAX_U8:
        smin = np.float64(sc0)
        step = (np.float64(sc1) - smin) / 255.0
        cs = cw[lo : lo + n]
        for i in range(n):
            out[i] = _F32(smin + np.float64(cs[i]) * step)
        return
    cs = cw[lo >> 3 : (lo + n + 7) >> 3]
    for k in range(n >> 3):  # byte-wise with a fixed inner trip count: vectorises
        byte = cs[k]
        for j in range(8):
            out[8 * k + j] = sc0 if (byte >> j) & 1 else -sc0
    for i in range(n & ~7, n):
        out[i] = sc0 if (cs[i >> 3] >> (i & 7)) & 1 else -sc0


@njit(inline="always", cache=True)
def _sel(p, a, b):
    return b if p else a


@njit(inline="always", cache=True)
def _tile_mean_sign_lut(mc, ms, b, lo, buf):
    """The mean of 1-4 sign rows by table: with one scale per row and block, an element's mean
    is one of 2^n values, fixed by its n sign bits. Each table entry is computed exactly as
    the fp64 path computes it (same values, same order), so the result is bit-identical;
    per element it is then a select tree instead of n fp64 additions (2-5x faster)."""
    nw = mc.shape[0]
    t = np.zeros(16, np.float32)
    for p in range(1 << nw):
        acc = 0.0
        for w in range(nw):
            s = ms[w, b]
            acc += np.float64(s if (p >> w) & 1 else -s)
        t[p] = _F32(acc / nw)
    n = buf.size
    k0, nb = lo >> 3, n >> 3
    # scalars, not t[...] in the loop: LLVM vectorises the select tree only over locals
    t0, t1, t2, t3 = t[0], t[1], t[2], t[3]
    if nw <= 2:
        c0, c1 = mc[0, k0 : k0 + nb], mc[nw - 1, k0 : k0 + nb]
        m1 = np.uint8(1) if nw == 2 else np.uint8(0)  # one row: p1 = 0, t0/t1 are -s/+s
        for k in range(nb):
            x0 = c0[k]
            x1 = c1[k]
            for j in range(8):
                p0 = (x0 >> j) & 1
                p1 = (x1 >> j) & m1
                buf[8 * k + j] = (t3 if p0 else t2) if p1 else (t1 if p0 else t0)
    else:
        t4, t5, t6, t7, t8, t9, t10, t11 = t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11]
        t12, t13, t14, t15 = t[12], t[13], t[14], t[15]
        c0, c1, c2 = mc[0, k0 : k0 + nb], mc[1, k0 : k0 + nb], mc[2, k0 : k0 + nb]
        c3 = mc[nw - 1, k0 : k0 + nb]  # with 3 rows: any row, its bit is masked off below
        m3 = np.uint8(1) if nw == 4 else np.uint8(0)
        for k in range(nb):
            x0, x1, x2, x3 = c0[k], c1[k], c2[k], c3[k]
            for j in range(8):
                p0, p1, p2, p3 = (x0 >> j) & 1, (x1 >> j) & 1, (x2 >> j) & 1, (x3 >> j) & m3
                lo2 = _sel(p2, _sel(p1, _sel(p0, t0, t1), _sel(p0, t2, t3)),
                           _sel(p1, _sel(p0, t4, t5), _sel(p0, t6, t7)))
                hi2 = _sel(p2, _sel(p1, _sel(p0, t8, t9), _sel(p0, t10, t11)),
                           _sel(p1, _sel(p0, t12, t13), _sel(p0, t14, t15)))
                buf[8 * k + j] = _sel(p3, lo2, hi2)
    for i in range(nb * 8, n):
        p = 0
        for w in range(nw):
            p |= ((mc[w, (lo + i) >> 3] >> ((lo + i) & 7)) & 1) << w
        buf[i] = t[p]


@njit(inline="always", cache=True)
def _tile_mean(kind, mc, ms, b, lo, buf):
    """buf = mean over message rows (workers 0..n-1 summed in order in fp64, then / n)."""
    nw = mc.shape[0]
    n = buf.size
    if kind != MINMAX_U8 and nw <= 4:
        _tile_mean_sign_lut(mc, ms, b, lo, buf)
        return
    acc = np.zeros(n, np.float64)
    for w in range(nw):
        if kind == MINMAX_U8:
            _tile_decode_row(kind, mc[w], ms[w, 2 * b], ms[w, 2 * b + 1], lo, buf)
        else:
            _tile_decode_row(kind, mc[w], ms[w, b], ms[w, b], lo, buf)
        for i in range(n):
            acc[i] += np.float64(buf[i])
    for i in range(n):
        buf[i] = _F32(acc[i] / nw)


# --- kernels -------------------------------------------------------------------------------


# reassoc must sit on the kernel: inline="always" inlines numba IR, compiled with the caller's flags
@njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc"})
def _reduce_x(kind, a, x, st, nseg, seg_len, block, tile_len, tpb, out):
    bps = (seg_len + block - 1) // block
    for t in prange(nseg * bps * tpb):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        xs = x[r * seg_len + lo : r * seg_len + hi]
        ss = st[r * seg_len + lo : r * seg_len + hi]
        _tile_reduce(kind, a, xs, ss, out, t)


@njit(inline="always", cache=True)
def _tile_encode_at(kind, mode, a, xs, ss, codes, scales, r, g, lo, hi):
    if kind == MINMAX_U8:
        _tile_encode(kind, mode, a, xs, ss, codes[r, lo:hi], scales[2 * g], scales[2 * g + 1])
    else:
        _tile_encode(kind, mode, a, xs, ss, codes[r, lo >> 3 : (hi + 7) >> 3], scales[g], scales[g])


@njit(parallel=True, nogil=True, cache=True)
def _encode_x(kind, mode, a, x, st, nseg, seg_len, block, tile_len, tpb, scales, codes):
    bps = (seg_len + block - 1) // block
    for t in prange(nseg * bps * tpb):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        xs = x[r * seg_len + lo : r * seg_len + hi]
        ss = st[r * seg_len + lo : r * seg_len + hi]
        _tile_encode_at(kind, mode, a, xs, ss, codes, scales, r, g, lo, hi)


@njit(parallel=True, nogil=True, cache=True)
def _decode_rows(kind, codes, scales, nseg, seg_len, block, tile_len, tpb, out, accumulate):
    bps = (seg_len + block - 1) // block
    for t in prange(nseg * bps * tpb):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        dst = out[r * seg_len + lo : r * seg_len + hi]
        buf = np.empty(hi - lo, np.float32) if accumulate else dst
        if kind == MINMAX_U8:
            _tile_decode_row(kind, codes[r], scales[r, 2 * b], scales[r, 2 * b + 1], lo, buf)
        else:
            _tile_decode_row(kind, codes[r], scales[r, b], scales[r, b], lo, buf)
        if accumulate:
            for i in range(dst.size):
                dst[i] += buf[i]


@njit(parallel=True, nogil=True, cache=True)
def _decode_mean(kind, codes, scales, seg_len, block, tile_len, tpb, out, accumulate):
    bps = (seg_len + block - 1) // block
    for t in prange(bps * tpb):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        if hi > lo:
            dst = out[lo:hi]
            buf = np.empty(hi - lo, np.float32) if accumulate else dst
            _tile_mean(kind, codes, scales, b, lo, buf)
            if accumulate:
                for i in range(dst.size):
                    dst[i] += buf[i]


# --- torch-facing wrappers ------------------------------------------------------------

def _tiling(layout: Layout) -> tuple[int, int]:
    tile_len = min(TILE, layout.block)
    return tile_len, layout.tiles_per_block(tile_len)


def _rows(codes: torch.Tensor) -> np.ndarray:
    """Codes as a C-contiguous 2-D array. Codes that are row views into a packed buffer
    (``[codes | scales]`` rows) are widened to the full row stride: numba types slices of
    a C array as contiguous and vectorises them, slices of a strided view it does not."""
    if codes.is_contiguous() or codes.dim() != 2 or codes.stride(1) != 1:
        return codes.numpy() if codes.is_contiguous() else codes.contiguous().numpy()
    n, stride = codes.shape[0], codes.stride(0)
    return torch.as_strided(codes, (n, stride), (stride, 1)).numpy()


def _msg(codes, scales):
    # scales of a pipeline piece are a column slice: a few bytes, copied so numba sees a C array
    return _rows(codes), scales.reshape(codes.shape[0], -1).contiguous().numpy()


def _mode_factor(mode: int) -> np.float32:
    return np.float32({PLAIN: 0.0, ERROR_FEEDBACK: 1.0, MARKOV: -1.0, DIFF: -1.0}[mode])


def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    tile_len, tpb = _tiling(layout)
    width = 1 if is_sign(kind) else 3
    out = np.zeros((layout.nblocks * tpb, width), np.float64)
    if kind == MINMAX_U8:  # empty tiles (short last block) must not win min/max
        out[:, 0] = np.inf
        out[:, 1] = -np.inf
    xa = x.numpy()
    _reduce_x(kind, _mode_factor(mode), xa, xa if st is None else st.numpy(), layout.nseg, layout.seg_len,
              layout.block, tile_len, tpb, out)
    return torch.from_numpy(out).view(layout.nblocks, tpb, width)


def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    tile_len, tpb = _tiling(layout)
    xa = x.numpy()
    _encode_x(kind, mode, _mode_factor(mode), xa, xa if st is None else st.numpy(), layout.nseg,
              layout.seg_len, layout.block, tile_len, tpb, scales.reshape(-1).numpy(), _rows(codes))


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    tile_len, tpb = _tiling(layout)
    mc, ms = _msg(codes, scales)
    if mean_rows:
        _decode_mean(kind, mc, ms, layout.seg_len, layout.block, tile_len, tpb, out.numpy(), accumulate)
    else:
        _decode_rows(kind, mc, ms, layout.nseg, layout.seg_len, layout.block, tile_len, tpb, out.numpy(),
                     accumulate)


__all__ = ["reduce", "encode", "decode"]

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


@njit(inline="always", cache=True)
def _decode_one(kind, codes, scales, row, i, b):
    """Decoded fp32 value of element i of a message row (scales as [rows, bps*width])."""
    if kind == MINMAX_U8:
        lo = np.float64(scales[row, 2 * b])
        hi = np.float64(scales[row, 2 * b + 1])
        return _F32(lo + np.float64(codes[row, i]) * ((hi - lo) / 255.0))
    s = scales[row, b]
    if (codes[row, i >> 3] >> (i & 7)) & 1:
        return s
    return -s


@njit(inline="always", cache=True)
def _value(kind, mode, use_msg, x, st, mc, ms, r, i, b, seg_len):
    if use_msg:
        nw = mc.shape[0]
        acc = 0.0  # fp64: n large decoded values must not overflow before the division
        for w in range(nw):
            acc += np.float64(_decode_one(kind, mc, ms, w, i, b))
        s = _F32(acc / nw)
    else:
        s = x[r * seg_len + i]
    if mode == ERROR_FEEDBACK:
        return s + st[r * seg_len + i]
    if mode == MARKOV or mode == DIFF:
        return s - st[r * seg_len + i]
    return s


@njit(parallel=True, cache=True)
def _reduce(kind, mode, use_msg, x, st, mc, ms, nseg, seg_len, block, tile_len, tpb, out):
    bps = (seg_len + block - 1) // block
    ntiles = nseg * bps * tpb
    for t in prange(ntiles):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        if kind == MINMAX_U8:
            mn = np.inf
            mx = -np.inf
            probe = 0.0
            for i in range(lo, hi):
                v = np.float64(_value(kind, mode, use_msg, x, st, mc, ms, r, i, b, seg_len))
                mn = min(mn, v)
                mx = max(mx, v)
                probe += v * 0.0  # NaN iff some v is NaN or inf
            out[t, 0] = mn
            out[t, 1] = mx
            out[t, 2] = probe
        else:
            acc = 0.0
            for i in range(lo, hi):
                v = np.float64(_value(kind, mode, use_msg, x, st, mc, ms, r, i, b, seg_len))
                acc += v * v if kind == SIGN_L2 else abs(v)
            out[t, 0] = acc


@njit(inline="always", cache=True)
def _round_half_even(t):
    f = np.floor(t)
    d = t - f
    if d > 0.5 or (d == 0.5 and f % 2.0 == 1.0):
        f += 1.0
    return f


@njit(parallel=True, cache=True)
def _encode(kind, mode, use_msg, x, st, mc, ms, nseg, seg_len, block, tile_len, tpb, scales, codes):
    bps = (seg_len + block - 1) // block
    ntiles = nseg * bps * tpb
    for t in prange(ntiles):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        if kind == MINMAX_U8:
            smin = np.float64(scales[2 * g])
            rng = np.float64(scales[2 * g + 1]) - smin
            inv = 255.0 / rng if rng > 0 else 0.0
            step = rng / 255.0
            for i in range(lo, hi):
                v = _value(kind, mode, use_msg, x, st, mc, ms, r, i, b, seg_len)
                q = min(max(_round_half_even((np.float64(v) - smin) * inv), 0.0), 255.0)
                codes[r, i] = np.uint8(q)
                dec = _F32(smin + q * step)
                if mode == ERROR_FEEDBACK:
                    st[r * seg_len + i] = v - dec
                elif mode == MARKOV:
                    st[r * seg_len + i] += dec
        else:
            s = scales[g]
            for i0 in range(lo, hi, 8):
                byte = 0
                for i in range(i0, min(i0 + 8, hi)):
                    v = _value(kind, mode, use_msg, x, st, mc, ms, r, i, b, seg_len)
                    pos = v >= 0
                    if pos:
                        byte |= 1 << (i - i0)
                    dec = s if pos else -s
                    if mode == ERROR_FEEDBACK:
                        st[r * seg_len + i] = v - dec
                    elif mode == MARKOV:
                        st[r * seg_len + i] += dec
                codes[r, i0 >> 3] = np.uint8(byte)


@njit(parallel=True, cache=True)
def _decode(kind, codes, scales, nseg, seg_len, block, tile_len, tpb, out, accumulate, mean_rows):
    bps = (seg_len + block - 1) // block
    nrows_out = 1 if mean_rows else nseg
    ntiles = nrows_out * bps * tpb
    dummy = np.empty(0, np.float32)
    for t in prange(ntiles):
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        for i in range(lo, hi):
            if mean_rows:
                v = _value(kind, PLAIN, True, dummy, dummy, codes, scales, 0, i, b, seg_len)
            else:
                v = _decode_one(kind, codes, scales, r, i, b)
            if accumulate:
                out[r * seg_len + i] += v
            else:
                out[r * seg_len + i] = v


# --- torch-facing wrappers ------------------------------------------------------------

_EMPTY_F = np.empty(0, np.float32)
_EMPTY_C = np.empty((0, 0), np.uint8)
_EMPTY_S = np.empty((0, 0), np.float32)


def _tiling(layout: Layout) -> tuple[int, int]:
    tile_len = min(TILE, layout.block)
    return tile_len, layout.tiles_per_block(tile_len)


def _np(t: torch.Tensor | None, empty):
    return empty if t is None else t.detach().numpy()


def _msg(kind: int, codes, scales):
    if codes is None:
        return _EMPTY_C, _EMPTY_S
    return codes.numpy(), scales.reshape(codes.shape[0], -1).numpy()


def reduce(kind, mode, layout: Layout, x, st, msg_codes, msg_scales) -> torch.Tensor:
    tile_len, tpb = _tiling(layout)
    width = 1 if is_sign(kind) else 3
    out = np.zeros((layout.nblocks * tpb, width), np.float64)
    if kind == MINMAX_U8:  # empty tiles (short last block) must not win min/max
        out[:, 0] = np.inf
        out[:, 1] = -np.inf
    mc, ms = _msg(kind, msg_codes, msg_scales)
    _reduce(kind, mode, msg_codes is not None, _np(x, _EMPTY_F), _np(st, _EMPTY_F), mc, ms,
            layout.nseg, layout.seg_len, layout.block, tile_len, tpb, out)
    return torch.from_numpy(out).view(layout.nblocks, tpb, width)


def encode(kind, mode, layout: Layout, x, st, msg_codes, msg_scales, scales, codes) -> None:
    tile_len, tpb = _tiling(layout)
    mc, ms = _msg(kind, msg_codes, msg_scales)
    _encode(kind, mode, msg_codes is not None, _np(x, _EMPTY_F), _np(st, _EMPTY_F), mc, ms,
            layout.nseg, layout.seg_len, layout.block, tile_len, tpb,
            scales.reshape(-1).numpy(), codes.numpy())


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    tile_len, tpb = _tiling(layout)
    mc, ms = _msg(kind, codes, scales)
    _decode(kind, mc, ms, layout.nseg, layout.seg_len, layout.block, tile_len, tpb,
            out.numpy(), accumulate, mean_rows)


__all__ = ["reduce", "encode", "decode", "PLAIN"]

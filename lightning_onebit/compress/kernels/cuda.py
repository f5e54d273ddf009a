"""Numba-CUDA backend: kernels on CUDA tensors, zero-copy, on torch's current stream.

Same tiling and arithmetic as the CPU backend (``cpu.py``): the reduction kernel gives one
thread block per tile and writes one fp64 partial per tile (combined by the caller in a
fixed order); the encode kernel gives each thread whole code bytes (8 elements) so packed
bits need no atomics or warp votes, which also keeps the kernels runnable under numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where CPU tensors stand in for device memory.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import config as numba_config
from numba import cuda, float32, float64

from .layout import DIFF, ERROR_FEEDBACK, MARKOV, MINMAX_U8, PLAIN, SIGN_L2, Layout, is_sign

name = "cuda"

SIMULATED = bool(numba_config.ENABLE_CUDASIM)
# Under the simulator every CUDA thread is a Python thread: keep blocks tiny there.
THREADS = 8 if SIMULATED else 256
TILE = 256 if SIMULATED else 8192  # elements per tile (multiple of 8)


@cuda.jit(device=True, inline=True)
def _decode_one(kind, codes, scales, row, i, b):
    if kind == MINMAX_U8:
        lo = float64(scales[row, 2 * b])
        hi = float64(scales[row, 2 * b + 1])
        return float32(lo + float64(codes[row, i]) * ((hi - lo) / 255.0))
    s = scales[row, b]
    if (codes[row, i >> 3] >> (i & 7)) & 1:
        return s
    return -s


@cuda.jit(device=True, inline=True)
def _mean_of_rows(kind, mc, ms, i, b):
    """Element i of the mean over the message rows (workers 0..n-1 summed in order)."""
    nw = mc.shape[0]
    acc = 0.0  # fp64: n large decoded values must not overflow before the division
    for w in range(nw):
        acc += float64(_decode_one(kind, mc, ms, w, i, b))
    return float32(acc / nw)


@cuda.jit(device=True, inline=True)
def _value(mode, x, st, r, i, seg_len):
    s = x[r * seg_len + i]
    if mode == ERROR_FEEDBACK:
        return s + st[r * seg_len + i]
    if mode == MARKOV or mode == DIFF:
        return s - st[r * seg_len + i]
    return s


@cuda.jit(device=True, inline=True)
def _tile_bounds(t, tpb, tile_len, bps, block, seg_len):
    g = t // tpb
    r = g // bps
    b = g - r * bps
    lo = b * block + (t - g * tpb) * tile_len
    hi = min(lo + tile_len, (b + 1) * block, seg_len)
    return g, r, b, lo, hi


@cuda.jit(device=True, inline=True)
def _round_half_even(t):
    f = math.floor(t)
    d = t - f
    if d > 0.5 or (d == 0.5 and f % 2.0 == 1.0):
        f += 1.0
    return f


@cuda.jit
def _reduce_kernel(kind, mode, x, st, nseg, seg_len, block, tile_len, tpb, out):
    s_a = cuda.shared.array(THREADS, float64)
    s_b = cuda.shared.array(THREADS, float64)
    s_c = cuda.shared.array(THREADS, float64)
    tid = cuda.threadIdx.x
    bps = (seg_len + block - 1) // block
    ntiles = nseg * bps * tpb
    t = cuda.blockIdx.x
    while t < ntiles:  # grid-stride over tiles; the loop bound is uniform per block
        g, r, b, lo, hi = _tile_bounds(t, tpb, tile_len, bps, block, seg_len)
        a = 0.0
        mn = math.inf
        mx = -math.inf
        i = lo + tid
        while i < hi:
            v = float64(_value(mode, x, st, r, i, seg_len))
            if kind == MINMAX_U8:
                mn = min(mn, v)
                mx = max(mx, v)
                a += v * 0.0
            elif kind == SIGN_L2:
                a += v * v
            else:
                a += abs(v)
            i += THREADS
        s_a[tid] = a
        s_b[tid] = mn
        s_c[tid] = mx
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                s_a[tid] += s_a[tid + step]
                s_b[tid] = min(s_b[tid], s_b[tid + step])
                s_c[tid] = max(s_c[tid], s_c[tid + step])
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            if kind == MINMAX_U8:
                out[t, 0] = s_b[0]
                out[t, 1] = s_c[0]
                out[t, 2] = s_a[0]
            else:
                out[t, 0] = s_a[0]
        cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit
def _encode_sign_kernel(mode, x, st, nseg, seg_len, block, scales, codes):
    # both sign kinds share the encode pass; only their scales differ
    cb = (seg_len + 7) // 8  # not codes.shape[1]: rows may be widened to a packed buffer's stride
    nbytes = nseg * cb
    k = cuda.grid(1)
    bps = (seg_len + block - 1) // block
    while k < nbytes:
        r = k // cb
        i0 = (k - r * cb) * 8
        byte = 0
        for i in range(i0, min(i0 + 8, seg_len)):
            b = i // block
            s = scales[r * bps + b]
            v = _value(mode, x, st, r, i, seg_len)
            pos = v >= 0
            if pos:
                byte |= 1 << (i - i0)
            dec = s if pos else -s
            if mode == ERROR_FEEDBACK:
                st[r * seg_len + i] = v - dec
            elif mode == MARKOV:
                st[r * seg_len + i] += dec
        codes[r, i0 >> 3] = byte
        k += cuda.gridsize(1)


@cuda.jit
def _encode_minmax_kernel(mode, x, st, nseg, seg_len, block, scales, codes):
    n = nseg * seg_len
    j = cuda.grid(1)
    bps = (seg_len + block - 1) // block
    while j < n:
        r = j // seg_len
        i = j - r * seg_len
        b = i // block
        g = r * bps + b
        smin = float64(scales[2 * g])
        rng = float64(scales[2 * g + 1]) - smin
        inv = 255.0 / rng if rng > 0 else 0.0
        v = _value(mode, x, st, r, i, seg_len)
        q = min(max(_round_half_even((float64(v) - smin) * inv), 0.0), 255.0)
        codes[r, i] = q
        dec = float32(smin + q * (rng / 255.0))
        if mode == ERROR_FEEDBACK:
            st[j] = v - dec
        elif mode == MARKOV:
            st[j] += dec
        j += cuda.gridsize(1)


@cuda.jit
def _decode_kernel(kind, codes, scales, nseg, seg_len, block, out, accumulate, mean_rows):
    nrows = 1 if mean_rows else nseg
    n = nrows * seg_len
    j = cuda.grid(1)
    while j < n:
        r = j // seg_len
        i = j - r * seg_len
        b = i // block
        if mean_rows:
            v = _mean_of_rows(kind, codes, scales, i, b)
        else:
            v = _decode_one(kind, codes, scales, r, i, b)
        if accumulate:
            out[j] += v
        else:
            out[j] = v
        j += cuda.gridsize(1)


# --- torch-facing wrappers ------------------------------------------------------------


def _arr(t: torch.Tensor):
    if t.is_cuda:
        return cuda.as_cuda_array(t.detach())
    if not SIMULATED:
        raise ValueError("the cuda backend needs CUDA tensors (or NUMBA_ENABLE_CUDASIM=1)")
    return t.detach().numpy()


def _codes_arr(codes: torch.Tensor):
    """Codes rows that are views into a packed ``[codes | scales]`` buffer, widened to the full
    row stride: the simulator only takes contiguous arrays, and the kernels never index past
    the code bytes of a row."""
    if codes.dim() == 2 and not codes.is_contiguous() and codes.stride(1) == 1:
        codes = torch.as_strided(codes, (codes.shape[0], codes.stride(0)), (codes.stride(0), 1))
    return _arr(codes)


def _stream(device: torch.device):
    if device.type == "cuda":
        return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
    return 0


def _grid(work: int, threads: int) -> int:
    # Enough blocks to fill the GPU, grid-stride loops do the rest.
    return max(1, min(-(-work // threads), 65535 if not SIMULATED else 8))


def _inputs(x, st, device):
    f = torch.empty(0, dtype=torch.float32, device=device)
    return _arr(x), _arr(f if st is None else st)


def _tiling(layout: Layout) -> tuple[int, int]:
    tile_len = min(TILE, layout.block)
    return tile_len, layout.tiles_per_block(tile_len)


def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    device = x.device
    tile_len, tpb = _tiling(layout)
    width = 1 if is_sign(kind) else 3
    out = torch.zeros(layout.nblocks * tpb, width, dtype=torch.float64, device=device)
    if kind == MINMAX_U8:
        out[:, 0] = math.inf
        out[:, 1] = -math.inf
    xa, sa = _inputs(x, st, device)
    grid = _grid(layout.nblocks * tpb, 1)
    _reduce_kernel[grid, THREADS, _stream(device)](
        kind, mode, xa, sa, layout.nseg, layout.seg_len, layout.block, tile_len, tpb, _arr(out))
    return out.view(layout.nblocks, tpb, width)


def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    device = codes.device
    xa, sa = _inputs(x, st, device)
    flat_scales = _arr(scales.reshape(-1))
    args = (mode, xa, sa, layout.nseg, layout.seg_len, layout.block, flat_scales, _codes_arr(codes))
    if is_sign(kind):
        _encode_sign_kernel[_grid(codes.numel(), THREADS), THREADS, _stream(device)](*args)
    else:
        _encode_minmax_kernel[_grid(layout.numel, THREADS), THREADS, _stream(device)](*args)


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    device = codes.device
    n = layout.seg_len if mean_rows else layout.numel
    _decode_kernel[_grid(n, THREADS), THREADS, _stream(device)](
        kind, _codes_arr(codes), _arr(scales.reshape(codes.shape[0], -1).contiguous()), layout.nseg,
        layout.seg_len, layout.block, _arr(out), accumulate, mean_rows)


__all__ = ["reduce", "encode", "decode", "DIFF", "PLAIN"]
_ = np  # numpy arrays stand in for device arrays under the simulator

"""The numba-CUDA kernels and their device functions (the launch wrappers are in :mod:`.numba_cuda`).

The reduction follows the summation order of :mod:`.layout` (one thread block per tile, the
``REDUCE_LANES`` lanes spread over the block's threads, the same halving tree, tiles combined in
order by a second small kernel), so its scales are the numba CPU backend's bit for bit. The
encode and decode kernels give each thread one element (coalesced loads); the encode packs a
tile's codes through shared memory, so it needs no atomics or warp votes, and every element finds
its scale block by a binary search of its row's block starts. Each kernel serves every codec kind
(branches on ``kind`` are uniform over a launch); a kind's code width and top code come from the
format table (:data:`.layout.KIND_BITS`, :data:`.layout.KIND_TOP`).

The input of ``reduce`` and ``encode`` is a tensor or a payload :class:`~..source.Source`, which
the kernels read in place: each thread evaluates the expression at its own element (its group and
whether it is masked found by binary searches) with torch's roundings, so neither kernel needs the
payload written to memory first and the bits are those of ``Source.materialize()``. This keeps
the kernels runnable under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where CPU
tensors stand in for device memory.
"""

from __future__ import annotations

import math

from numba import cuda, float32, float64, int32

from .layout import DIFF, ERROR_FEEDBACK, KIND_BITS, KIND_PER_BYTE, KIND_TOP, MARKOV, MINMAX_U8, REDUCE_LANES, SIGN_L2
from .numba_common import combine_block
from .numba_cuda_source import SIMULATED, _mul64, last_at_most, source_at

__all__ = ["LANES", "RTHREADS", "THREADS"]

# Under the simulator every CUDA thread is a Python thread: keep blocks tiny there.
THREADS = 8 if SIMULATED else 256  # a multiple of 8: an encode tile starts on a code byte
RTHREADS = 2 if SIMULATED else REDUCE_LANES  # threads of a reduction block
LANES = REDUCE_LANES


@cuda.jit(device=True, inline=True)
def _code(kind, codes, row, i):
    """The code of element i of a row, packed at the kind's width."""
    bits = KIND_BITS[kind]
    if bits == 8:
        return int32(codes[row, i])
    at = i * bits
    return (int32(codes[row, at >> 3]) >> (at & 7)) & KIND_TOP[kind]


@cuda.jit(device=True, inline=True)
def _decode_one(kind, codes, scales, col0, row, i, b):
    c = _code(kind, codes, row, i)
    if kind >= MINMAX_U8:
        lo = float64(scales[row, col0 + 2 * b])
        hi = float64(scales[row, col0 + 2 * b + 1])
        return float32(lo + _mul64(float64(c), (hi - lo) / float64(KIND_TOP[kind])))
    s = scales[row, col0 + b]
    if c:
        return s
    return -s


@cuda.jit(device=True, inline=True)
def _mean_of_rows(kind, mc, ms, col0, i, b):
    """Element i of the mean over the message rows (workers 0..n-1 summed in order)."""
    nw = mc.shape[0]
    acc = 0.0  # fp64: n large decoded values must not overflow before the division
    for w in range(nw):
        acc += float64(_decode_one(kind, mc, ms, col0, w, i, b))
    return float32(acc / nw)


@cuda.jit(device=True, inline=True)
def _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, j):
    """The value v that element j encodes: the input's, with the state added or subtracted (``mode``)."""
    s = source_at(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, j)
    if mode == ERROR_FEEDBACK:
        return s + st[j]
    if mode == MARKOV or mode == DIFF:
        return s - st[j]
    return s


@cuda.jit(device=True, inline=True)
def _tile_element(t, tiles):
    """(row, element) of this thread in tile ``t``: tiles of THREADS elements, ``tiles`` per row."""
    r = t // tiles
    return r, (t - r * tiles) * THREADS + cuda.threadIdx.x


@cuda.jit(device=True, inline=True)
def _round_half_even(t):
    f = math.floor(t)
    d = t - f
    if d > 0.5 or (d == 0.5 and f % 2.0 == 1.0):
        f += 1.0
    return f


@cuda.jit(cache=True)
def _reduce_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len, t_row,
                   t_lo, t_hi, out, ok):
    # ``ok``: the finiteness flag the scales kernel (launched next) clears, set here (empty: none)
    if ok.size and cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        ok[0] = True
    s_a = cuda.shared.array(LANES, float64)
    s_b = cuda.shared.array(LANES, float64)
    s_c = cuda.shared.array(LANES, float64)
    tid = cuda.threadIdx.x
    t = cuda.blockIdx.x
    while t < t_row.size:  # grid-stride over tiles; the loop bound is uniform per block
        base = t_row[t] * seg_len
        hi = t_hi[t]
        lane = tid
        while lane < LANES:  # lane j sums elements j, j + LANES, ... of the tile, in order
            a = 0.0
            mn = math.inf
            mx = -math.inf
            i = t_lo[t] + lane
            while i < hi:
                v = float64(_value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, base + i))
                if kind >= MINMAX_U8:
                    mn = min(mn, v)
                    mx = max(mx, v)
                    a += v * 0.0
                elif kind == SIGN_L2:
                    a += v * v  # exact in fp64 (v is fp32), so a fused multiply-add rounds alike
                else:
                    a += abs(v)
                i += LANES
            s_a[lane] = a
            if kind >= MINMAX_U8:
                s_b[lane] = mn
                s_c[lane] = mx
            lane += RTHREADS
        cuda.syncthreads()
        h = LANES // 2
        while h > 0:  # the halving tree of the CPU backend
            lane = tid
            while lane < h:
                s_a[lane] += s_a[lane + h]
                if kind >= MINMAX_U8:
                    s_b[lane] = min(s_b[lane], s_b[lane + h])
                    s_c[lane] = max(s_c[lane], s_c[lane + h])
                lane += RTHREADS
            cuda.syncthreads()
            h //= 2
        if tid == 0:
            if kind >= MINMAX_U8:
                out[t, 0] = s_b[0]
                out[t, 1] = s_c[0]
                out[t, 2] = s_a[0]
            else:
                out[t, 0] = s_a[0]
        cuda.syncthreads()
        t += cuda.gridDim.x


_combine_block = cuda.jit(device=True, inline=True)(combine_block)


@cuda.jit(cache=True)
def _combine_kernel(kind, ptr, partials, totals):
    b = cuda.grid(1)
    while b < ptr.size - 1:  # one thread per block: its tiles in order, like the CPU backend
        _combine_block(kind, ptr, partials, totals, b)
        b += cuda.gridsize(1)


@cuda.jit(device=True, inline=True)
def _scale_block(kind, ptr, partials, totals, lens, nbs, scales, col0, ok, b):
    """Scale block b: its tiles combined, its fp32 scale(s) written, ``ok[0]`` cleared if not finite."""
    _combine_block(kind, ptr, partials, totals, b)
    r = b // nbs
    j = b - r * nbs
    n = lens[b]
    if kind >= MINMAX_U8:
        if not math.isfinite(totals[b, 2]):
            ok[0] = False
        scales[r, col0 + 2 * j] = float32(totals[b, 0]) if n > 0 else float32(0.0)
        scales[r, col0 + 2 * j + 1] = float32(totals[b, 1]) if n > 0 else float32(0.0)
    else:
        total = totals[b, 0]
        if not math.isfinite(total):
            ok[0] = False
        mean = total / float64(n) if n > 0 else 0.0
        scales[r, col0 + j] = float32(math.sqrt(mean)) if kind == SIGN_L2 else float32(mean)


@cuda.jit(cache=True)
def _scales_kernel(kind, ptr, partials, totals, lens, nbs, scales, col0, ok):
    """The combine, then each block's fp32 scale written where the message keeps it (row r's scales at
    ``scales[r, col0:]``: the rows of a packed buffer as fp32, or the scales alone with ``col0`` 0; ``nbs``
    blocks per row) and ``ok[0]`` cleared when a block's total is not finite: the
    torch ops of ``Codec._scales_unchecked`` in the same roundings (fp64 quotient and square root,
    one rounding to fp32), so no op of the step's host path computes them."""
    b = cuda.grid(1)
    while b < ptr.size - 1:
        _scale_block(kind, ptr, partials, totals, lens, nbs, scales, col0, ok, b)
        b += cuda.gridsize(1)


@cuda.jit(cache=True)
def _encode_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len, starts,
                   ends, scales, col0, codes):
    # One thread per element (loads and state updates coalesced); a tile of THREADS elements of one
    # row per block, so the row is found once per tile. 8-bit codes are written by their thread;
    # narrower ones (a sign's bits) meet in shared memory and a thread packs each byte.
    qs = cuda.shared.array(THREADS, int32)
    tid = cuda.threadIdx.x
    tiles = (seg_len + THREADS - 1) // THREADS  # per row; a tile starts on a byte
    bits = KIND_BITS[kind]
    per = KIND_PER_BYTE[kind]
    top = float64(KIND_TOP[kind])
    t = cuda.blockIdx.x
    while t < starts.shape[0] * tiles:  # grid-stride over tiles; uniform per block
        r, i = _tile_element(t, tiles)
        i0 = i - tid
        qi = int32(0)
        if i < seg_len:
            e = r * seg_len + i
            g = last_at_most(starts[r], i)  # row r's scales are scales[r, col0:], as the scales kernel writes them
            v = _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, e)
            if kind >= MINMAX_U8:
                smin = float64(scales[r, col0 + 2 * g])
                rng = float64(scales[r, col0 + 2 * g + 1]) - smin
                inv = top / rng if rng > 0 else 0.0
                q = min(max(_round_half_even((float64(v) - smin) * inv), 0.0), top)
                if i >= ends[r]:
                    q = 0.0  # padding: defined bytes on the wire
                qi = int32(q)
                dec = float32(smin + _mul64(q, rng / top))
            else:  # both sign kinds: only their scales differ
                s = scales[r, col0 + g]
                dec = -s
                if v >= 0:
                    qi = int32(1)
                    dec = s
            if i >= ends[r]:  # padding decodes to 0: its state stays as it is
                pass
            elif mode == ERROR_FEEDBACK:
                st[e] = v - dec
            elif mode == MARKOV:
                st[e] += dec
            if bits == 8:
                codes[r, i] = qi
        if bits != 8:
            qs[tid] = qi
            cuda.syncthreads()
            if tid < THREADS // per and i0 + per * tid < seg_len:  # codes rows may be wider (packed stride)
                byte = 0
                for k in range(per):
                    byte |= qs[per * tid + k] << (bits * k)
                codes[r, ((i0 * bits) >> 3) + tid] = byte
            cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit(cache=True)
def _decode_kernel(kind, codes, scales, col0, seg_len, starts, ends, out, accumulate, mean_rows):
    nrows = 1 if mean_rows else starts.shape[0]
    tiles = (seg_len + THREADS - 1) // THREADS  # as in the encode kernels
    t = cuda.blockIdx.x
    while t < nrows * tiles:
        r, i = _tile_element(t, tiles)
        t += cuda.gridDim.x
        if i >= seg_len:
            continue
        e = r * seg_len + i
        b = last_at_most(starts[r], i)
        if i >= ends[r]:
            v = float32(0.0)  # padding
        elif mean_rows:
            v = _mean_of_rows(kind, codes, scales, col0, i, b)
        else:
            v = _decode_one(kind, codes, scales, col0, r, i, b)
        if accumulate:
            out[e] += v
        else:
            out[e] = v

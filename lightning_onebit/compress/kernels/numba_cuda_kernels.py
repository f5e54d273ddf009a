"""The numba-CUDA kernels and their device functions (the launch wrappers are in :mod:`.numba_cuda`).

The reduction follows the summation order of :mod:`.layout` (one thread block per tile, the
``REDUCE_LANES`` lanes spread over the block's threads, the same halving tree, a scale block's
tiles combined in order: by a second small kernel for ``reduce``, and for the scales by the thread
block that finishes the block's last tile, in the same launch), so its scales are the numba CPU
backend's bit for bit. The
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
from .numba_cuda_sink import sink_at
from .numba_cuda_source import ROWS_MEAN, SIMULATED, _mul64, last_at_most, source_at

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
    return _with_state(mode, source_at(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, j), st, j)


@cuda.jit(device=True, inline=True)
def _with_state(mode, s, st, j):
    if mode == ERROR_FEEDBACK:
        return s + st[j]
    if mode == MARKOV or mode == DIFF:
        return s - st[j]
    return s


@cuda.jit(device=True, inline=True)
def _first_tile(tiles):
    """This block's first tile of a grid-stride walk over rows of ``tiles`` tiles (THREADS elements
    each), and its stride: (row, tile in the row, rows and tiles to add per step). The walk's only
    divisions, once per thread: a 64-bit division by a value known only at run time is a long
    instruction sequence on a GPU, which a division per element made a large share of its work."""
    t = cuda.blockIdx.x
    r = t // tiles
    step = cuda.gridDim.x
    dr = step // tiles
    return r, t - r * tiles, dr, step - dr * tiles


@cuda.jit(device=True, inline=True)
def _next_tile(r, c, dr, dc, tiles):
    """The walk's next (row, tile in the row): ``gridDim.x`` tiles on, without a division."""
    r += dr
    c += dc
    if c >= tiles:
        c -= tiles
        r += 1
    return r, c


@cuda.jit(device=True, inline=True)
def _round_half_even(t):
    f = math.floor(t)
    d = t - f
    if d > 0.5 or (d == 0.5 and f % 2.0 == 1.0):
        f += 1.0
    return f


@cuda.jit(device=True, inline=True)
def _tile_partial(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, mc, ms, mcol0,
                  mstarts, mends, seg_len, t_row, t_lo, t_hi, out, t, s_a, s_b, s_c):
    """Tile t's partial (the sum, or min, max and the finiteness probe) into ``out[t]``, by the block's
    threads: the block's ``REDUCE_LANES`` lanes each sum their strided elements in order, then the
    halving tree of the CPU backend. Called by every thread of the block; thread 0 writes. With op
    ``ROWS_MEAN`` the input is the mean over the message rows ``mc``/``ms`` (scales from column ``mcol0``,
    blocks ``mstarts[0]``, data up to ``mends[0]``), decoded here and written into ``x`` as it is read:
    the tiles cover every element, so ``x`` then holds what ``decode_mean`` would have written."""
    tid = cuda.threadIdx.x
    base = t_row[t] * seg_len
    hi = t_hi[t]
    lane = tid
    while lane < LANES:  # lane j sums elements j, j + LANES, ... of the tile, in order
        a = 0.0
        mn = math.inf
        mx = -math.inf
        i = t_lo[t] + lane
        while i < hi:
            if op == ROWS_MEAN:
                j = base + i
                m = float32(0.0)  # padding
                if j < mends[0]:
                    m = _mean_of_rows(kind, mc, ms, mcol0, j, last_at_most(mstarts[0], j))
                x[j] = m
                v = float64(_with_state(mode, m, st, j))
            else:
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
    while h > 0:
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


@cuda.jit(cache=True)
def _reduce_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, mc, ms, mcol0,
                   mstarts, mends, seg_len, t_row, t_lo, t_hi, out):
    s_a = cuda.shared.array(LANES, float64)
    s_b = cuda.shared.array(LANES, float64)
    s_c = cuda.shared.array(LANES, float64)
    t = cuda.blockIdx.x
    while t < t_row.size:  # grid-stride over tiles; the loop bound is uniform per block
        _tile_partial(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, mc, ms, mcol0,
                      mstarts, mends, seg_len, t_row, t_lo, t_hi, out, t, s_a, s_b, s_c)
        t += cuda.gridDim.x


_combine_block = cuda.jit(device=True, inline=True)(combine_block)


@cuda.jit(cache=True)
def _combine_kernel(kind, ptr, partials, totals):
    b = cuda.grid(1)
    while b < ptr.size - 1:  # one thread per block: its tiles in order, like the CPU backend
        _combine_block(kind, ptr, partials, totals, b)
        b += cuda.gridsize(1)


@cuda.jit(device=True, inline=True)
def _write_scale(kind, totals, lens, nbs, scales, col0, b):
    """Scale block b's fp32 scale(s) from its totals, written where the message keeps them (row r's
    scales at ``scales[r, col0:]``, ``nbs`` blocks per row): the torch ops of ``Codec._scales_unchecked``
    in the same roundings (fp64 quotient and square root, one rounding to fp32). Returns whether the
    totals are finite."""
    r = b // nbs
    j = b - r * nbs
    n = lens[b]
    if kind >= MINMAX_U8:
        scales[r, col0 + 2 * j] = float32(totals[b, 0]) if n > 0 else float32(0.0)
        scales[r, col0 + 2 * j + 1] = float32(totals[b, 1]) if n > 0 else float32(0.0)
        return math.isfinite(totals[b, 2])
    total = totals[b, 0]
    mean = total / float64(n) if n > 0 else 0.0
    scales[r, col0 + j] = float32(math.sqrt(mean)) if kind == SIGN_L2 else float32(mean)
    return math.isfinite(total)


@cuda.jit(device=True, inline=True)
def _block_done(kind, totals, lens, nbs, scales, col0, count, ok, b):
    """Block b's totals are in: its scale written, and the last block of the launch to get here writes
    ``ok`` (no block's total was non-finite) and zeroes the launch's counters for the next one."""
    nb = count.size - 2
    if not _write_scale(kind, totals, lens, nbs, scales, col0, b):
        cuda.atomic.add(count, nb + 1, 1)
    cuda.threadfence()
    if cuda.atomic.add(count, nb, 1) == nb - 1:
        ok[0] = cuda.atomic.add(count, nb + 1, 0) == 0
        count[nb] = 0
        count[nb + 1] = 0


@cuda.jit(cache=True)
def _reduce_scales_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, mc, ms,
                          mcol0, mstarts, mends, seg_len, t_row, t_lo, t_hi, ptr, partials, totals, lens, nbs, scales,
                          col0, count, ok):
    """The reduction, the combine and the scales in one launch. Each tile's partial is computed as by
    ``_reduce_kernel``; the thread block that finishes a scale block's last tile (``count[b]``, tiles
    done per block, counted atomically after a fence) combines that block's partials in tile order, as
    ``combine_block`` does (read through atomics: the L2 copy, never a stale L1 line of another SM's
    write), and writes its scale (``_block_done``). ``count``: int32 [nblocks + 2], zero between
    launches (each launch zeroes what it counted): tiles done per block, blocks done, blocks not
    finite. Blocks without tiles are finished by thread 0 of a block up front."""
    s_a = cuda.shared.array(LANES, float64)
    s_b = cuda.shared.array(LANES, float64)
    s_c = cuda.shared.array(LANES, float64)
    last = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    nb = ptr.size - 1
    if tid == 0:
        b = cuda.blockIdx.x
        while b < nb:
            if ptr[b] == ptr[b + 1]:
                _combine_block(kind, ptr, partials, totals, b)  # no tiles: the zero totals
                _block_done(kind, totals, lens, nbs, scales, col0, count, ok, b)
            b += cuda.gridDim.x
    t = cuda.blockIdx.x
    while t < t_row.size:  # grid-stride over tiles; uniform per block
        _tile_partial(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, mc, ms, mcol0,
                      mstarts, mends, seg_len, t_row, t_lo, t_hi, partials, t, s_a, s_b, s_c)
        if tid == 0:
            cuda.threadfence()  # this tile's partial visible before it is counted
            b = last_at_most(ptr, t)
            done = cuda.atomic.add(count, b, 1)
            last[0] = b if done == ptr[b + 1] - ptr[b] - 1 else -1
        cuda.syncthreads()
        b = last[0]
        if b >= 0:  # uniform per block: this tile was its scale block's last
            cuda.threadfence()
            mn = math.inf
            mx = -math.inf
            acc = 0.0
            c = ptr[b]
            while c < ptr[b + 1]:  # LANES partials at a time read by the threads, summed in order by thread 0
                lane = tid
                while lane < LANES:
                    if c + lane < ptr[b + 1]:
                        s_a[lane] = cuda.atomic.add(partials, (c + lane, 0), 0.0)
                        if kind >= MINMAX_U8:
                            s_b[lane] = cuda.atomic.add(partials, (c + lane, 1), 0.0)
                            s_c[lane] = cuda.atomic.add(partials, (c + lane, 2), 0.0)
                    lane += RTHREADS
                cuda.syncthreads()
                if tid == 0:
                    for q in range(min(LANES, ptr[b + 1] - c)):
                        if kind >= MINMAX_U8:  # the order and operations of combine_block
                            mn = min(mn, s_a[q])
                            mx = max(mx, s_b[q])
                            acc += s_c[q]
                        else:
                            acc += s_a[q]
                cuda.syncthreads()
                c += LANES
            if tid == 0:
                count[b] = 0
                if kind >= MINMAX_U8:
                    totals[b, 0] = mn
                    totals[b, 1] = mx
                    totals[b, 2] = acc
                else:
                    totals[b, 0] = acc
                _block_done(kind, totals, lens, nbs, scales, col0, count, ok, b)
        cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit(cache=True)
def _encode_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len, starts,
                   ends, scales, col0, codes, go):
    # One thread per element (loads and state updates coalesced); a tile of THREADS elements of one
    # row per block, so the row is found once per tile. 8-bit codes are written by their thread;
    # narrower ones (a sign's bits) meet in shared memory and a thread packs each byte. Nothing is
    # written unless go[0]: a step the device decided to skip leaves codes and state as they were.
    if not go[0]:
        return
    qs = cuda.shared.array(THREADS, int32)
    tid = cuda.threadIdx.x
    tiles = (seg_len + THREADS - 1) // THREADS  # per row; a tile starts on a byte
    bits = KIND_BITS[kind]
    per = KIND_PER_BYTE[kind]
    packers = THREADS // per  # threads that pack a byte each (a division: out of the loop)
    top = float64(KIND_TOP[kind])
    if tiles == 0:
        return
    nrows = starts.shape[0]
    r, c, dr, dc = _first_tile(tiles)
    while r < nrows:  # grid-stride over tiles; uniform per block
        i0 = c * THREADS
        i = i0 + tid
        qi = int32(0)
        if i < seg_len:
            e = r * seg_len + i
            g = last_at_most(starts[r], i)  # row r's scales are scales[r, col0:], as _reduce_scales_kernel writes them
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
            if tid < packers and i0 + per * tid < seg_len:  # codes rows may be wider (packed stride)
                byte = 0
                for k in range(per):
                    byte |= qs[per * tid + k] << (bits * k)
                codes[r, ((i0 * bits) >> 3) + tid] = byte
            cuda.syncthreads()
        r, c = _next_tile(r, c, dr, dc, tiles)


@cuda.jit(cache=True)
def _decode_kernel(kind, codes, scales, col0, seg_len, starts, ends, out, accumulate, mean_rows, go, and_go, copy,
                   flags, decay, decay_out, s_addr, s_bounds, s_value, s_decay, s_denom, s_mask, s_valid):
    # out[e] (or +=) for the elements it holds (a state buffer may be the result without its padding),
    # only if go[0] and and_go[0]; ``copy`` (when not empty) gets the values too, and zeros where not:
    # what an update reads, so that a skipped step adds nothing there. For what comes after it on the
    # stream the first thread writes ``flags`` [go and and_go, and_go or not go] and ``decay_out`` (the
    # update's decay, rounded to fp32 as torch does, or 1 where not), when they are not empty
    # s_*: a Sink applied to the values where they are written (numba_cuda_sink; s_valid 0: none)
    write = go[0] and and_go[0]
    if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        if flags.size:
            flags[0] = write
            flags[1] = and_go[0] or not go[0]
        if decay_out.size:
            decay_out[0] = float32(decay) if write else float32(1.0)
    if not write and copy.size == 0:
        return
    nrows = 1 if mean_rows else starts.shape[0]
    tiles = (seg_len + THREADS - 1) // THREADS  # as in the encode kernels
    if tiles == 0:
        return
    r, c, dr, dc = _first_tile(tiles)
    while r < nrows:
        i = c * THREADS + cuda.threadIdx.x
        row = r
        r, c = _next_tile(r, c, dr, dc, tiles)
        if i >= seg_len:
            continue
        e = row * seg_len + i
        v = float32(0.0)  # padding, or a skipped step's copy
        if write and i < ends[row]:
            b = last_at_most(starts[row], i)
            if mean_rows:
                v = _mean_of_rows(kind, codes, scales, col0, i, b)
            else:
                v = _decode_one(kind, codes, scales, col0, row, i, b)
        if write and e < out.size:
            if accumulate:
                out[e] += v
            else:
                out[e] = v
        if e < copy.size:
            copy[e] = v
        if write and e < s_valid:
            sink_at(s_addr, s_bounds, s_value, s_decay, s_denom, s_mask, s_valid, e, v)

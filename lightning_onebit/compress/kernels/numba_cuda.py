"""Numba-CUDA backend: kernels on CUDA tensors, zero-copy, on torch's current stream.

The reduction follows the summation order of :mod:`.layout` (one thread block per tile, the
``REDUCE_LANES`` lanes spread over the block's threads, the same halving tree, tiles combined in
order by a second small kernel), so its scales are the numba CPU backend's bit for bit. The
encode and decode kernels give each thread one element (coalesced loads); sign encode packs a
block's bits through shared memory, so it needs no atomics or warp votes, and every element finds
its scale block by a binary search of its row's block starts.

The input of ``reduce`` and ``encode`` is a tensor or a payload :class:`~..source.Source`, which
the kernels read in place: each thread evaluates the expression at its own element (its group and
whether it is masked found by binary searches) with torch's roundings, so neither kernel needs the
payload written to memory first and the bits are those of ``Source.materialize()``. This keeps
the kernels runnable under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where CPU
tensors stand in for device memory.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from numba import cuda, float32, float64, int32

from .layout import (
    DIFF,
    ERROR_FEEDBACK,
    MARKOV,
    MINMAX_U4,
    MINMAX_U8,
    REDUCE_LANES,
    REDUCE_TILE,
    SIGN_L2,
    Layout,
    is_sign,
)
from .numba_cuda_source import SIMULATED, _mul64, accepts, kernel_input, source_at
from .numba_cuda_source import arr as _arr

# Under the simulator every CUDA thread is a Python thread: keep blocks tiny there.
THREADS = 8 if SIMULATED else 256
RTHREADS = 2 if SIMULATED else REDUCE_LANES  # threads of a reduction block
LANES = REDUCE_LANES
#: ``reduce``/``encode`` evaluate a :class:`~..source.Source` in place (see :func:`accepts`)
FUSES_SOURCES = True

@cuda.jit(device=True, inline=True)
def _block_at(starts, r, pos):
    """The block of row r that holds element ``pos`` (the last j with starts[r, j] <= pos)."""
    lo = 0
    hi = starts.shape[1] - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if starts[r, mid] <= pos:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline=True)
def _top(kind):
    """The largest min-max code of ``kind``: 255, 15 or 3."""
    if kind == MINMAX_U8:
        return 255.0
    return 15.0 if kind == MINMAX_U4 else 3.0


@cuda.jit(device=True, inline=True)
def _decode_one(kind, codes, scales, row, i, b):
    if kind >= MINMAX_U8:
        lo = float64(scales[row, 2 * b])
        hi = float64(scales[row, 2 * b + 1])
        if kind == MINMAX_U8:
            c = codes[row, i]
        elif kind == MINMAX_U4:
            c = (codes[row, i >> 1] >> ((i & 1) << 2)) & 15
        else:
            c = (codes[row, i >> 2] >> ((i & 3) << 1)) & 3
        return float32(lo + _mul64(float64(c), (hi - lo) / _top(kind)))
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
                   t_lo, t_hi, out):
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


@cuda.jit(cache=True)
def _combine_kernel(kind, ptr, partials, totals):
    b = cuda.grid(1)
    while b < ptr.size - 1:  # one thread per block: its tiles in order, like the CPU backend
        if kind >= MINMAX_U8:
            mn = math.inf
            mx = -math.inf
            probe = 0.0
            for t in range(ptr[b], ptr[b + 1]):
                mn = min(mn, partials[t, 0])
                mx = max(mx, partials[t, 1])
                probe += partials[t, 2]
            totals[b, 0] = mn
            totals[b, 1] = mx
            totals[b, 2] = probe
        else:
            acc = 0.0
            for t in range(ptr[b], ptr[b + 1]):
                acc += partials[t, 0]
            totals[b, 0] = acc
        b += cuda.gridsize(1)


@cuda.jit(cache=True)
def _encode_sign_kernel(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len, starts,
                        ends, scales, codes):
    # Both sign kinds share this pass; only their scales differ. One thread per element (loads
    # and state updates coalesced); a tile of THREADS elements of one row per block, so the row
    # is found once per tile; the bits meet in shared memory and a thread packs each byte.
    bits = cuda.shared.array(THREADS, int32)
    nb = starts.shape[1] - 1
    tid = cuda.threadIdx.x
    tiles = (seg_len + THREADS - 1) // THREADS  # per row; a tile starts on a byte
    t = cuda.blockIdx.x
    while t < starts.shape[0] * tiles:  # grid-stride over tiles; uniform per block
        r, i = _tile_element(t, tiles)
        i0 = i - tid
        bit = 0
        if i < seg_len:
            e = r * seg_len + i
            s = scales[r * nb + _block_at(starts, r, i)]
            v = _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, e)
            dec = -s
            if v >= 0:
                bit = 1
                dec = s
            if i >= ends[r]:  # padding decodes to 0: its state stays as it is
                pass
            elif mode == ERROR_FEEDBACK:
                st[e] = v - dec
            elif mode == MARKOV:
                st[e] += dec
        bits[tid] = bit
        cuda.syncthreads()
        if tid < THREADS // 8 and i0 + 8 * tid < seg_len:  # codes rows may be wider (packed stride)
            byte = 0
            for q in range(8):
                byte |= bits[8 * tid + q] << q
            codes[r, (i0 >> 3) + tid] = byte
        cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit(cache=True)
def _encode_minmax_kernel(kind, mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len,
                          starts, ends, scales, codes):
    # One thread per element, a tile of THREADS elements of one row per block (its row found once).
    # 8-bit codes are written by their thread; 4- and 2-bit ones meet in shared memory and a thread
    # packs each byte, as the sign kernel does (a tile starts on a byte: THREADS is a multiple of 4).
    qs = cuda.shared.array(THREADS, int32)
    nb = starts.shape[1] - 1
    tid = cuda.threadIdx.x
    tiles = (seg_len + THREADS - 1) // THREADS
    top = _top(kind)
    t = cuda.blockIdx.x
    while t < starts.shape[0] * tiles:  # grid-stride over tiles; uniform per block
        r, i = _tile_element(t, tiles)
        i0 = i - tid
        qi = 0
        if i < seg_len:
            e = r * seg_len + i
            g = r * nb + _block_at(starts, r, i)
            smin = float64(scales[2 * g])
            rng = float64(scales[2 * g + 1]) - smin
            inv = top / rng if rng > 0 else 0.0
            v = _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, e)
            q = min(max(_round_half_even((float64(v) - smin) * inv), 0.0), top)
            if i >= ends[r]:
                q = 0.0  # padding: defined bytes on the wire
            qi = int32(q)
            if kind == MINMAX_U8:
                codes[r, i] = qi
            dec = float32(smin + _mul64(q, rng / top))
            if i >= ends[r]:
                pass
            elif mode == ERROR_FEEDBACK:
                st[e] = v - dec
            elif mode == MARKOV:
                st[e] += dec
        if kind != MINMAX_U8:
            qs[tid] = qi
            cuda.syncthreads()
            bits = 4 if kind == MINMAX_U4 else 2
            per = 8 // bits
            if tid < THREADS // per and i0 + per * tid < seg_len:
                byte = 0
                for k in range(per):
                    byte |= qs[per * tid + k] << (bits * k)
                codes[r, (i0 // per) + tid] = byte
            cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit(cache=True)
def _decode_kernel(kind, codes, scales, seg_len, starts, ends, out, accumulate, mean_rows):
    nrows = 1 if mean_rows else starts.shape[0]
    tiles = (seg_len + THREADS - 1) // THREADS  # as in the encode kernels
    t = cuda.blockIdx.x
    while t < nrows * tiles:
        r, i = _tile_element(t, tiles)
        t += cuda.gridDim.x
        if i >= seg_len:
            continue
        e = r * seg_len + i
        b = _block_at(starts, r, i)
        if i >= ends[r]:
            v = float32(0.0)  # padding
        elif mean_rows:
            v = _mean_of_rows(kind, codes, scales, i, b)
        else:
            v = _decode_one(kind, codes, scales, r, i, b)
        if accumulate:
            out[e] += v
        else:
            out[e] = v


# --- torch-facing wrappers ------------------------------------------------------------


def _codes_arr(codes: torch.Tensor):
    """Codes rows that are views into a packed ``[codes | scales]`` buffer, widened to the full
    row stride: the simulator only takes contiguous arrays, and the kernels never index past
    the code bytes of a row."""
    if codes.dim() == 2 and not codes.is_contiguous() and codes.stride(1) == 1:
        codes = torch.as_strided(codes, (codes.shape[0], codes.stride(0)), (codes.stride(0), 1))
    return _arr(codes)


def _on(device: torch.device):
    """Launch in ``device``'s context (numba would use the thread's current one: with several GPUs
    per process, or no ``torch.cuda.set_device``, that is another device)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]


def _stream(device: torch.device):
    if device.type == "cuda":
        return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
    return 0


def _grid(work: int, threads: int) -> int:
    # Enough blocks to fill the GPU, grid-stride loops do the rest.
    return max(1, min(-(-work // threads), 65535 if not SIMULATED else 2))


def _state(st, device):
    """The state as a kernel array (empty without one)."""
    return _arr(torch.empty(0, dtype=torch.float32, device=device) if st is None else st)


def _geometry(layout: Layout, device: torch.device, what: str, make) -> tuple:
    """Layout arrays as device tensors, made once per layout and device."""
    cache = layout.__dict__.setdefault("_device_arrays", {})
    key = (what, str(device))
    if key not in cache:
        cache[key] = tuple(torch.from_numpy(np.array(a, copy=True)).to(device) for a in make())
    return cache[key]


def accepts_sink(sink) -> bool:
    """``decode`` applies no :class:`~..source.Sink`: the caller applies it to the decoded values."""
    return False


def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    device = x.device
    with _on(device):
        t_row, t_lo, t_hi, ptr = _geometry(layout, device, "tiles", lambda: layout.reduce_tiles(REDUCE_TILE))
        width = 1 if is_sign(kind) else 3
        partials = torch.empty(t_row.numel(), width, dtype=torch.float64, device=device)
        totals = torch.empty(layout.nblocks, width, dtype=torch.float64, device=device)
        src = kernel_input(x, device)
        stream = _stream(device)
        if t_row.numel():
            _reduce_kernel[_grid(t_row.numel(), 1), RTHREADS, stream](
                kind, mode, *src, _state(st, device), layout.seg_len, _arr(t_row), _arr(t_lo), _arr(t_hi),
                _arr(partials))
        if layout.nblocks:
            _combine_kernel[_grid(layout.nblocks, THREADS), THREADS, stream](kind, _arr(ptr), _arr(partials),
                                                                             _arr(totals))
        return totals


def _starts(layout: Layout, device: torch.device):
    """(block starts, data ends) of the layout's rows as device arrays."""
    return tuple(_arr(a) for a in _geometry(layout, device, "starts", lambda: (layout.starts, layout.data_ends)))


def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    device = codes.device
    with _on(device):
        tiles = layout.nseg * -(-layout.seg_len // THREADS)
        args = (mode, *kernel_input(x, device), _state(st, device), layout.seg_len, *_starts(layout, device),
                _arr(scales.reshape(-1).contiguous()), _codes_arr(codes))
        if is_sign(kind):
            _encode_sign_kernel[_grid(tiles, 1), THREADS, _stream(device)](*args)
        else:
            _encode_minmax_kernel[_grid(tiles, 1), THREADS, _stream(device)](kind, *args)


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    device = codes.device
    with _on(device):
        tiles = (1 if mean_rows else layout.nseg) * -(-layout.seg_len // THREADS)
        _decode_kernel[_grid(tiles, 1), THREADS, _stream(device)](
            kind, _codes_arr(codes), _arr(scales.reshape(codes.shape[0], -1).contiguous()), layout.seg_len,
            *_starts(layout, device), _arr(out), accumulate, mean_rows)


# --- ahead-of-time checks ------------------------------------------------------------------


def kernel_signatures() -> dict[str, tuple]:
    """Argument types each kernel is launched with by the wrappers above (numba types):
    ``kind``/``mode``/lengths are Python ints, the arrays contiguous views of torch tensors."""
    from numba import types as nt

    i64, flag = nt.int64, nt.boolean
    f32v, i64v = nt.Array(nt.float32, 1, "C"), nt.Array(nt.int64, 1, "C")
    f32m, f64m = nt.Array(nt.float32, 2, "C"), nt.Array(nt.float64, 2, "C")
    i64m, u8m = nt.Array(nt.int64, 2, "C"), nt.Array(nt.uint8, 2, "C")
    # the input (_input): op, x, end, bounds, w, factors, mask, nonfinite, valid, offset
    src = (i64, f32v, f32v, i64v, nt.float32, f32v, i64v, flag, i64, i64)
    encode_args = (i64, *src, f32v, i64, i64m, i64v, f32v, u8m)
    return {
        "_reduce_kernel": (i64, i64, *src, f32v, i64, i64v, i64v, i64v, f64m),
        "_combine_kernel": (i64, i64v, f64m, f64m),
        "_encode_sign_kernel": encode_args,
        "_encode_minmax_kernel": (i64, *encode_args),
        "_decode_kernel": (i64, u8m, f32m, i64, i64m, i64v, f32v, flag, flag),
    }


def compile_ptx(cc: tuple[int, int] = (8, 0)) -> dict[str, str]:
    """Compile every kernel for compute capability ``cc`` with its launch signature; returns
    {kernel name: PTX}. Needs numba-cuda's NVVM (the ``cuda12``/``cuda13`` extra), not a GPU,
    so typing and NVVM errors show before the first GPU run. Not under the simulator."""
    if SIMULATED:
        raise RuntimeError("compile_ptx needs the real numba-cuda target; unset NUMBA_ENABLE_CUDASIM")
    from numba.cuda import compile_ptx as _compile

    out = {}
    for name, sig in kernel_signatures().items():
        ptx, _ = _compile(globals()[name].py_func, sig, cc=cc)
        out[name] = ptx
    return out


__all__ = ["FUSES_SOURCES", "accepts", "accepts_sink", "compile_ptx", "decode", "encode", "kernel_signatures",
           "reduce"]

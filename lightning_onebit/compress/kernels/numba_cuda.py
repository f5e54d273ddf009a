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
from numba import config as numba_config
from numba import cuda, float32, float64, int32

from ..source import Source
from .layout import DIFF, ERROR_FEEDBACK, MARKOV, MINMAX_U8, REDUCE_LANES, REDUCE_TILE, SIGN_L2, Layout, is_sign

SIMULATED = bool(numba_config.ENABLE_CUDASIM)
# Under the simulator every CUDA thread is a Python thread: keep blocks tiny there.
THREADS = 8 if SIMULATED else 256
RTHREADS = 2 if SIMULATED else REDUCE_LANES  # threads of a reduction block
LANES = REDUCE_LANES
#: ``reduce``/``encode`` evaluate a :class:`~..source.Source` in place (see :func:`accepts`)
FUSES_SOURCES = True

# The kernels' codes of an input: a tensor, or a Source's operation. RECIPROCAL is ``quotient`` on a
# GPU, where torch divides by a Python float as ``a * (1 / b)`` (the fp32 reciprocal; its CPU divides).
TENSOR, LERP, GRADIENT, QUOTIENT, RECIPROCAL = 0, 1, 2, 3, 4
_OP = {"lerp": LERP, "gradient": GRADIENT, "quotient": QUOTIENT}


# Two fp32 operations with exactly one rounding each, whatever the compiler: libNVVM contracts a
# multiply and an add into a fused multiply-add by default (its -fma=1, which numba-cuda leaves on),
# so ``lerp * factor + state`` would round once where torch rounds the payload first. fmul_rn
# (PTX ``mul.rn``) is never contracted; cuda.fma is the fused one that torch's lerp is.
if SIMULATED:
    from numba import njit

    from .numba_intrinsics import fma32 as _fma_llvm

    @njit(cache=True)
    def _fma_host(a, b, c):
        return _fma_llvm(a, b, c)

    @cuda.jit(device=True)
    def _fma32(a, b, c):
        # the simulator's cuda.fma is a * b + c, rounded twice; the CPU's llvm.fma.f32 rounds once
        return float32(_fma_host(a, b, c))

    @cuda.jit(device=True)
    def _mul32(a, b):
        return a * b  # numpy fp32 scalars (the simulator has no libdevice)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _fma32(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True, inline=True)
    def _mul32(a, b):
        return libdevice.fmul_rn(a, b)


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
def _group_at(bounds, pos):
    """The group k of position ``pos`` (the last k with bounds[k] <= pos; bounds: starts, then the end)."""
    lo = 0
    hi = bounds.size - 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if bounds[mid] <= pos:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline=True)
def _in_sorted(a, v):
    """Whether the sorted array ``a`` holds ``v`` (bisection)."""
    lo = 0
    hi = a.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo < a.size and a[lo] == v


@cuda.jit(device=True, inline=True)
def _lerp(w, a, b):
    """torch's ``lerp(a, b, w)`` in fp32: ``fma(w, b - a, a)``, or ``fma(w - 1, b - a, b)`` from |w| = 0.5 on."""
    if abs(w) < float32(0.5):
        return _fma32(w, b - a, a)
    return _fma32(w - float32(1.0), b - a, b)


@cuda.jit(device=True, inline=True)
def _source_at(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, j):
    """Element j of the input: ``x[j]`` of a tensor, or the Source's expression at position ``offset + j``
    (0 from ``valid`` on), rounded as :meth:`~..source.Source.materialize` rounds it. ``x`` is the
    tensor or the Source's ``start``; ``end`` its flat ``end``."""
    if op == TENSOR:
        return x[j]
    i = offset + j
    if i >= valid:
        return float32(0.0)  # padding
    if mask.size and _in_sorted(mask, i):
        if nonfinite:
            return abs(_mul32(end[i], float32(0.0)))  # |0 * g|: NaN where the gradient is not finite
        return float32(0.0)
    if op == GRADIENT:
        return end[i]
    if op == LERP:
        v = _lerp(w, x[i], end[i])
        if factors.size:
            v = _mul32(v, factors[_group_at(bounds, i)])
        return v
    f = factors[_group_at(bounds, i)]
    if op == QUOTIENT:
        return x[i] / f
    return _mul32(x[i], f)  # RECIPROCAL: f is the fp32 reciprocal of the divisor


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
def _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, j):
    """The value v that element j encodes: the input's, with the state added or subtracted (``mode``)."""
    s = _source_at(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, j)
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
                if kind == MINMAX_U8:
                    mn = min(mn, v)
                    mx = max(mx, v)
                    a += v * 0.0
                elif kind == SIGN_L2:
                    a += v * v  # exact in fp64 (v is fp32), so a fused multiply-add rounds alike
                else:
                    a += abs(v)
                i += LANES
            s_a[lane] = a
            if kind == MINMAX_U8:
                s_b[lane] = mn
                s_c[lane] = mx
            lane += RTHREADS
        cuda.syncthreads()
        h = LANES // 2
        while h > 0:  # the halving tree of the CPU backend
            lane = tid
            while lane < h:
                s_a[lane] += s_a[lane + h]
                if kind == MINMAX_U8:
                    s_b[lane] = min(s_b[lane], s_b[lane + h])
                    s_c[lane] = max(s_c[lane], s_c[lane + h])
                lane += RTHREADS
            cuda.syncthreads()
            h //= 2
        if tid == 0:
            if kind == MINMAX_U8:
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
        if kind == MINMAX_U8:
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
def _encode_minmax_kernel(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, seg_len, starts,
                          ends, scales, codes):
    nb = starts.shape[1] - 1
    tiles = (seg_len + THREADS - 1) // THREADS  # a tile of one row per block: its row found once
    t = cuda.blockIdx.x
    while t < starts.shape[0] * tiles:
        r, i = _tile_element(t, tiles)
        t += cuda.gridDim.x
        if i >= seg_len:
            continue
        e = r * seg_len + i
        g = r * nb + _block_at(starts, r, i)
        smin = float64(scales[2 * g])
        rng = float64(scales[2 * g + 1]) - smin
        inv = 255.0 / rng if rng > 0 else 0.0
        v = _value(mode, op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, st, e)
        q = min(max(_round_half_even((float64(v) - smin) * inv), 0.0), 255.0)
        if i >= ends[r]:
            q = 0.0  # padding: defined bytes on the wire
        codes[r, i] = q
        dec = float32(smin + q * (rng / 255.0))
        if i >= ends[r]:
            pass
        elif mode == ERROR_FEEDBACK:
            st[e] = v - dec
        elif mode == MARKOV:
            st[e] += dec


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


def _readable(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels read ``t`` where it is: None, or a contiguous ``dtype`` tensor on ``device``."""
    return t is None or (t.device == device and t.dtype == dtype and t.is_contiguous())


def accepts(x) -> bool:
    """Whether ``reduce``/``encode`` read ``x`` where it is (else the caller materialises it): a tensor, or a
    :class:`~..source.Source` whose tensors are contiguous fp32 (int64 mask) on one CUDA device (the CPU
    under the simulator)."""
    if not isinstance(x, Source):
        return True
    device = x.device
    ends = x.end if isinstance(x.end, tuple) else (x.end,)
    mask = x.mask if x.mask is not None and x.mask.numel() else None
    return (device.type == ("cpu" if SIMULATED else "cuda")
            and all(_readable(t, device, torch.float32) for t in (x.start, *ends))
            and _readable(mask, device, torch.int64) and (mask is None or mask.dim() == 1)
            # |0 * end| of a masked position needs an end (materialize() raises without one)
            and (mask is None or x.masked == "zero" or x.end is not None))


def accepts_sink(sink) -> bool:
    """``decode`` applies no :class:`~..source.Sink`: the caller applies it to the decoded values."""
    return False


def _reciprocal_division(device: torch.device) -> bool:
    """Whether torch divides a tensor on ``device`` by a Python float as ``a * (1 / b)`` with the fp32
    reciprocal (its CUDA kernel does: RECIPROCAL), or divides (the CPU: QUOTIENT)."""
    return device.type == "cuda"


def _expression(src: Source) -> tuple:
    """(op, start, end, group bounds, factors, mask) of ``src``'s expression as kernel arrays, made once per
    expression (its windows share them, as they share its materialised value): per-group ``end`` tensors
    gathered into one flat buffer, the groups' bounds and factors copied to the device."""
    root = src._root
    arrays = root.__dict__.get("_kernel_arrays")
    if arrays is None:
        device = root.device
        f32 = torch.empty(0, dtype=torch.float32, device=device)
        op = _OP[root.op]
        start = f32 if root.start is None else root.start.reshape(-1)
        end = f32 if root.end is None else root.flat_end()  # per-group tensors: gathered here, once
        factors = f32
        if root.factors is not None:
            fs = np.array(root.factors, np.float32)
            if op == QUOTIENT and _reciprocal_division(device):
                op = RECIPROCAL
                with np.errstate(divide="ignore"):
                    fs = np.float32(1.0) / fs  # torch's fp32 reciprocal of float32(divisor)
            factors = torch.from_numpy(fs).to(device)
        bounds = torch.tensor((*root.groups, root.valid), dtype=torch.int64).to(device)
        mask = root.mask if root.mask is not None and root.mask.numel() else torch.empty(0, dtype=torch.int64,
                                                                                          device=device)
        arrays = root.__dict__["_kernel_arrays"] = (op, *(_arr(t) for t in (start, end, bounds, factors, mask)))
    return arrays


def _input(x, device: torch.device) -> tuple:
    """The kernels' arguments for the input ``x``, a tensor or a :class:`~..source.Source`:
    ``(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset)`` (see :func:`_source_at`)."""
    if isinstance(x, Source):
        op, start, end, bounds, factors, mask = _expression(x)
        return op, start, end, bounds, np.float32(x.weight), factors, mask, x.masked == "nonfinite", x.valid, x.base
    f32 = _arr(torch.empty(0, dtype=torch.float32, device=device))
    i64 = _arr(torch.empty(0, dtype=torch.int64, device=device))
    return TENSOR, _arr(x), f32, i64, np.float32(0.0), f32, i64, False, x.numel(), 0


def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    device = x.device
    with _on(device):
        t_row, t_lo, t_hi, ptr = _geometry(layout, device, "tiles", lambda: layout.reduce_tiles(REDUCE_TILE))
        width = 1 if is_sign(kind) else 3
        partials = torch.empty(t_row.numel(), width, dtype=torch.float64, device=device)
        totals = torch.empty(layout.nblocks, width, dtype=torch.float64, device=device)
        src = _input(x, device)
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
        args = (mode, *_input(x, device), _state(st, device), layout.seg_len, *_starts(layout, device),
                _arr(scales.reshape(-1).contiguous()), _codes_arr(codes))
        if is_sign(kind):
            _encode_sign_kernel[_grid(tiles, 1), THREADS, _stream(device)](*args)
        else:
            _encode_minmax_kernel[_grid(tiles, 1), THREADS, _stream(device)](*args)


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
        "_encode_minmax_kernel": encode_args,
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

"""Payload sources in the numba CPU kernels: a tile of the expression, written to a scratch buffer.

A :class:`~lightning_onebit.compress.source.Source` reaches the kernels as a tuple of arrays
(:func:`pack`); :func:`fill` writes the source's values at positions ``[pos, pos + n)`` into a
tile-sized scratch buffer, which the reduction or the encode then reads from the cache. Each
value is computed with torch's operations and roundings (``lerp`` as ``fma(w, end - start,
start)``, then ``* factor``; ``start / factor``), so the result has the bits of
``Source.materialize``. The server stage's input, the mean of the workers' decoded rows, is a
source too (:data:`ROWS_MEAN`): it is decoded tile by tile instead of into a buffer of its own.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit

from ..source import Sink, Source
from .numba_common import first_at_least
from .numba_decode import rows_mean
from .numba_intrinsics import f32_at, fma32
from .numba_tiles import CH, ahead, block_at

# numba's codes of the source operations (Source.op), and of the two inputs that are not expressions
TENSOR, LERP, GRADIENT, QUOTIENT, ROWS_MEAN = 0, 1, 2, 3, 4
_OP = {"lerp": LERP, "gradient": GRADIENT, "quotient": QUOTIENT}

_F32_0 = np.zeros(0, np.float32)
_I64_0 = np.zeros(0, np.int64)
_U8_00 = np.zeros((0, 0), np.uint8)
_F32_00 = np.zeros((0, 0), np.float32)
NO_ROWS = (_U8_00, _F32_00, _I64_0, 0)
#: fp32 of scratch a kernel adds to its fill buffer (``SUB + SCRATCH``): the rows' table of means
SCRATCH = 16


def _cpu_f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def readable(src: Source) -> bool:
    """Whether the kernels can read ``src`` where it is (CPU, fp32, contiguous tensors)."""
    ends = src.end_tensors() if src.end is not None else []
    return all(_cpu_f32(t) for t in (src.start, src.mask if src.mask is None else None, *ends))


def pack(x) -> tuple:
    """The kernels' tuple for a tensor or a :class:`Source`:
    ``(op, x, start, end, end_addresses, group_bounds, weight, factors, mask, mask_nonfinite, valid, base)``.
    A source's per-group ``end`` goes as addresses (0: no tensor, zeros); the caller keeps the
    source (and so its tensors) alive while the kernel runs."""
    if not isinstance(x, Source):
        a = x.reshape(-1).numpy()
        return (TENSOR, a, _F32_0, _F32_0, _I64_0, _I64_0, np.float32(0), _F32_0, _I64_0, False, a.size, 0)
    bounds = np.array((*x.groups, x.valid), np.int64)
    if isinstance(x.end, torch.Tensor):
        end, addr = x.end.reshape(-1).numpy(), _I64_0
    elif x.end is not None:
        end = _F32_0
        addr = np.array([0 if t is None or t.numel() == 0 else t.data_ptr() for t in x.end], np.int64)
    else:
        end, addr = _F32_0, _I64_0
    start = x.start.reshape(-1).numpy() if x.start is not None else _F32_0
    factors = np.array(x.factors, np.float32) if x.factors is not None else _F32_0
    mask = x.mask.numpy() if x.mask is not None and x.mask.numel() else _I64_0
    return (_OP[x.op], _F32_0, start, end, addr, bounds, np.float32(x.weight), factors, mask,
            x.masked == "nonfinite", x.valid, x.base)


def rows(codes: np.ndarray, scales: np.ndarray, starts_r: np.ndarray, end_r: int) -> tuple:
    """The kernels' tuple for the mean over message rows (op ROWS_MEAN)."""
    return (codes, scales, starts_r, end_r)


def mean_of_rows() -> tuple:
    """The source tuple that says: read the rows' mean (see :func:`rows`)."""
    return (ROWS_MEAN, _F32_0, _F32_0, _F32_0, _I64_0, _I64_0, np.float32(0), _F32_0, _I64_0, False, 0, 0)


#: The group k of a position (bounds[k] <= pos < bounds[k + 1]; bounds: the groups' starts, then the end)
_group_at = block_at
_first_at_least = njit(inline="always", cache=True)(first_at_least)


@njit(inline="always", cache=True)
def _lerp(w, a, b):
    # torch's CPU lerp (ATen's lerp_vec): the smaller weight's form, one fused multiply-add
    if abs(w) < np.float32(0.5):
        return fma32(w, b - a, a)
    return fma32(w - np.float32(1.0), b - a, b)


@njit(inline="always", cache=True)
def _lerp_run(w, a, b, out):
    n = out.size
    small = abs(w) < np.float32(0.5)  # decided once: a branch in the loop would keep LLVM from vectorising
    c = w if small else w - np.float32(1.0)
    for k in range(n // CH):
        o = k * CH
        ahead(a, o)
        ahead(b, o)
        ac, bc, oc = a[o:o + CH], b[o:o + CH], out[o:o + CH]
        if small:
            for j in range(CH):
                oc[j] = fma32(c, bc[j] - ac[j], ac[j])
        else:
            for j in range(CH):
                oc[j] = fma32(c, bc[j] - ac[j], bc[j])
    for j in range(n - n % CH, n):
        out[j] = _lerp(w, a[j], b[j])


@njit(inline="always", cache=True)
def _lerp_to_zero(w, a, out):
    zero = np.float32(0.0)
    for j in range(out.size):
        out[j] = _lerp(w, a[j], zero)


@njit(inline="always", cache=True)
def _end_at(end, addr, bounds, i):
    """The source's ``end`` at position i (0.0 where its group has no tensor)."""
    if addr.size == 0:
        return end[i]
    k = _group_at(bounds, i)
    if addr[k] == 0:
        return np.float32(0.0)
    return carray(f32_at(addr[k]), (bounds[k + 1] - bounds[k],))[i - bounds[k]]


@njit(inline="always", cache=True)
def _expression(op, start, end, addr, bounds, w, factors, pos, n, out):
    """out[:n] = the expression at positions [pos, pos + n), all inside the data."""
    i = 0
    k = _group_at(bounds, pos)
    while i < n:
        e = min(n, bounds[k + 1] - pos)
        o = out[i:e]
        lo, hi = pos + i, pos + e  # positions of this group's run
        if op == QUOTIENT:
            f = factors[k]
            a = start[lo:hi]
            for j in range(e - i):
                o[j] = a[j] / f
        else:
            have = addr.size == 0 or addr[k] != 0
            if addr.size == 0 or addr[k] == 0:
                b = end[lo:hi]  # with no tensor for this group: an empty slice, unread
            else:
                b = carray(f32_at(addr[k]), (bounds[k + 1] - bounds[k],))[lo - bounds[k]:hi - bounds[k]]
            if op == LERP:
                if have:
                    _lerp_run(w, start[lo:hi], b, o)
                else:
                    _lerp_to_zero(w, start[lo:hi], o)
                if factors.size:
                    f = factors[k]
                    for j in range(e - i):
                        o[j] = o[j] * f
            elif have:
                o[:] = b  # a copy streams memory without a prefetch (see numba_intrinsics)
            else:
                o[:] = 0.0
        i = e
        k += 1


@njit(cache=True)
def _mask(end, addr, bounds, mask, nonfinite, p, m, out):
    """Masked positions in [p, p + m) (``mask`` sorted, found by bisection) get |0 * end| or 0. Not
    inlined: the rare branch kept out of the fill's loops lets LLVM vectorise them (the masked
    payloads of ``benchmarks/optimizer_step.py --embedding`` run it)."""
    lo = _first_at_least(mask, p)
    while lo < mask.size and mask[lo] < p + m:
        i = mask[lo]
        out[i - p] = abs(_end_at(end, addr, bounds, i) * np.float32(0.0)) if nonfinite else 0.0
        lo += 1


@njit(cache=True)
def _rows_mean(kind, rws, pos, n, out, lut):
    mc, ms, starts_r, end_r = rws
    rows_mean(kind, mc, ms, starts_r, end_r, pos, pos + n, out, lut)


@njit(cache=True)
def fill(src, rws, kind, pos, n, buf):
    """The source's values at positions [pos, pos + n) of its window (its ``base`` added): a view
    of the tensor itself for op TENSOR, else ``buf[:n]`` filled (0 past the data); the last
    ``SCRATCH`` elements of ``buf`` are scratch, after ``n``.

    Not inlined into the kernels: called once per few hundred elements, a call costs nothing
    measurable, while inlining the expression into every kernel made numba's compile of each one
    many times longer, and the kernel's loops see an array returned by a call, never one of two
    arrays, which LLVM would not vectorise (and once compiled wrongly, reading a state it had
    already written)."""
    op, x, start, end, addr, bounds, w, factors, mask, mask_nonfinite, valid, base = src
    if op == TENSOR:
        return x[pos:pos + n]
    out = buf[:n]
    if op == ROWS_MEAN:
        _rows_mean(kind, rws, pos, n, out, buf[buf.size - SCRATCH:])
        return out
    p = base + pos
    m = min(n, max(valid - p, 0))
    if m > 0:
        _expression(op, start, end, addr, bounds, w, factors, p, m, out)
    out[m:] = 0.0
    if mask.size and m > 0:
        _mask(end, addr, bounds, mask, mask_nonfinite, p, m, out)
    return out


# --- sinks ------------------------------------------------------------------------------------------


def sink_readable(snk: Sink) -> bool:
    """Whether the decode kernel can apply ``snk`` (CPU fp32 contiguous tensors)."""
    return all(_cpu_f32(t) for t in (snk.denom, *snk.targets)) and (snk.mask is None or snk.mask.device.type == "cpu")


def pack_sink(snk: Sink | None) -> tuple:
    """The decode kernel's tuple for a :class:`Sink` (``valid`` 0: none):
    ``(target_addresses, group_bounds, values, decay, denom, mask, base, valid)``."""
    if snk is None:
        return (_I64_0, _I64_0, _F32_0, np.float32(1.0), _F32_0, _I64_0, 0, 0)
    addr = np.array([0 if t is None or t.numel() == 0 else t.data_ptr() for t in snk.targets], np.int64)
    return (addr, np.array((*snk.groups, snk.valid), np.int64), np.array(snk.values, np.float32),
            np.float32(snk.decay), snk.denom.reshape(-1).numpy(),
            snk.mask.numpy() if snk.mask is not None else _I64_0, snk.base, snk.valid)


@njit(inline="always", cache=True)
def _addcdiv_run(t, u, d, decay, v):
    """t = t * decay + (v * u) / d, each operation rounded to fp32 (torch's addcdiv order)."""
    n = t.size
    whole = n - n % CH  # chunks of CH elements, then the tail one by one
    for o in range(0, whole, CH):
        ahead(t, o)
        ahead(d, o)
        tc, uc, dc = t[o:o + CH], u[o:o + CH], d[o:o + CH]
        for j in range(CH):
            tc[j] = tc[j] * decay + (v * uc[j]) / dc[j]
    for j in range(whole, n):
        t[j] = t[j] * decay + (v * u[j]) / d[j]


@njit(cache=True)
def apply_sink(snk, pos, vals):
    """The sink on decoded values ``vals`` at positions [pos, pos + vals.size) of its window."""
    addr, bounds, values, decay, denom, mask, base, valid = snk
    p = base + pos
    m = min(vals.size, max(valid - p, 0))
    if m <= 0:
        return
    if mask.size:
        _mask(vals, _I64_0, bounds, mask, False, p, m, vals)
    i = 0
    k = _group_at(bounds, p)
    while i < m:
        e = min(m, bounds[k + 1] - p)
        if addr[k] != 0:
            whole = carray(f32_at(addr[k]), (bounds[k + 1] - bounds[k],))
            _addcdiv_run(whole[p + i - bounds[k]:p + e - bounds[k]], vals[i:e], denom[p + i:p + e], decay, values[k])
        i = e
        k += 1

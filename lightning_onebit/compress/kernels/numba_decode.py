"""Decoding in the numba CPU backend, per tile: sign and min-max codes, and the mean of several rows
(the server's input, decoded into a buffer or inside its reduction and encode). The summation order
of a mean is fixed: workers 0..n-1 in fp64, then / n, as every backend sums them. Inlined into the
kernels of :mod:`.numba_cpu` and the sources of :mod:`.numba_source`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .layout import FORMATS, KIND_BITS, KIND_TOP, MINMAX_U2, MINMAX_U4, MINMAX_U8
from .numba_tiles import block_at

_F32 = np.float32
# the packed widths the decode loops are written for (ints: numba compiles them in as constants)
_U4_BITS, _U4_TOP = FORMATS[MINMAX_U4].bits, FORMATS[MINMAX_U4].top
_U2_BITS, _U2_TOP = FORMATS[MINMAX_U2].bits, FORMATS[MINMAX_U2].top


# --- decode -------------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def sign_run(cw, s, p, q, out):
    """out[0 : q - p] = decode of elements [p, q) of a row whose codes are cw, all with scale s."""
    i, k = p, 0
    while i < q and i & 7:  # head up to a byte boundary
        out[k] = s if (cw[i >> 3] >> (i & 7)) & 1 else -s
        i += 1
        k += 1
    nbytes = (q - i) >> 3
    cs = cw[i >> 3 : (i >> 3) + nbytes]
    o = out[k : k + 8 * nbytes]
    ns = -s
    bits = np.empty(256, np.uint8)
    for c in range(nbytes >> 5):  # 32 bytes at a time: their bits as bytes, then a select (both
        cc = cs[32 * c : 32 * c + 32]  # vectorise; benchmarks/optimizer_step.py times the decode)
        for m in range(32):
            byte = cc[m]
            for j in range(8):
                bits[8 * m + j] = (byte >> np.uint8(j)) & np.uint8(1)
        oc = o[256 * c : 256 * c + 256]
        for j in range(256):
            oc[j] = s if bits[j] else ns
    for m in range(nbytes - nbytes % 32, nbytes):
        byte = cs[m]
        for j in range(8):
            o[8 * m + j] = s if (byte >> j) & 1 else ns
    i += 8 * nbytes
    k += 8 * nbytes
    while i < q:
        out[k] = s if (cw[i >> 3] >> (i & 7)) & 1 else -s
        i += 1
        k += 1


@njit(inline="always", cache=True)
def code_at(cw, i, bits, top):
    """The ``bits``-bit code of element i of a row whose packed codes are cw (``top``: the largest)."""
    at = i * bits
    return (cw[at >> 3] >> (at & 7)) & top


@njit(inline="always", cache=True)
def mm_code(kind, cw, i):
    """The code of element i of a row whose codes are cw, packed at the kind's width (layout.FORMATS)."""
    bits = KIND_BITS[kind]
    if bits == 8:
        return cw[i]
    return code_at(cw, i, bits, KIND_TOP[kind])


@njit(inline="always", cache=True)
def mm_top(kind):
    """The largest code of ``kind`` as a float (the divisor of a min-max decode)."""
    return np.float64(KIND_TOP[kind])


@njit(inline="always", cache=True)
def _packed_dec_run(cw, smin, step, p, q, out, bits, top):
    for i in range(q - p):
        out[i] = _F32(smin + np.float64(code_at(cw, p + i, bits, top)) * step)


@njit(inline="always", cache=True)
def minmax_dec_run(kind, cw, sc0, sc1, p, q, out):
    smin = np.float64(sc0)
    step = (np.float64(sc1) - smin) / mm_top(kind)
    bits = KIND_BITS[kind]
    if bits == 8:
        cs = cw[p:q]
        for i in range(q - p):
            out[i] = _F32(smin + np.float64(cs[i]) * step)
    # a loop per width, whose shifts are constants (LLVM vectorises it; a width read at run time it does not)
    elif bits == _U4_BITS:
        _packed_dec_run(cw, smin, step, p, q, out, _U4_BITS, _U4_TOP)
    elif bits == _U2_BITS:
        _packed_dec_run(cw, smin, step, p, q, out, _U2_BITS, _U2_TOP)
    else:  # another width of the table: right, if slower until it gets a loop of its own
        _packed_dec_run(cw, smin, step, p, q, out, bits, KIND_TOP[kind])


@njit(inline="always", cache=True)
def decode_run(kind, cw, sc, g, p, q, out):
    if kind >= MINMAX_U8:
        minmax_dec_run(kind, cw, sc[2 * g], sc[2 * g + 1], p, q, out)
    else:
        sign_run(cw, sc[g], p, q, out)


@njit(inline="always", cache=True)
def _sel(p, a, b):
    return b if p else a


@njit(inline="always", cache=True)
def mean_elem(kind, mc, ms, j, i):
    """Element i of the mean over the rows (workers 0..n-1 summed in order in fp64, then / n)."""
    nw = mc.shape[0]
    acc = 0.0
    for w in range(nw):
        if kind >= MINMAX_U8:
            smin = np.float64(ms[w, 2 * j])
            step = (np.float64(ms[w, 2 * j + 1]) - smin) / mm_top(kind)
            acc += np.float64(_F32(smin + np.float64(mm_code(kind, mc[w], i)) * step))
        else:
            s = ms[w, j]
            acc += np.float64(s if (mc[w, i >> 3] >> (i & 7)) & 1 else -s)
    return _F32(acc / nw)


@njit(inline="always", cache=True)
def mean_sign_lut(mc, ms, j, k0, nbytes, out, lut):
    """The mean of 1-4 sign rows over whole code bytes k0..k0+nbytes by table: with one scale per
    row and block, an element's mean is one of 2^n values fixed by its n sign bits. Each entry is
    computed exactly as mean_elem computes it, so the result is bit-identical; per element it is
    then a select tree instead of n fp64 additions. ``lut``: 16 fp32 of scratch."""
    nw = mc.shape[0]
    t = lut
    t[:] = 0.0
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
        b0, b1 = np.empty(256, np.uint8), np.empty(256, np.uint8)
        for c in range(nbytes >> 5):  # bits as bytes first, then the select (see sign_run)
            for k in range(32):
                x0, x1 = c0[32 * c + k], c1[32 * c + k]
                for b in range(8):
                    b0[8 * k + b] = (x0 >> np.uint8(b)) & np.uint8(1)
                    b1[8 * k + b] = (x1 >> np.uint8(b)) & m1
            oc = out[256 * c : 256 * c + 256]
            for j in range(256):
                oc[j] = (t3 if b0[j] else t2) if b1[j] else (t1 if b0[j] else t0)
        for k in range(nbytes - nbytes % 32, nbytes):
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
def mean_run(kind, mc, ms, j, p, q, out, lut):
    """out[0 : q - p] = mean over the rows of elements [p, q), all in block j."""
    nw = mc.shape[0]
    if kind < MINMAX_U8 and nw <= 4:
        i, k = p, 0
        while i < q and i & 7:
            out[k] = mean_elem(kind, mc, ms, j, i)
            i += 1
            k += 1
        nbytes = (q - i) >> 3
        mean_sign_lut(mc, ms, j, i >> 3, nbytes, out[k : k + 8 * nbytes], lut)
        i += 8 * nbytes
        k += 8 * nbytes
        while i < q:
            out[k] = mean_elem(kind, mc, ms, j, i)
            i += 1
            k += 1
        return
    n = q - p
    o = out[:n]
    if nw == 1:  # fp32 -> fp64 -> / 1 -> fp32 is exact: the row itself
        decode_run(kind, mc[0], ms[0], j, p, q, o)
        return
    acc = np.zeros(n, np.float64)
    for w in range(nw):
        decode_run(kind, mc[w], ms[w], j, p, q, o)
        for i in range(n):
            acc[i] += np.float64(o[i])
    for i in range(n):
        o[i] = _F32(acc[i] / nw)


@njit(inline="always", cache=True)
def rows_mean(kind, mc, ms, starts_r, end_r, lo, hi, buf, lut):
    """buf[0 : hi - lo] = the mean over the message rows of elements [lo, hi) of a row (padding from
    ``end_r``: 0), walking the scale blocks that meet it."""
    nb = starts_r.size - 1
    end = max(lo, min(hi, end_r))
    j = block_at(starts_r, lo)
    while j < nb and starts_r[j] < end:
        p, q = max(lo, starts_r[j]), min(end, starts_r[j + 1])
        if q > p:
            mean_run(kind, mc, ms, j, p, q, buf[p - lo : q - lo], lut)
        j += 1
    buf[end - lo : hi - lo] = 0.0

"""The per-tile arithmetic of the numba CPU backend: scale sums, sign and min-max codes, decoding.

Every function here works on one tile (a few thousand elements of one row, or of one scale
block) and is inlined into the parallel kernels of :mod:`.numba_cpu`. Loops run over slices from
index 0 in fixed-size chunks (``CH`` elements): with a provably non-negative index numba drops the
negative-index wraparound and LLVM vectorises, and each chunk prefetches the data ``PF`` elements
ahead (see :mod:`.numba_intrinsics`). The value encoded is ``v = xs + a * ss`` with ``a`` in
{0, 1, -1} (plain / error feedback / Markov), exact for every mode.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .layout import ERROR_FEEDBACK, MARKOV, MINMAX_U8, REDUCE_LANES, SIGN_L2
from .numba_intrinsics import prefetch

LANES = REDUCE_LANES
CH = 32  # elements per vectorised chunk: two 64-byte cache lines of fp32
PF = 1024  # prefetch distance in elements (4 KiB of fp32 per stream)
MM_LANES = 16  # independent min/max lanes: LLVM vectorises these, not a scalar min reduction
_F32 = np.float32


@njit(inline="always", cache=True)
def ahead(arr, i):
    """Prefetch the two cache lines of ``arr`` that a chunk ``PF`` elements after ``i`` reads."""
    prefetch(arr, i + PF)
    prefetch(arr, i + PF + 16)


# --- scale reductions ---------------------------------------------------------------------


@njit(inline="always", cache=True)
def _lanes_chunk(kind, a, xc, sc, acc):
    if kind == SIGN_L2:  # v * v is exact in fp64 (v is fp32): no rounding to fuse or reorder
        for j in range(LANES):
            v = np.float64(xc[j] + a * sc[j])
            acc[j] += v * v
    else:
        for j in range(LANES):
            acc[j] += abs(np.float64(xc[j] + a * sc[j]))


@njit(inline="always", cache=True)
def lanes_add(kind, a, xs, ss, acc):
    """Add v^2 (SIGN_L2) or |v| of elements i of xs, ss to lane i % LANES of ``acc`` (fp64), in order:
    a tile's canonical sum (see layout.REDUCE_*) accumulated over consecutive pieces of it, each
    piece but the last a multiple of LANES long."""
    n = xs.size
    one = np.float32(1.0)
    for c in range(n // LANES):
        o = c * LANES
        ahead(ss, o)
        # a constant a (error feedback's 1 above all) lets LLVM drop the multiply
        if a == one:
            _lanes_chunk(kind, one, xs[o:o + LANES], ss[o:o + LANES], acc)
        else:
            _lanes_chunk(kind, a, xs[o:o + LANES], ss[o:o + LANES], acc)
    m = n - n % LANES
    for j in range(n - m):
        v = np.float64(xs[m + j] + a * ss[m + j])
        acc[j] += v * v if kind == SIGN_L2 else abs(v)


@njit(inline="always", cache=True)
def lanes_add_plain(kind, xs, acc):
    """:func:`lanes_add` of v = xs (no state). A separate loop, not ``lanes_add(kind, 0, xs, xs)``:
    LLVM would merge the two copies into one loop over either array, which it does not vectorise."""
    n = xs.size
    for c in range(n // LANES):
        o = c * LANES
        ahead(xs, o)
        xc = xs[o:o + LANES]
        if kind == SIGN_L2:
            for j in range(LANES):
                v = np.float64(xc[j])
                acc[j] += v * v
        else:
            for j in range(LANES):
                acc[j] += abs(np.float64(xc[j]))
    m = n - n % LANES
    for j in range(n - m):
        v = np.float64(xs[m + j])
        acc[j] += v * v if kind == SIGN_L2 else abs(v)


@njit(inline="always", cache=True)
def lanes_total(acc):
    """The lanes combined by the canonical halving tree (``acc`` is overwritten)."""
    h = LANES // 2
    while h > 0:
        for j in range(h):
            acc[j] += acc[j + h]
        h //= 2
    return acc[0]


@njit(inline="always", cache=True)
def minmax_add(a, xs, ss, mn, mx, probe):
    """Fold the min, max and finiteness probe of v over xs, ss into the lanes mn, mx, probe (exact
    in any order; the probe only tells NaN from not)."""
    m = xs.size - xs.size % MM_LANES
    for c in range(m // MM_LANES):
        o = c * MM_LANES
        ahead(ss, o)
        xc, sc = xs[o:o + MM_LANES], ss[o:o + MM_LANES]
        for j in range(MM_LANES):
            v = xc[j] + a * sc[j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            probe[j] += v * np.float32(0.0)  # NaN iff some v is NaN or inf
    for i in range(m, xs.size):
        v = xs[i] + a * ss[i]
        mn[0] = v if v < mn[0] else mn[0]
        mx[0] = v if v > mx[0] else mx[0]
        probe[0] += v * np.float32(0.0)


@njit(inline="always", cache=True)
def minmax_add_plain(xs, mn, mx, probe):
    """:func:`minmax_add` of v = xs (no state; a loop of its own, see :func:`lanes_add_plain`)."""
    m = xs.size - xs.size % MM_LANES
    for c in range(m // MM_LANES):
        o = c * MM_LANES
        ahead(xs, o)
        xc = xs[o:o + MM_LANES]
        for j in range(MM_LANES):
            v = xc[j]
            mn[j] = v if v < mn[j] else mn[j]
            mx[j] = v if v > mx[j] else mx[j]
            probe[j] += v * np.float32(0.0)
    for i in range(m, xs.size):
        v = xs[i]
        mn[0] = v if v < mn[0] else mn[0]
        mx[0] = v if v > mx[0] else mx[0]
        probe[0] += v * np.float32(0.0)


# --- block walk ---------------------------------------------------------------------------------


@njit(inline="always", cache=True)
def block_at(starts_r, pos):
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
def sign_bits_run(mode, a, xs, ss, s, bits):
    """A run of elements that share the scale s: their signs (v = xs + a*ss >= 0 -> 1) into ``bits``
    (a uint8 each) and their state in the same loop (EF: ss = v - dec; Markov: ss += dec; plain and
    diff: none). One loop reads and writes the state: reading it in one pass and writing it in
    another let a parallel kernel compute codes from the updated state."""
    n = xs.size
    if mode == ERROR_FEEDBACK:
        for c in range(n // CH):
            o = c * CH
            ahead(xs, o)
            ahead(ss, o)
            xc, sc, bc = xs[o:o + CH], ss[o:o + CH], bits[o:o + CH]
            for j in range(CH):
                v = xc[j] + sc[j]
                pos = v >= 0
                bc[j] = pos
                sc[j] = v - s if pos else v + s
        for i in range(n - n % CH, n):
            v = xs[i] + ss[i]
            pos = v >= 0
            bits[i] = pos
            ss[i] = v - s if pos else v + s
    elif mode == MARKOV:
        for i in range(n):
            pos = xs[i] - ss[i] >= 0
            bits[i] = pos
            ss[i] += s if pos else -s
    else:
        for i in range(n):
            bits[i] = xs[i] + a * ss[i] >= 0


@njit(inline="always", cache=True)
def sign_bits_plain(xs, bits):
    """The signs of xs (no state) into ``bits`` (a loop of its own, see :func:`lanes_add_plain`)."""
    n = xs.size
    for c in range(n // CH):
        o = c * CH
        ahead(xs, o)
        xc, bc = xs[o:o + CH], bits[o:o + CH]
        for j in range(CH):
            bc[j] = xc[j] >= 0
    for i in range(n - n % CH, n):
        bits[i] = xs[i] >= 0


@njit(inline="always", cache=True)
def pack_bits(bits, n, cs):
    """Pack bits[0:n] (uint8 0/1) into the bytes cs, little-endian within a byte."""
    for k in range(n >> 3):
        bk = bits[8 * k:8 * k + 8]
        byte = np.uint8(0)
        for j in range(8):
            byte |= bk[j] << np.uint8(j)
        cs[k] = byte
    if n & 7:
        byte = np.uint8(0)
        for i in range(n & ~7, n):
            byte |= bits[i] << np.uint8(i & 7)
        cs[n >> 3] = byte


@njit(inline="always", cache=True)
def minmax_run_plain(xs, cs, sc0, sc1):
    """:func:`minmax_run` of v = xs, no state (a loop of its own, see :func:`lanes_add_plain`)."""
    smin = np.float64(sc0)
    rng = np.float64(sc1) - smin
    inv = 255.0 / rng if rng > 0 else 0.0
    for i in range(xs.size):
        cs[i] = np.uint8(min(max(np.rint((np.float64(xs[i]) - smin) * inv), 0.0), 255.0))


@njit(inline="always", cache=True)
def minmax_run(mode, a, xs, ss, cs, sc0, sc1):
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
    for c in range(nbytes >> 5):  # 32 bytes at a time: their bits as bytes, then a select (vectorises
        cc = cs[32 * c : 32 * c + 32]  # both ways: 3.4 against 7.6 ms for 17M values)
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
def minmax_dec_run(cw, sc0, sc1, p, q, out):
    smin = np.float64(sc0)
    step = (np.float64(sc1) - smin) / 255.0
    cs = cw[p:q]
    for i in range(q - p):
        out[i] = _F32(smin + np.float64(cs[i]) * step)


@njit(inline="always", cache=True)
def decode_run(kind, cw, sc, g, p, q, out):
    if kind == MINMAX_U8:
        minmax_dec_run(cw, sc[2 * g], sc[2 * g + 1], p, q, out)
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
        if kind == MINMAX_U8:
            smin = np.float64(ms[w, 2 * j])
            acc += np.float64(_F32(smin + np.float64(mc[w, i]) * ((np.float64(ms[w, 2 * j + 1]) - smin) / 255.0)))
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
    if kind != MINMAX_U8 and nw <= 4:
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

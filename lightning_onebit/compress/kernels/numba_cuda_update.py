"""1-bit LAMB's kernels a bucket: its momentum's shift, moments and layer statistics in one launch, its scaled step in
one (its layer factors, one launch a step between them, are :mod:`.numba_cuda_factors`'). Each writes nothing unless
its ``go`` flag holds (a step the device decided to skip).

**The moments and layer statistics** (``lamb_stats``): with the momentum and the previous one given (or the momentum
and the synced one, shifted in first: ``prev <- m``, ``m <- synced / divisor``, as
``optim.functional_lamb.shift_in_``), each element's ``w = m - beta1 m_prev``, fresh variance
``f <- f beta2 + c w^2`` and update ``u = (m / d) * (1 / bc)`` (0 where masked) are written as they are read, in the
CPU kernel's roundings (``optim.functional_lamb``'s numba kernel: fused multiply-adds, IEEE's division), so a GPU
gives the CPU's bits; then for every parameter k of the bucket, ``max(d / d_fresh)`` over its elements and, with
weight decay, ``<u, u>``, ``<u, p>`` and ``<p, p>``, into a ``[4, layers]`` fp32 buffer that stays on the device (or
those columns of a group's). It replaces eleven torch ops on the bucket's buffers, a segmented maximum (CUB's, one
thread block a layer: a 16M-element layer is one SM's work) and three dot products a parameter with their stacks (an
allocation each). The sums follow :mod:`.layout`'s summation order, per layer instead of per scale block: tiles of
``REDUCE_TILE`` elements from the layer's first, ``REDUCE_LANES`` lanes each summing its strided elements in order
in fp64, the halving tree, the tiles in order (by the thread block that finishes a layer's last tile), one rounding
to fp32 at the end - so the result does not depend on the GPU, the grid or the simulator's thread count, and is
closer to the exact value than an fp32 dot product. The ratio ``d / d_fresh`` is rounded as torch rounds it
(``sqrt(f + eps)`` or ``sqrt(f) + eps``, then the division, each in fp32, correctly rounded); a maximum is exact,
and a NaN ratio makes the layer's maximum NaN, as torch's.

**The scaled step** (``scaled_step``): ``p <- p * decay_k - s_k * u`` for every parameter k. The step sizes and
decays are fp32 arrays on the device, computed there from the layer statistics, so the host never reads them; the
update ``u`` is the bucket's flat buffer, and the parameters, separate tensors, are reached through the address
table of :mod:`.numba_cuda_sink`. Each element is rounded as the CPU reference
(:func:`~lightning_onebit.optim.functional_lamb.scaled_step_`): ``p * decay`` (``fmul_rn``, never contracted), then
one fused multiply-add ``fma(-s, u, .)``, so a GPU gives the CPU's bits. Against the torch ops it replaces (a
``mul_`` and an ``add_`` a parameter) it is one pass over the bucket instead of two a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from numba import cuda, float32, float64, int32

from .layout import REDUCE_LANES, REDUCE_TILE
from .numba_cuda_kernels import RTHREADS, THREADS
from .numba_cuda_launch import _grid, _launcher, _on, _stream
from .numba_cuda_sink import address_tables, f32_load, f32_store
from .numba_cuda_source import (
    SIMULATED,
    _div32,
    _extremum,
    _fma32,
    _group_at,
    _in_sorted,
    _mul32,
    arr,
    empty_arrays,
    go_array,
    last_at_most,
    memo,
)

__all__ = ["lamb_stats", "scaled_step"]

LANES = REDUCE_LANES

if SIMULATED:  # numpy fp32 scalars; a square root of an fp32 value rounded twice (fp64, then fp32) is exact

    @cuda.jit(device=True)
    def _ratio32(d, f, eps, inside):
        df = float32(math.sqrt(float32(f + eps))) if inside else float32(float32(math.sqrt(f)) + eps)
        return float32(d / df)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _ratio32(d, f, eps, inside):
        # torch's fp32 ops, each correctly rounded: never contracted or approximated
        if inside:
            df = libdevice.fsqrt_rn(libdevice.fadd_rn(f, eps))
        else:
            df = libdevice.fadd_rn(libdevice.fsqrt_rn(f), eps)
        return libdevice.fdiv_rn(d, df)


@cuda.jit(device=True, inline=True)
def _moments_at(m, prev, f, d, u, mask, synced, divisors, shift, nb, c, b2, eps, inside, inv_bc, i, k):
    """Element i of 1-bit LAMB's moments, in the CPU kernel's roundings (``functional_lamb._lamb_stats``):
    ``w = m - beta1 prev`` and ``f <- f b2 + c w^2`` by fused multiply-adds, ``u = (m / d) * (1 / bc)`` (0 where
    ``mask`` holds i); writes ``f`` and ``u``, returns the new ``f``. With ``shift`` the momentum is shifted in
    first, as ``functional_lamb.shift_in_`` and the mask's fill do it: ``prev <- m``, ``m <- synced / divisors[k]``
    (IEEE's division; 0 where masked)."""
    masked = mask.size and _in_sorted(mask, i)
    if shift:
        mp = m[i]
        mi = float32(0.0) if masked else _div32(synced[i], divisors[k])
        prev[i] = mp
        m[i] = mi
    else:
        mp = prev[i]
        mi = m[i]
    w = _fma32(nb, mp, mi)
    fi = _fma32(_mul32(c, w), w, _mul32(f[i], b2))
    f[i] = fi
    if masked:
        u[i] = float32(0.0)
    else:
        u[i] = _mul32(_div32(mi, d[i]), inv_bc)
    return fi


@cuda.jit(cache=True)
def _lamb_stats_kernel(addr, bounds, u, d, f, m, prev, mask, synced, divisors, shift, go, nb, c, b2, eps, inside,
                       inv_bc, moments, dots, t_lo, t_hi, ptr, partials, count, out, col0):
    """Each layer's ``[max d / d_fresh, <u, u>, <u, p>, <p, p>]`` into ``out[:, col0 + k]`` (the dot products only
    with ``dots``), with ``moments`` after writing each element's moments (``_moments_at``) as it is read. Tile
    t (``t_lo[t]:t_hi[t]``, inside one layer) is summed by one thread block into ``partials[t]``; the block that
    finishes layer k's last tile (``count[k]``, tiles done, counted atomically after a fence and zeroed again)
    combines its tiles in order, reading them through atomics (the L2 copy), as ``_reduce_scales_kernel`` does.
    Layers without elements get ``-inf, 0, 0, 0``. Nothing is written unless ``go[0]`` (a step the device
    decided to skip)."""
    if not go[0]:  # uniform: every block returns before its first barrier
        return
    s_r = cuda.shared.array(LANES, float64)
    s_uu = cuda.shared.array(LANES, float64)
    s_up = cuda.shared.array(LANES, float64)
    s_pp = cuda.shared.array(LANES, float64)
    last = cuda.shared.array(1, int32)
    tid = cuda.threadIdx.x
    nl = ptr.size - 1
    if tid == 0:
        k = cuda.blockIdx.x
        while k < nl:
            if ptr[k] == ptr[k + 1]:
                out[0, col0 + k] = -math.inf
                if dots:
                    out[1, col0 + k] = 0.0
                    out[2, col0 + k] = 0.0
                    out[3, col0 + k] = 0.0
            k += cuda.gridDim.x
    t = cuda.blockIdx.x
    while t < t_lo.size:  # grid-stride over tiles; uniform per block
        k = last_at_most(ptr, t)
        a = addr[k]
        base = bounds[k]
        lane = tid
        while lane < LANES:  # lane j: elements j, j + LANES, ... of the tile, in order
            mx = -math.inf
            uu = 0.0
            up = 0.0
            pp = 0.0
            i = t_lo[t] + lane
            while i < t_hi[t]:
                if moments:
                    fi = _moments_at(m, prev, f, d, u, mask, synced, divisors, shift, nb, c, b2, eps, inside, inv_bc,
                                     i, k)
                else:
                    fi = f[i]
                mx = _extremum(mx, float64(_ratio32(d[i], fi, eps, inside)), True)
                if dots:
                    x = float64(u[i])
                    q = float64(f32_load(a, i - base)) if a != 0 else 0.0
                    uu += x * x  # products of fp32 values are exact in fp64: a contraction rounds alike
                    up += x * q
                    pp += q * q
                i += LANES
            s_r[lane] = mx
            s_uu[lane] = uu
            s_up[lane] = up
            s_pp[lane] = pp
            lane += RTHREADS
        cuda.syncthreads()
        h = LANES // 2
        while h > 0:
            lane = tid
            while lane < h:
                s_r[lane] = _extremum(s_r[lane], s_r[lane + h], True)
                s_uu[lane] += s_uu[lane + h]
                s_up[lane] += s_up[lane + h]
                s_pp[lane] += s_pp[lane + h]
                lane += RTHREADS
            cuda.syncthreads()
            h //= 2
        if tid == 0:
            partials[t, 0] = s_r[0]
            partials[t, 1] = s_uu[0]
            partials[t, 2] = s_up[0]
            partials[t, 3] = s_pp[0]
            cuda.threadfence()  # this tile's partial visible before it is counted
            done = cuda.atomic.add(count, k, 1)
            last[0] = k if done == ptr[k + 1] - ptr[k] - 1 else -1
        cuda.syncthreads()
        k = last[0]
        if k >= 0:  # uniform per block: this tile was its layer's last
            cuda.threadfence()
            mx = -math.inf
            uu = 0.0
            up = 0.0
            pp = 0.0
            j0 = ptr[k]  # (not c: the moments' coefficient)
            while j0 < ptr[k + 1]:  # LANES partials at a time read by the threads, combined in order by thread 0
                lane = tid
                while lane < LANES:
                    if j0 + lane < ptr[k + 1]:
                        s_r[lane] = cuda.atomic.add(partials, (j0 + lane, 0), 0.0)
                        s_uu[lane] = cuda.atomic.add(partials, (j0 + lane, 1), 0.0)
                        s_up[lane] = cuda.atomic.add(partials, (j0 + lane, 2), 0.0)
                        s_pp[lane] = cuda.atomic.add(partials, (j0 + lane, 3), 0.0)
                    lane += RTHREADS
                cuda.syncthreads()
                if tid == 0:
                    for q in range(min(LANES, ptr[k + 1] - j0)):
                        mx = _extremum(mx, s_r[q], True)
                        uu += s_uu[q]
                        up += s_up[q]
                        pp += s_pp[q]
                cuda.syncthreads()
                j0 += LANES
            if tid == 0:
                count[k] = 0
                out[0, col0 + k] = float32(mx)
                if dots:
                    out[1, col0 + k] = float32(uu)
                    out[2, col0 + k] = float32(up)
                    out[3, col0 + k] = float32(pp)
        cuda.syncthreads()
        t += cuda.gridDim.x


@cuda.jit
def _scaled_step_kernel(addr, bounds, u, steps, decays, go, valid):
    if not go[0]:
        return
    e = cuda.grid(1)
    stride = cuda.gridsize(1)
    while e < valid:
        k = _group_at(bounds, e)
        a = addr[k]
        if a != 0:
            j = e - bounds[k]
            f32_store(a, j, _fma32(-steps[k], u[e], _mul32(f32_load(a, j), decays[k])))
        e += stride


def _check_flat(name: str, t: torch.Tensor, device: torch.device, numel: int | None = None) -> None:
    if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name} must be a 1-d contiguous fp32 tensor on {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, the update {numel}")


def _check_params(what: str, params: Sequence[torch.Tensor | None], offsets: Sequence[int], valid: int,
                  device: torch.device) -> None:
    # the kernels reach the parameters through raw addresses: another size or layout would be read or written
    # out of bounds
    for p, lo, hi in zip(params, offsets, (*offsets[1:], valid), strict=True):
        if p is not None and (p.numel() != hi - lo or p.dtype != torch.float32 or not p.is_contiguous()
                              or p.device != device):
            raise ValueError(f"{what}: parameters must be contiguous fp32 tensors on {device} of their offsets' "
                             f"sizes; got {p.dtype} {tuple(p.shape)} for {hi - lo} elements")


_GEOMETRY: dict = {}


def _stats_geometry(offsets: Sequence[int], valid: int, device: torch.device) -> tuple:
    """(tile starts, tile ends, each layer's first tile, partials, counters) of ``lamb_stats`` as kernel arrays,
    made once per geometry: tiles of ``REDUCE_TILE`` elements from each layer's first element. The partials and
    counters are scratch of the launches on this geometry (in stream order; every launch zeroes its counters)."""
    key = (tuple(offsets), valid, str(device))

    def make():
        lo, hi, ptr = [], [], [0]
        for a, b in zip(offsets, (*offsets[1:], valid), strict=True):
            starts = range(a, b, REDUCE_TILE)
            lo += starts
            hi += [min(s + REDUCE_TILE, b) for s in starts]
            ptr.append(len(lo))
        tensors = [torch.tensor(v, dtype=torch.int64).to(device) for v in (lo, hi, ptr)]
        tensors += [torch.zeros(max(len(lo), 1), 4, dtype=torch.float64, device=device),
                    torch.zeros(max(len(offsets), 1), dtype=torch.int32, device=device)]
        return (tensors, *(arr(t) for t in tensors), len(lo))

    return memo(_GEOMETRY, key, make, 256)[1:]


def lamb_stats(params: Sequence[torch.Tensor | None], update: torch.Tensor, denom: torch.Tensor,
               fresh: torch.Tensor, offsets: Sequence[int], out: torch.Tensor, *, eps: float,
               eps_inside_sqrt: bool, exp_avg: torch.Tensor | None = None, prev: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, beta1: float = 0.0, beta2: float = 0.0,
               bias_correction: float = 1.0, synced: torch.Tensor | None = None,
               divisors: torch.Tensor | None = None, go: torch.Tensor | None = None, column: int = 0) -> torch.Tensor:
    """Each parameter's ``[max(denom / d_fresh), <u, u>, <u, p>, <p, p>]`` into the columns of ``out`` (fp32,
    ``[4, len(params)]``; ``[1, len(params)]``: the maxima alone; or wider, its columns from ``column`` on: a
    buffer that gathers several buckets' statistics) on torch's current stream, with
    ``d_fresh = sqrt(fresh + eps)`` (``eps_inside_sqrt``) or ``sqrt(fresh) + eps``. ``update``, ``denom``, ``fresh``:
    the bucket's flat fp32 buffers; ``params``: contiguous fp32 tensors laid out at ``offsets`` in them (None
    for one without elements). With ``exp_avg`` and ``prev`` (the momentum and the previous one, flat) the same
    launch first writes ``fresh`` and ``update`` (0 at the sorted int64 positions ``mask``) element by element, in
    the CPU kernel's roundings (``optim.functional_lamb.lamb_moments_``); with ``synced`` too (flat) and
    ``divisors`` (fp32, one a parameter) it first shifts the momentum in, ``prev <- exp_avg``,
    ``exp_avg <- synced / divisors[k]`` (0 at ``mask``), as ``functional_lamb.shift_in_`` does. ``go`` (a
    one-element bool tensor): nothing is written unless it holds (a step the device decided to skip). Returns
    ``out``."""
    device = update.device
    valid = update.numel()
    _check_flat("lamb_stats: update", update, device)
    _check_flat("lamb_stats: denom", denom, device, valid)
    _check_flat("lamb_stats: fresh", fresh, device, valid)
    if len(offsets) != len(params):
        raise ValueError("lamb_stats needs one offset a parameter")
    if (out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] not in (1, 4) or column < 0
            or out.shape[1] < column + len(params) or not out.is_contiguous() or out.device != device):
        raise ValueError(f"lamb_stats: out must be a contiguous fp32 [4 or 1, {len(params)}] tensor on {device} (or "
                         f"wider, with {len(params)} columns from column {column})")
    dots = out.shape[0] == 4
    _check_params("lamb_stats", params if dots else [None] * len(params), offsets, valid, device)
    f32 = np.float32
    f32v, i64, _ = empty_arrays(device)
    moments = exp_avg is not None
    if not moments:
        exp_avg = prev = update
    _check_flat("lamb_stats: exp_avg", exp_avg, device, valid)
    _check_flat("lamb_stats: prev", prev, device, valid)
    shift = synced is not None
    if shift != (divisors is not None):
        raise ValueError("lamb_stats takes synced and divisors together")
    if shift:
        if not moments:
            raise ValueError("lamb_stats: the shift (synced=) needs exp_avg and prev")
        _check_flat("lamb_stats: synced", synced, device, valid)
        _check_flat("lamb_stats: divisors", divisors, device, len(params))
    c = (1 - beta2) / (1 - beta1) ** 2 if moments else 0.0  # as lamb_moments_ computes it
    nums = (f32(-beta1), f32(c), f32(beta2), f32(1 / bias_correction))
    mask = i64 if mask is None else arr(mask)
    shifted = (arr(synced), arr(divisors)) if shift else (f32v, f32v)
    with _on(device):
        addr, bounds = address_tables(params if dots else [None] * len(params), offsets, valid, device)
        t_lo, t_hi, ptr, partials, count, tiles = _stats_geometry(offsets, valid, device)
        launch = _launcher(_lamb_stats_kernel, _grid(max(tiles, len(params)), 1), RTHREADS, _stream(device))
        launch(addr, bounds, arr(update), arr(denom), arr(fresh), arr(exp_avg), arr(prev), mask, *shifted, shift,
               go_array(go, device), *nums[:3], f32(eps), bool(eps_inside_sqrt), nums[3], moments, dots, t_lo, t_hi,
               ptr, partials, count, arr(out), column)
    return out


def scaled_step(params: Sequence[torch.Tensor | None], update: torch.Tensor, offsets: Sequence[int],
                steps: torch.Tensor, decays: torch.Tensor, go: torch.Tensor | None = None) -> None:
    """``params[k] <- params[k] * decays[k] - steps[k] * update[offsets[k]:...]`` on torch's current stream
    (``None``: parameter k is left alone). ``params``: contiguous fp32 tensors of their groups' sizes; ``update``
    the flat fp32 buffer they are laid out in; ``steps``, ``decays``: fp32, one a parameter, on its device (all
    three 1-d: a kernel array is described once per memory, so they should be the same tensors every step).
    ``go`` (a one-element bool tensor): nothing is written unless it holds."""
    device = update.device
    for name, t in (("update", update), ("steps", steps), ("decays", decays)):
        _check_flat(f"scaled_step: {name}", t, device)
    if steps.numel() != len(params) or decays.numel() != len(params) or len(offsets) != len(params):
        raise ValueError("scaled_step needs one step, decay and offset a parameter")
    valid = update.numel()
    _check_params("scaled_step", params, offsets, valid, device)
    with _on(device):
        addr, bounds = address_tables(params, offsets, valid, device)
        launch = _launcher(_scaled_step_kernel, _grid(valid, THREADS), THREADS, _stream(device))
        launch(addr, bounds, arr(update), arr(steps), arr(decays), go_array(go, device), valid)

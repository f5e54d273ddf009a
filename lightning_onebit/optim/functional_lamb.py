"""1-bit LAMB's functional core: its moments, the shift of its momentum and its scaled step (see
:mod:`.functional`, whose API these are part of, and :class:`~lightning_onebit.optim.OnebitLamb`).

Where a rule runs numba's CPU kernels or torch's ops is :mod:`.functional`'s ``_fusable`` (and the scaled step's
kernel its ``get_backend``), asked through that module: the host-path benchmark and the tests switch the CPU's
kernels off there, as on a GPU, for every rule at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from ..compress.kernels.numba_intrinsics import fma32
from ..compress.kernels.numba_tiles import ahead
from ..compress.kernels.threads import parallel_and_serial, parallel_kernel
from . import functional as _core
from .functional import _CH, _CHUNK, _np

__all__ = ["Flat", "LayerStats", "lamb_moments_", "layer_factors_", "scaled_step_", "shift_in_", "stats_kernel"]


@parallel_and_serial
def _lamb_stats(m, prev, fresh, d, prelim, beta1, c, b2, eps, inside, inv_bc, maxima, chunk):
    """fresh = fresh * b2 + c w^2 with w = m - beta1 prev; prelim = (m / d) * inv_bc; the maximum of
    d / d_fresh per chunk of ``chunk`` elements into ``maxima`` (exact in any order; NaN kept)."""
    nb = -beta1
    zero = np.float32(0.0)
    for t in prange((m.size + chunk - 1) // chunk):
        lo = t * chunk
        hi = min(lo + chunk, m.size)
        lanes = np.full(_CH, -np.inf, np.float32)  # a max per lane vectorises, one running max does not
        nans = np.zeros(_CH, np.float32)  # ratios that are NaN, which a max would drop
        for o in range(lo, hi, _CH):
            e = min(o + _CH, hi)
            mc, pc, fc, dc, uc = m[o:e], prev[o:e], fresh[o:e], d[o:e], prelim[o:e]
            ahead(m, o)
            ahead(prev, o)
            ahead(fresh, o)
            ahead(d, o)
            for j in range(e - o):
                w = fma32(nb, pc[j], mc[j])  # torch.sub(m, prev, alpha=beta1)
                f = fma32(c * w, w, fc[j] * b2)  # fresh.mul_(b2).addcmul_(w, w, value=c)
                fc[j] = f
                df = np.sqrt(f + eps) if inside else np.sqrt(f) + eps
                r = dc[j] / df
                lanes[j] = r if r > lanes[j] else lanes[j]
                nans[j] += np.float32(1.0) if r != r else zero
                uc[j] = (mc[j] / dc[j]) * inv_bc
        mx = lanes.max()
        maxima[t] = mx if nans.sum() == 0 else np.float32(np.nan)


class LayerStats(NamedTuple):
    """Where :func:`lamb_moments_`'s kernel puts each layer's statistics: the layers' parameters, laid out at
    ``offsets`` in the bucket's buffers, an fp32 ``[4 or 1, layers]`` output, and the positions whose update is
    0 (sorted int64, or None). ``shift``: the synced momentum (flat) and each layer's divisor (fp32, on the
    device), shifted in by the same pass (:func:`shift_in_`'s bits, then 0 at ``mask``); ``go``: a one-element
    bool tensor, the kernel writes nothing unless it holds (a step the device decided to skip); ``column``: the
    layers' first column in ``out``, where it is wider (a buffer that gathers several buckets' statistics)."""

    params: Sequence[torch.Tensor]
    offsets: Sequence[int]
    out: torch.Tensor
    mask: torch.Tensor | None
    shift: tuple[torch.Tensor, torch.Tensor] | None = None
    go: torch.Tensor | None = None
    column: int = 0


class Flat(NamedTuple):
    """The buffers a bucket's per-tensor views are consecutive parts of (``exp_avg`` ... ``update`` in the order
    :func:`lamb_moments_` takes them), each tensor's length on their device, and a scratch buffer of their size."""

    exp_avg: torch.Tensor
    prev: torch.Tensor
    fresh: torch.Tensor
    denom: torch.Tensor
    update: torch.Tensor
    lengths: torch.Tensor
    scratch: torch.Tensor


@torch.no_grad()
def lamb_moments_(exp_avgs: Sequence[torch.Tensor], prevs: Sequence[torch.Tensor], fresh: Sequence[torch.Tensor],
                  denoms: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], bias_corrections: Sequence[float],
                  *, beta1: float, beta2: float, eps: float, eps_inside_sqrt: bool,
                  flat: Flat | None = None, stats: LayerStats | None = None) -> torch.Tensor | None:
    r"""1-bit LAMB's elementwise half of a compressed step, per tensor, in place:

    .. math::
       w = m - \beta_1 m_{prev},\quad
       v^{fresh} \leftarrow \beta_2 v^{fresh} + \tfrac{1-\beta_2}{(1-\beta_1)^2} w^2,\quad
       u = \frac{m}{d} \cdot \frac{1}{1-\beta_1^t}

    (``updates`` receives u), returning each tensor's :math:`\max d / d^{fresh}` (one tensor, on the
    tensors' device: no host sync; -inf for an empty tensor) with
    :math:`d^{fresh} = \sqrt{v^{fresh} + \epsilon}` (or :math:`\sqrt{v^{fresh}} + \epsilon`). The bits of
    ``torch.sub(m, prev, alpha=beta1)``, ``fresh.mul_(beta2).addcmul_(w, w, value=...)``, the
    divisions and ``torch.segment_reduce(..., "max")``; one pass on the CPU instead of eight. One
    rounding differs: the kernel's square root is IEEE's (correctly rounded), while torch's
    vectorised ``sqrt`` on AVX-512 builds is one ulp off for some fp32 values (0.7% on an Intel Xeon, 20% on
    an AMD EPYC), so a layer's maximum can differ from the torch ops' by an ulp (the tests bound it there).

    ``flat``: the buffers the tensors are views of (:class:`Flat`). Where the torch ops run (a GPU) and the bias
    corrections are one, they run once on the whole buffers, the maxima by one segmented reduction, so a bucket's
    ops do not grow with its tensors: the same bits (elementwise ops, and a maximum is exact; on a CPU, whose
    vectorised ``sqrt`` rounds SIMD lanes and a tensor's tail apart, a maximum an ulp apart at most).

    ``stats`` (:class:`LayerStats`, with ``flat``, where :func:`stats_kernel` holds): where the whole buffers'
    ops would run, the compression backend's kernel (the cuda backend's) writes the moments, u (0 at
    ``stats.mask``) and each layer's statistics for its trust ratio into ``stats.out`` in one pass over the
    bucket, and None is returned: :math:`\max d / d^{fresh}` and, where ``out`` has four rows,
    :math:`\langle u, u\rangle, \langle u, \theta\rangle, \langle\theta, \theta\rangle`. Its elementwise
    roundings are the CPU kernel's (fused multiply-adds, IEEE's square root), its sums fp64 in a fixed order,
    rounded once (not the bits of torch's fp32 dot products, which a CPU's BLAS and a GPU's do not share anyway).
    Elsewhere the maxima are returned as without it."""
    c = (1 - beta2) / (1 - beta1) ** 2
    fusable = _core._fusable(*exp_avgs, *prevs, *fresh, *denoms, *updates)
    if stats is not None and (stats.shift is not None or stats.go is not None) and (
            fusable or flat is None or len(set(bias_corrections)) > 1):
        raise ValueError("lamb_moments_: stats with a shift or go= need the statistics kernel (stats_kernel(flat)) "
                         "and one bias correction")
    if not fusable and flat is not None and len(set(bias_corrections)) <= 1:
        bc = bias_corrections[0] if bias_corrections else 1.0
        if stats is not None:
            synced, divisors = stats.shift if stats.shift is not None else (None, None)
            _core.get_backend(flat.update.device).lamb_stats(
                stats.params, flat.update, flat.denom, flat.fresh, stats.offsets, stats.out, eps=eps,
                eps_inside_sqrt=eps_inside_sqrt, exp_avg=flat.exp_avg, prev=flat.prev, mask=stats.mask, beta1=beta1,
                beta2=beta2, bias_correction=bc, synced=synced, divisors=divisors, go=stats.go, column=stats.column)
            return None
        return _lamb_moments_flat(flat, bc, beta1, c, beta2, eps, eps_inside_sqrt)
    if not fusable:
        out = []
        for m, p, f, d, u, bc in zip(exp_avgs, prevs, fresh, denoms, updates, bias_corrections, strict=True):
            w = torch.sub(m, p, alpha=beta1)
            f.mul_(beta2).addcmul_(w, w, value=c)
            df = (f + eps).sqrt_() if eps_inside_sqrt else f.sqrt().add_(eps)
            out.append((d / df).max() if d.numel() else d.new_full((), -math.inf))
            torch.div(m, d, out=u).mul_(1 / bc)
        return torch.stack(out)
    return _lamb_fused(exp_avgs, prevs, fresh, denoms, updates, bias_corrections, beta1, c, beta2, eps,
                       eps_inside_sqrt)


def _lamb_moments_flat(flat: Flat, bc: float, beta1: float, c: float, beta2: float, eps: float,
                       inside: bool) -> torch.Tensor:
    """:func:`lamb_moments_`'s torch ops on whole buffers: w in the scratch, d / d_fresh and then u in ``update``."""
    m, p, f, d, u, lengths, w = flat
    torch.sub(m, p, alpha=beta1, out=w)
    f.mul_(beta2).addcmul_(w, w, value=c)
    if inside:
        torch.add(f, eps, out=u).sqrt_()
    else:
        torch.sqrt(f, out=u).add_(eps)
    torch.div(d, u, out=u)
    # unsafe: no check of the lengths against the data, which would read them back from the device
    top = torch.segment_reduce(u, "max", lengths=lengths, unsafe=True, initial=-math.inf)
    torch.div(m, d, out=u).mul_(1 / bc)
    return top


def stats_kernel(flat: Flat | torch.Tensor) -> bool:
    """Whether :func:`lamb_moments_` can take ``stats=`` for these buffers (or buffers like this tensor): where
    torch's ops run (a GPU) and the compression backend has 1-bit LAMB's statistics kernel (the cuda backend's). Its
    parameters must be contiguous fp32 tensors on the buffers' device (the caller knows whether they are; the
    kernel's wrapper raises if not)."""
    u = flat if isinstance(flat, torch.Tensor) else flat.update
    return not _core._fusable(u) and getattr(_core.get_backend(u.device), "lamb_stats", None) is not None


@torch.no_grad()
def layer_factors_(stats: torch.Tensor, last: torch.Tensor, freeze: torch.Tensor, *, weight_decay: float, lr: float,
                   factor_threshold: float, factor_min: float, factor_max: float, work: torch.Tensor,
                   undefined: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                   go: torch.Tensor | None = None, owner: torch.Tensor | None = None) -> torch.Tensor | None:
    r"""1-bit LAMB's layer factors from each layer's statistics (``stats``, fp32 ``[4 or 1, layers]``: the maximum
    of :math:`d / d^{fresh}` and, with weight decay, :math:`\langle u, u\rangle, \langle u, \theta\rangle,
    \langle\theta, \theta\rangle`): the factor blended with the weight-decay share, clipped to the bounds and to
    ``factor_threshold`` around ``last`` (fp64, updated in place), times ``lr`` and the ``freeze`` coefficients.
    Torch's fp64 ops in ``work`` (``[rows + 1, layers]``; ``undefined``, bool, the undefined shares), in place,
    nothing allocated, with Python's float roundings operation for operation; returns the fp64 step sizes (a row of
    ``work``). With ``out`` (fp32 step sizes and decays ``1 - s wd``) they are written there instead and None is
    returned: by the compression backend's kernel in one launch where it has one (the cuda backend's, the same
    roundings), else by these ops. ``go`` (bool) and ``owner`` (int64, one a layer; the kernel's only): layer k is
    left alone unless ``go[owner[k]]`` (its bucket's step was not skipped on the device)."""
    wd, thr = weight_decay, factor_threshold
    if out is not None:
        kernel = getattr(_core.get_backend(last.device), "lamb_factors", None)
        if kernel is not None:
            kernel(stats, last, freeze, *out, weight_decay=wd, lr=lr, factor_threshold=thr, factor_min=factor_min,
                   factor_max=factor_max, go=go, owner=owner)
            return None
    if go is not None:
        raise ValueError("layer_factors_: go= needs the compression backend's factors kernel")
    work[:-1].copy_(stats)  # fp32 -> fp64: exact
    factor, bound = work[0], work[-1]
    if wd:
        uu, un2, pp = work[1:4]
        un2.mul_(2 * wd).add_(uu).add_(pp.mul_(wd * wd)).clamp_min_(0.0)  # ||u + wd p||^2
        torch.gt(un2, 0.0, out=undefined).logical_not_()  # NaN: undefined too
        share = uu.div_(un2).sqrt_().clamp_max_(1.0).masked_fill_(undefined, 1.0)
        factor.mul_(share).add_(share.neg_().add_(1.0))  # f * share + (1 - share)
    factor.clamp_(factor_min, factor_max)
    torch.maximum(factor, torch.mul(last, 1 - thr, out=bound), out=factor)
    torch.minimum(factor, torch.mul(last, 1 + thr, out=bound), out=last)
    steps = torch.mul(freeze, lr, out=bound).mul_(last)
    if out is None:
        return steps
    out[0].copy_(steps)
    out[1].copy_(steps.mul_(wd).neg_().add_(1.0))  # 1 - s wd, rounded as the host's
    return None


@parallel_kernel
def _lamb_fused(ms, ps, fs, ds, us, bcs, beta1, c, beta2, eps, inside) -> torch.Tensor:
    f32, out = np.float32, []
    for m, p, f, d, u, bc in zip(ms, ps, fs, ds, us, bcs, strict=True):
        maxima = np.empty((m.numel() + _CHUNK - 1) // _CHUNK, np.float32)
        _lamb_stats(m.numel(), _np(m), _np(p), _np(f), _np(d), _np(u), f32(beta1), f32(c), f32(beta2), f32(eps),
                    inside, f32(1 / bc), maxima, _CHUNK)
        # a NaN anywhere stays NaN, as in torch; an empty tensor (a rank's empty shard of it) has none
        out.append(torch.from_numpy(maxima).max() if maxima.size else torch.tensor(-math.inf))
    return torch.stack(out)


@torch.no_grad()
def scaled_step_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                 steps: Sequence[float] | torch.Tensor, decays: Sequence[float] | torch.Tensor, *,
                 flat: tuple[torch.Tensor, Sequence[int]] | None = None, go: torch.Tensor | None = None) -> None:
    r""":math:`\theta \leftarrow \theta \cdot \text{decay} - s\, u` per tensor (LAMB's last line): the bits
    of ``p.mul_(decay)`` (skipped at 1) and ``p.add_(u, alpha=-s)``, in one pass on the CPU.

    ``steps``, ``decays`` may be fp32 tensors on the tensors' device (one number a tensor). With ``flat`` (the
    flat buffer ``updates`` are views of, and their offsets in it), where the torch ops would run and the
    compression backend has a scaled-step kernel (the cuda backend's), every tensor's step is one launch that
    reads them there: no host read, and the same bits. Otherwise they are read first. ``go`` (a one-element bool
    tensor): the step is taken only where it holds (the kernel's predicate; read first elsewhere)."""
    if isinstance(steps, torch.Tensor):
        on_device = flat is not None and not _core._fusable(*params, *updates)
        if on_device and _device_scaled_step(params, flat, steps, decays, go):
            return
    if go is not None and not bool(go[0]):  # what the kernel would have skipped
        return
    if isinstance(steps, torch.Tensor):
        n = steps.numel()
        both = torch.cat([steps, decays]).tolist()  # one read
        steps, decays = both[:n], both[n:]
    if not _core._fusable(*params, *updates):
        for p, u, s, dc in zip(params, updates, steps, decays, strict=True):
            if dc != 1.0:
                p.mul_(dc)
            p.add_(u if u.dtype == p.dtype else u.to(p.dtype), alpha=-s)
        return
    _scaled_fused(params, updates, steps, decays)


def _device_scaled_step(params: Sequence[torch.Tensor], flat: tuple[torch.Tensor, Sequence[int]],
                        steps: torch.Tensor, decays: torch.Tensor, go: torch.Tensor | None) -> bool:
    """:func:`scaled_step_` by the compression backend's kernel, if it has one that takes these tensors (contiguous
    fp32 parameters on the update's device); returns whether it ran."""
    update, offsets = flat
    kernel = getattr(_core.get_backend(update.device), "scaled_step", None)
    if kernel is None or not all(p.device == update.device and p.dtype == torch.float32 and p.is_contiguous()
                                 for p in params):
        return False
    kernel(params, update, offsets, steps, decays, go=go)
    return True


@parallel_and_serial
def _scaled(p, u, neg_s, decay):
    for t in prange((p.size + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        hi = min(lo + _CHUNK, p.size)
        for o in range(lo, hi, _CH):
            e = min(o + _CH, hi)
            pc, uc = p[o:e], u[o:e]
            ahead(p, o)
            ahead(u, o)
            for j in range(e - o):
                pc[j] = fma32(neg_s, uc[j], pc[j] * decay)


@parallel_kernel
def _scaled_fused(params, updates, steps, decays) -> None:
    for p, u, s, dc in zip(params, updates, steps, decays, strict=True):
        _scaled(p.numel(), _np(p), _np(u), np.float32(-s), np.float32(dc))


@parallel_and_serial
def _shift_in(prev, m, new, div):
    for c in prange((m.size + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        ps, ms, ns = prev[lo : lo + _CHUNK], m[lo : lo + _CHUNK], new[lo : lo + _CHUNK]
        for i in range(ms.size):  # a copy and a division: LLVM vectorises the plain loop
            ps[i] = ms[i]
            ms[i] = ns[i] / div


@torch.no_grad()
def shift_in_(prevs: Sequence[torch.Tensor], states: Sequence[torch.Tensor], new: Sequence[torch.Tensor],
              divisors: Sequence[float], *, flat: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``prev <- state; state <- new / divisor`` per tensor (the bits of ``copy_`` and ``torch._foreach_div_``),
    one pass on the CPU instead of three; ``flat``: the buffers of ``prevs``, ``states``, copied as one by torch.

    Where torch's ops run (a GPU) they are foreach ops, three whatever the tensors: ``_foreach_div_`` divides as the
    CPU does, where ``torch.div`` by a number multiplies by its reciprocal on a GPU."""
    if not _core._fusable(*prevs, *states, *new):
        if flat is not None:
            flat[0].copy_(flat[1])
        else:
            torch._foreach_copy_(prevs, states)
        torch._foreach_copy_(states, new)
        torch._foreach_div_(states, divisors)
        return
    _shift_in_fused(prevs, states, new, divisors)


@parallel_kernel
def _shift_in_fused(prevs, states, new, divisors) -> None:
    for p, s, n, dv in zip(prevs, states, new, divisors, strict=True):
        _shift_in(s.numel(), _np(p), _np(s), _np(n), np.float32(dv))

"""The functional core of the optimizers: update rules on lists of tensors, no optimizer state.

As in ``torch/optim/adamw.py``, the classes keep the plumbing (buckets, phases, checkpoints,
the collective) and call these functions for the arithmetic. Each function says its update rule
and the torch ops whose bits it reproduces; the tests hold them to those bits.

On the CPU, fp32 and contiguous tensors go through one numba kernel per tensor (one pass over
memory instead of one per torch op); everything else (a GPU, low-precision parameters) runs
the torch ops themselves. The kernels are elementwise, so their bits do not depend on the thread
count, and they round every operation as torch does: a fused multiply-add exactly where torch's
CPU kernels use one (``lerp``, ``add(alpha=)``), nowhere else (numba does not contract without
``fastmath``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from numba import prange

from ..compress.kernels import get_backend
from ..compress.kernels.numba_intrinsics import fma32
from ..compress.kernels.numba_tiles import ahead
from ..compress.kernels.threads import parallel_and_serial, parallel_kernel

__all__ = ["Flat", "decoupled_update_", "lamb_moments_", "local_adam_step_", "outer_nesterov_", "scaled_step_",
           "shift_in_"]

_CHUNK = 1 << 14  # elements per parallel work item


@parallel_and_serial
def _decoupled_addcdiv(p, u, d, decay, neg_step):
    """p = p * decay + (neg_step * u) / d, each operation rounded to fp32 (torch's order)."""
    for c in prange((p.size + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        ps, us, ds = p[lo : lo + _CHUNK], u[lo : lo + _CHUNK], d[lo : lo + _CHUNK]
        for i in range(ps.size):
            ps[i] = ps[i] * decay + (neg_step * us[i]) / ds[i]


def _fusable(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(-1).numpy()


@parallel_kernel
def _fused(params, updates, denoms, sizes, decay) -> None:
    f32 = np.float32
    for p, u, d, s in zip(params, updates, denoms, sizes, strict=True):
        _decoupled_addcdiv(p.numel(), _np(p), _np(u), _np(d), f32(decay), f32(-s))


@torch.no_grad()
def decoupled_update_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                      denoms: Sequence[torch.Tensor] | None, step_sizes: Sequence[float], *,
                      lr: float, weight_decay: float) -> None:
    r"""The last line of AdamW (and of every optimizer here), in place on ``params``:

    .. math::
       \theta \leftarrow \theta\,(1 - \gamma\lambda) - s\,\frac{u}{d}
       \quad\text{(or } - s\,u \text{ without } d\text{)}

    with ``lr`` :math:`\gamma`, ``weight_decay`` :math:`\lambda`, one step size :math:`s` per
    tensor (e.g. :math:`\gamma / (1-\beta_1^t)`), ``updates`` :math:`u` and ``denoms`` :math:`d`
    (fp32, the shapes of the parameters). Bit for bit what ``torch.optim.AdamW`` (foreach) runs:
    ``_foreach_mul_(params, 1 - lr * wd)`` then ``_foreach_addcdiv_(params, u, d, -s)``, whose
    ``addcdiv`` rounds ``(-s * u) / d`` and then the sum. Parameters that are not fp32 take the
    update in fp32 and are rounded once to their dtype.
    """
    if not params:
        return
    decay = 1 - lr * weight_decay
    sizes = list(step_sizes)
    if params[0].dtype != torch.float32:  # low precision: state and arithmetic stay fp32
        if weight_decay:
            torch._foreach_mul_(params, decay)
        for j, (p, u, s) in enumerate(zip(params, updates, sizes, strict=True)):
            step = u if denoms is None else u / denoms[j]
            p.add_(step.to(p.dtype), alpha=-s)
        return
    # torch's add(alpha=) runs a fused multiply-add, so only the addcdiv form is fused here
    if denoms is not None and _fusable(*params, *updates, *denoms):
        _fused(params, updates, denoms, sizes, decay)
        return
    if weight_decay:
        torch._foreach_mul_(params, decay)
    if denoms is None:
        for p, u, s in zip(params, updates, sizes, strict=True):
            p.add_(u, alpha=-s)
    elif len(set(sizes)) == 1:
        torch._foreach_addcdiv_(params, updates, denoms, value=-sizes[0])
    else:
        torch._foreach_addcdiv_(params, updates, denoms, [-s for s in sizes])


_CH = 32  # elements per vectorised chunk


@parallel_and_serial
def _local_adam(p, m, u, g, d, mask, w, s, decay, neg_s, has_g, has_mask, move_p):
    """m = lerp(m, g, w) (0 where masked; g = 0 without a gradient), u = fma(s, m, u), and with
    ``move_p`` p = p * decay + (neg_s * m) / d, elementwise in one pass."""
    small = abs(w) < np.float32(0.5)  # torch's lerp: the smaller weight's form
    c = w if small else w - np.float32(1.0)
    zero = np.float32(0.0)
    for t in prange((p.size + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        hi = min(lo + _CHUNK, p.size)
        for o in range(lo, hi, _CH):
            e = min(o + _CH, hi)
            mc, uc, dc, pc = m[o:e], u[o:e], d[o:e], p[o:e]
            ahead(m, o)
            ahead(u, o)
            if move_p:
                ahead(p, o)
                ahead(d, o)
            if has_g:
                gc = g[o:e]
                ahead(g, o)
                if small:
                    for j in range(e - o):
                        mc[j] = fma32(c, gc[j] - mc[j], mc[j])
                else:
                    for j in range(e - o):
                        mc[j] = fma32(c, gc[j] - mc[j], gc[j])
            else:
                for j in range(e - o):
                    mc[j] = fma32(c, zero - mc[j], mc[j] if small else zero)
            if has_mask:
                kc = mask[o:e]
                for j in range(e - o):
                    mc[j] = zero if kc[j] else mc[j]
            for j in range(e - o):
                uc[j] = fma32(s, mc[j], uc[j])
            if move_p:
                for j in range(e - o):
                    pc[j] = pc[j] * decay + (neg_s * mc[j]) / dc[j]


def local_fusable(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether :func:`local_adam_step_` runs as one kernel pass for these tensors (CPU, fp32, contiguous)."""
    return _fusable(*params) and _fusable(*[g for g in grads if g is not None])


_EMPTY_F32 = np.zeros(0, np.float32)
_EMPTY_BOOL = np.zeros(0, np.bool_)


@torch.no_grad()
def local_adam_step_(params: Sequence[torch.Tensor] | None, grads: Sequence[torch.Tensor | None],
                     exp_avgs: Sequence[torch.Tensor], update_sums: Sequence[torch.Tensor],
                     denoms: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None] | None,
                     step_sizes: Sequence[float], *, beta1: float, lr: float, weight_decay: float,
                     move_params: bool = True) -> None:
    r"""0/1 Adam's local step, in place (one kernel pass per tensor on the CPU):

    .. math::
       m \leftarrow \operatorname{lerp}(m, g, 1 - \beta_1),\quad
       u \leftarrow u + s\, m,\quad
       \theta \leftarrow \theta (1 - \gamma\lambda) - s\, m / d

    with one step size :math:`s` per tensor (:math:`\gamma / (1 - \beta_1^t)`), ``m = 0`` where
    ``masks`` is set (coordinates without variance) and ``g = 0`` for a ``None`` gradient. The bits
    of ``m.lerp_(g, 1 - beta1)``, ``masked_fill_``, ``u.add_(m, alpha=s)`` and
    :func:`decoupled_update_`, in that order. ``move_params=False`` leaves the parameters alone
    (a synchronising step rebuilds them from the anchor right after; ``params`` may then be None, and
    the other lists may be flat buffers holding many parameters' values). The caller checks
    :func:`local_fusable`; other tensors take the torch ops.
    """
    decay, w = 1 - lr * weight_decay, 1 - beta1
    f32 = np.float32
    if params is None:
        if move_params:
            raise ValueError("local_adam_step_: params=None needs move_params=False")
        params = exp_avgs  # their sizes only: the kernel does not touch params without move_params
    if not local_fusable(params, grads):
        for j, (m, u, g, s) in enumerate(zip(exp_avgs, update_sums, grads, step_sizes, strict=True)):
            m.lerp_(torch.zeros_like(m) if g is None else g, w)
            if masks is not None and masks[j] is not None:
                m.masked_fill_(masks[j], 0.0)
            u.add_(m, alpha=s)
        if move_params:
            decoupled_update_(params, exp_avgs, denoms, step_sizes, lr=lr, weight_decay=weight_decay)
        return
    _local_fused(params, grads, exp_avgs, update_sums, denoms, masks, step_sizes, f32(w), f32(decay), move_params)


@parallel_kernel
def _local_fused(params, grads, exp_avgs, update_sums, denoms, masks, sizes, w, decay, move_params) -> None:
    for j, (p, g, m, u, d, s) in enumerate(zip(params, grads, exp_avgs, update_sums, denoms, sizes, strict=True)):
        mk = None if masks is None else masks[j]
        _local_adam(p.numel(), _np(p), _np(m), _np(u), _EMPTY_F32 if g is None else _np(g), _np(d),
                    _EMPTY_BOOL if mk is None else mk.reshape(-1).numpy(), w, np.float32(s), decay,
                    np.float32(-s), g is not None, mk is not None, move_params)


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
                  flat: Flat | None = None) -> torch.Tensor:
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
    vectorised ``sqrt`` on AVX-512 builds is one ulp off for about 0.7% of fp32 values, so a layer's
    maximum can differ from the torch ops' by an ulp (the tests bound it there).

    ``flat``: the buffers the tensors are views of (:class:`Flat`). Where the torch ops run (a GPU) and the bias
    corrections are one, they run once on the whole buffers, the maxima by one segmented reduction, so a bucket's
    ops do not grow with its tensors: the same bits (elementwise ops, and a maximum is exact; on a CPU, whose
    vectorised ``sqrt`` rounds SIMD lanes and a tensor's tail apart, a maximum an ulp apart at most)."""
    c = (1 - beta2) / (1 - beta1) ** 2
    fusable = _fusable(*exp_avgs, *prevs, *fresh, *denoms, *updates)
    if not fusable and flat is not None and len(set(bias_corrections)) <= 1:
        return _lamb_moments_flat(flat, bias_corrections[0] if bias_corrections else 1.0, beta1, c, beta2, eps,
                                  eps_inside_sqrt)
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
    maxima = torch.segment_reduce(u, "max", lengths=lengths, unsafe=True, initial=-math.inf)
    torch.div(m, d, out=u).mul_(1 / bc)
    return maxima


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
                 flat: tuple[torch.Tensor, Sequence[int]] | None = None) -> None:
    r""":math:`\theta \leftarrow \theta \cdot \text{decay} - s\, u` per tensor (LAMB's last line): the bits
    of ``p.mul_(decay)`` (skipped at 1) and ``p.add_(u, alpha=-s)``, in one pass on the CPU.

    ``steps``, ``decays`` may be fp32 tensors on the tensors' device (one number a tensor). With ``flat`` (the
    flat buffer ``updates`` are views of, and their offsets in it), where the torch ops would run and the
    compression backend has a scaled-step kernel (the cuda backend's), every tensor's step is one launch that
    reads them there: no host read, and the same bits. Otherwise they are read first."""
    if isinstance(steps, torch.Tensor):
        if flat is not None and not _fusable(*params, *updates) and _device_scaled_step(params, flat, steps, decays):
            return
        n = steps.numel()
        both = torch.cat([steps, decays]).tolist()  # one read
        steps, decays = both[:n], both[n:]
    if not _fusable(*params, *updates):
        for p, u, s, dc in zip(params, updates, steps, decays, strict=True):
            if dc != 1.0:
                p.mul_(dc)
            p.add_(u if u.dtype == p.dtype else u.to(p.dtype), alpha=-s)
        return
    _scaled_fused(params, updates, steps, decays)


def _device_scaled_step(params: Sequence[torch.Tensor], flat: tuple[torch.Tensor, Sequence[int]],
                        steps: torch.Tensor, decays: torch.Tensor) -> bool:
    """:func:`scaled_step_` by the compression backend's kernel, if it has one that takes these tensors (contiguous
    fp32 parameters on the update's device); returns whether it ran."""
    update, offsets = flat
    kernel = getattr(get_backend(update.device), "scaled_step", None)
    if kernel is None or not all(p.device == update.device and p.dtype == torch.float32 and p.is_contiguous()
                                 for p in params):
        return False
    kernel(params, update, offsets, steps, decays)
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
    if not _fusable(*prevs, *states, *new):
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


def outer_nesterov_(anchor: torch.Tensor, delta: torch.Tensor, buf: torch.Tensor | None, *, lr: float,
                    momentum: float, nesterov: bool, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The outer step on flat fp32 tensors, ``torch.optim.SGD``'s arithmetic (dampening 0): ``buf``
    <- ``momentum * buf + delta`` (``delta`` itself when ``buf`` is None), ``anchor`` <-
    ``anchor - lr * (delta + momentum * buf)`` (or ``- lr * buf``). ``scratch`` (``delta``'s size, may be
    ``delta`` itself) takes Nesterov's sum instead of a new tensor. Returns the buffer."""
    if momentum == 0:
        anchor.add_(delta, alpha=-lr)
        return delta if buf is None else buf
    if buf is None:
        buf = delta.clone()
    else:
        buf.mul_(momentum).add_(delta)
    anchor.add_(torch.add(delta, buf, alpha=momentum, out=scratch) if nesterov else buf, alpha=-lr)
    return buf

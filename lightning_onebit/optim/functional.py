"""The functional core of the optimizers: update rules on lists of tensors, no optimizer state.

As in ``torch/optim/adamw.py``, the classes keep the plumbing (buckets, phases, checkpoints,
the collective) and call these functions for the arithmetic. Each function says its update rule
and the torch ops whose bits it reproduces; the tests hold them to those bits. 1-bit LAMB's rules are
in :mod:`.functional_lamb`.

On the CPU, fp32 and contiguous tensors go through one numba kernel per tensor (one pass over
memory instead of one per torch op); everything else (a GPU, low-precision parameters) runs
the torch ops themselves. The kernels are elementwise, so their bits do not depend on the thread
count, and they round every operation as torch does: a fused multiply-add exactly where torch's
CPU kernels use one (``lerp``, ``add(alpha=)``), nowhere else (numba does not contract without
``fastmath``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import prange

from ..compress.kernels import get_backend  # noqa: F401 - 1-bit LAMB's scaled step asks it through this module
from ..compress.kernels.numba_intrinsics import fma32
from ..compress.kernels.numba_tiles import ahead
from ..compress.kernels.threads import parallel_and_serial, parallel_kernel

__all__ = ["decoupled_update_", "local_adam_step_", "outer_nesterov_"]  # 1-bit LAMB's: .functional_lamb

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
    :func:`local_fusable`; other tensors take the torch ops, each as one foreach op for all of them
    (one launch on a GPU, whatever the number of buckets or tensors), the masks' fill one a masked tensor.
    """
    decay, w = 1 - lr * weight_decay, 1 - beta1
    f32 = np.float32
    if params is None:
        if move_params:
            raise ValueError("local_adam_step_: params=None needs move_params=False")
        params = exp_avgs  # their sizes only: the kernel does not touch params without move_params
    if not local_fusable(params, grads):
        # each op once for every tensor (foreach: one launch on a GPU), in that order for each tensor
        exp_avgs, update_sums = list(exp_avgs), list(update_sums)
        torch._foreach_lerp_(exp_avgs, [torch.zeros_like(m) if g is None else g
                                        for m, g in zip(exp_avgs, grads, strict=True)], w)
        for m, mask in zip(exp_avgs, masks if masks is not None else [None] * len(exp_avgs), strict=True):
            if mask is not None:
                m.masked_fill_(mask, 0.0)
        for s in dict.fromkeys(step_sizes):
            at = [j for j, t in enumerate(step_sizes) if t == s]
            torch._foreach_add_([update_sums[j] for j in at], [exp_avgs[j] for j in at], alpha=s)
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

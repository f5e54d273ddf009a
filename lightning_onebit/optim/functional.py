"""The functional core of the optimizers: update rules on lists of tensors, no optimizer state.

As in ``torch/optim/adamw.py``, the classes keep the plumbing (buckets, phases, checkpoints,
the collective) and call these functions for the arithmetic. Each function says its update rule
and the torch ops whose bits it reproduces; the tests hold them to those bits.

On the CPU, fp32 and contiguous tensors go through one numba kernel per tensor (one pass over
memory instead of one per torch op); everything else (a GPU, low-precision parameters) runs
the torch ops themselves. The kernels are elementwise, so their bits do not depend on the thread
count, and they round every operation as torch does (no fused multiply-add: numba does not
contract without ``fastmath``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import prange

from ..compress.kernels.threads import parallel_and_serial, parallel_kernel

__all__ = ["decoupled_update_"]

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

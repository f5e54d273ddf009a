"""1-bit LAMB's layer factors in one launch a step (``lamb_factors``), between its statistics and its scaled step
(:mod:`.numba_cuda_update`): :func:`~lightning_onebit.optim.functional_lamb.layer_factors_`'s fp64 arithmetic,
one thread a layer, each operation explicitly rounded (never contracted), torch's NaN rules written out: its
bits, in place of about thirty torch ops a step. A layer whose bucket's flag is down (a step the device decided
to skip) keeps its factor, step size and decay.
"""

from __future__ import annotations

import torch
from numba import cuda, float32, float64

from .numba_cuda_kernels import THREADS
from .numba_cuda_launch import _grid, _launcher, _on, _stream
from .numba_cuda_source import _add64, _div64, _extremum, _mul64, _sqrt64, arr, go_array, memo

__all__ = ["lamb_factors"]


@cuda.jit
def _lamb_factors_kernel(stats, last, freeze, steps, decays, go, owner, wd, twd, wd2, lr, lo, hi, fmin, fmax, blend):
    """Each layer's factor from its statistics (``stats[:, k]``: the maximum and, with ``blend``, the dot
    products), clipped against its last one, which it replaces, and its step size and decay: the fp64 torch ops of
    ``OnebitLamb._layer_steps``, one thread a layer, operation for operation, each explicitly rounded (nothing
    contracted). ``twd``, ``wd2``, ``lo``, ``hi``: ``2 wd``, ``wd^2``, ``1 - threshold``, ``1 + threshold``, the
    host's doubles. Layer k is left alone unless ``go[owner[k]]`` (its bucket's step was not skipped)."""
    k = cuda.grid(1)
    stride = cuda.gridsize(1)
    while k < last.size:
        if not go[owner[k]]:
            k += stride
            continue
        f = float64(stats[0, k])
        if blend:
            uu = float64(stats[1, k])
            un2 = _add64(_add64(_mul64(float64(stats[2, k]), twd), uu), _mul64(float64(stats[3, k]), wd2))
            if un2 < 0.0:  # clamp_min: NaN stays
                un2 = 0.0
            share = 1.0
            if un2 > 0.0:  # else undefined (NaN too): 1
                share = _sqrt64(_div64(uu, un2))
                if share > 1.0:  # clamp_max: NaN stays
                    share = 1.0
            f = _add64(_mul64(f, share), _add64(-share, 1.0))
        if f < fmin:  # clamp: NaN stays
            f = fmin
        if f > fmax:
            f = fmax
        was = last[k]
        f = _extremum(f, _mul64(was, lo), True)
        f = _extremum(f, _mul64(was, hi), False)
        last[k] = f
        s = _mul64(_mul64(freeze[k], lr), f)
        steps[k] = float32(s)
        decays[k] = float32(_add64(-_mul64(s, wd), 1.0))
        k += stride


_OWNERS: dict = {}


def lamb_factors(stats: torch.Tensor, last: torch.Tensor, freeze: torch.Tensor, steps: torch.Tensor,
                 decays: torch.Tensor, *, weight_decay: float, lr: float, factor_threshold: float, factor_min: float,
                 factor_max: float, go: torch.Tensor | None = None, owner: torch.Tensor | None = None) -> None:
    """1-bit LAMB's layer factors on torch's current stream, one launch for a param group's layers: from ``stats``
    (fp32 ``[4 or 1, layers]``: each layer's maximum of ``d / d_fresh`` and, with weight decay, ``<u, u>``,
    ``<u, p>``, ``<p, p>``) and each layer's ``freeze`` coefficient, the factor clipped against ``last`` (fp64,
    updated in place), and fp32 ``steps`` ``lr c f`` and ``decays`` ``1 - s wd``: the roundings of the torch ops
    of ``OnebitLamb._layer_steps``. ``go`` (bool) and ``owner`` (int64, one a layer, indices into ``go``): layer k
    is left alone (``last``, its step size and decay) unless ``go[owner[k]]``, the flag of the bucket it is in (a
    step the device decided to skip); without them every layer is updated."""
    device = last.device
    n = last.numel()
    for name, t, dtype in (("last", last, torch.float64), ("freeze", freeze, torch.float64),
                           ("steps", steps, torch.float32), ("decays", decays, torch.float32)):
        if t.dtype != dtype or t.dim() != 1 or t.numel() != n or not t.is_contiguous() or t.device != device:
            raise ValueError(f"lamb_factors: {name} must be a 1-d contiguous {dtype} tensor of {n} on {device}")
    blend = bool(weight_decay)
    if (stats.dtype != torch.float32 or stats.shape != (4 if blend else 1, n) or not stats.is_contiguous()
            or stats.device != device):
        raise ValueError(f"lamb_factors: stats must be a contiguous fp32 [{4 if blend else 1}, {n}] tensor on {device}")
    if (go is None) != (owner is None):
        raise ValueError("lamb_factors takes go and owner together")
    if go is None:  # one True flag that every layer reads
        owner = memo(_OWNERS, (n, str(device)), lambda: torch.zeros(n, dtype=torch.int64, device=device))
    elif go.dtype != torch.bool or go.dim() != 1 or not go.is_contiguous() or go.device != device:
        raise ValueError(f"lamb_factors: go must be a 1-d contiguous bool tensor on {device}")
    if (owner.dtype != torch.int64 or owner.dim() != 1 or owner.numel() != n or not owner.is_contiguous()
            or owner.device != device):
        raise ValueError(f"lamb_factors: owner must be a 1-d contiguous int64 tensor of {n} on {device}")
    wd, thr = float(weight_decay), float(factor_threshold)
    with _on(device):
        launch = _launcher(_lamb_factors_kernel, _grid(n, THREADS), THREADS, _stream(device))
        flags = go_array(None, device) if go is None else arr(go)
        launch(arr(stats), arr(last), arr(freeze), arr(steps), arr(decays), flags, arr(owner), wd, 2 * wd, wd * wd,
               float(lr), 1 - thr, 1 + thr, float(factor_min), float(factor_max), blend)

"""1-bit LAMB's scaled step in one launch a bucket: ``p <- p * decay_k - s_k * u`` for every parameter k.

The step sizes and decays are fp32 arrays on the device, computed there from the layer statistics (see
:meth:`~lightning_onebit.optim.OnebitLamb._layer_steps`), so the host never reads them; the update ``u`` is the
bucket's flat buffer, and the parameters, separate tensors, are reached through the address table of
:mod:`.numba_cuda_sink`. Each element is rounded as the CPU reference
(:func:`~lightning_onebit.optim.functional_lamb.scaled_step_`): ``p * decay`` (``fmul_rn``, never contracted), then
one fused multiply-add ``fma(-s, u, .)``, so a GPU gives the CPU's bits. Against the torch ops it replaces (a
``mul_`` and an ``add_`` a parameter) it is one pass over the bucket instead of two a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from numba import cuda

from .numba_cuda_kernels import THREADS
from .numba_cuda_launch import _grid, _launcher, _on, _stream
from .numba_cuda_sink import address_tables, f32_load, f32_store
from .numba_cuda_source import _fma32, _group_at, _mul32, arr

__all__ = ["scaled_step"]


@cuda.jit
def _scaled_step_kernel(addr, bounds, u, steps, decays, valid):
    e = cuda.grid(1)
    stride = cuda.gridsize(1)
    while e < valid:
        k = _group_at(bounds, e)
        a = addr[k]
        if a != 0:
            j = e - bounds[k]
            f32_store(a, j, _fma32(-steps[k], u[e], _mul32(f32_load(a, j), decays[k])))
        e += stride


def scaled_step(params: Sequence[torch.Tensor | None], update: torch.Tensor, offsets: Sequence[int],
                steps: torch.Tensor, decays: torch.Tensor) -> None:
    """``params[k] <- params[k] * decays[k] - steps[k] * update[offsets[k]:...]`` on torch's current stream
    (``None``: parameter k is left alone). ``params``: contiguous fp32 tensors of their groups' sizes; ``update``
    the flat fp32 buffer they are laid out in; ``steps``, ``decays``: fp32, one a parameter, on its device (all
    three 1-d: a kernel array is described once per memory, so they should be the same tensors every step)."""
    device = update.device
    for name, t in (("update", update), ("steps", steps), ("decays", decays)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous() or t.device != device:
            raise ValueError(f"scaled_step: {name} must be a 1-d contiguous fp32 tensor on {device}")
    if steps.numel() != len(params) or decays.numel() != len(params) or len(offsets) != len(params):
        raise ValueError("scaled_step needs one step, decay and offset a parameter")
    valid = update.numel()
    # the kernel writes through raw addresses: a parameter of another size or layout would be written out of bounds
    for p, lo, hi in zip(params, offsets, (*offsets[1:], valid), strict=True):
        if p is not None and (p.numel() != hi - lo or p.dtype != torch.float32 or not p.is_contiguous()
                              or p.device != device):
            raise ValueError(f"scaled_step: parameters must be contiguous fp32 tensors on {device} of their offsets' "
                             f"sizes; got {p.dtype} {tuple(p.shape)} for {hi - lo} elements")
    with _on(device):
        addr, bounds = address_tables(params, offsets, valid, device)
        launch = _launcher(_scaled_step_kernel, _grid(valid, THREADS), THREADS, _stream(device))
        launch(addr, bounds, arr(update), arr(steps), arr(decays), valid)

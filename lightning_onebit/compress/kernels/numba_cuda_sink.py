"""A :class:`~..source.Sink` applied by the numba-CUDA decode kernel, where it writes a decoded value.

The update of 1-bit Adam's compression phase (AdamW's last line, ``t <- t * decay + (v * u) / d``) is then
part of the decode: no ``_foreach_mul_`` and ``_foreach_addcdiv_`` after it, no second pass over the decoded
values, and a step the device decided to skip leaves the parameters untouched because the kernel does not
write them (see :meth:`~..base.Codec.decode_predicated`). A decode the host decided (0/1 Adam's anchor update
at a synchronisation, a 1-bit Adam step before its collective was verified) applies it the same way. The
parameters are separate tensors, so the kernel reaches them through a table of their addresses (made once per
bucket and parameter memory, like the CPU kernel's ``f32_at``). Each operation is rounded once, in the order
of the CPU reference (:meth:`~..source.Sink.apply` on the CPU, and the numba CPU kernel): ``t * decay``,
``v * u``, the quotient by ``d``, the sum. The multiplies are ``fmul_rn``, which NVVM never contracts into a
fused multiply-add, so a GPU gives the CPU's bits.

A sink is fused when its groups share one value (the step size; they do unless the bucket's
parameters took different numbers of steps) and its tensors are where the kernel reads them: a per-step
value table would be a host-to-device copy every step. Otherwise the caller applies it with torch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from numba import cuda, float32
from numba import types as nt

from ..source import Sink
from .numba_cuda_source import SIMULATED, _group_at, _in_sorted, _mul32, arr, empty_arrays, memo

__all__ = ["address_tables", "f32_load", "f32_store", "fusable", "sink_args", "sink_at"]


if SIMULATED:  # CPU memory: the address is a host pointer

    @cuda.jit(device=True)
    def _f32_load(address, j):
        return np.float32(ctypes.c_float.from_address(int(address) + 4 * int(j)).value)

    @cuda.jit(device=True)
    def _f32_store(address, j, value):
        ctypes.c_float.from_address(int(address) + 4 * int(j)).value = float(value)  # fp32 -> double: exact

else:
    from llvmlite import ir

    try:
        from numba.cuda.extending import intrinsic
    except ImportError:  # numba-cuda on numba's own core
        from numba.extending import intrinsic

    def _f32_ptr(builder, address, index):
        return builder.gep(builder.inttoptr(address, ir.FloatType().as_pointer()), [index])

    @intrinsic
    def _f32_load(typingctx, address, index):
        """fp32 element ``index`` of the memory at ``address`` (int64)."""
        def codegen(context, builder, signature, args):
            return builder.load(_f32_ptr(builder, *args))

        return nt.float32(nt.int64, nt.int64), codegen

    @intrinsic
    def _f32_store(typingctx, address, index, value):
        """Write fp32 element ``index`` of the memory at ``address`` (int64)."""
        def codegen(context, builder, signature, args):
            builder.store(args[2], _f32_ptr(builder, args[0], args[1]))
            return context.get_dummy_value()

        return nt.void(nt.int64, nt.int64, nt.float32), codegen


f32_load, f32_store = _f32_load, _f32_store  # the parameters' memory, for the kernels that update them in place


@cuda.jit(device=True, inline=True)
def sink_at(addr, bounds, value, decay, denom, mask, valid, e, v):
    """The sink at result position ``e`` (below ``valid``) with decoded value ``v``: the target of e's group
    (``addr``: one address per group, 0 for none) gets ``t * decay + (value * u) / denom[e]``, ``u`` being
    ``v``, or 0 where ``mask`` (sorted positions) holds e."""
    if e >= valid:
        return
    if mask.size and _in_sorted(mask, e):
        v = float32(0.0)
    k = _group_at(bounds, e)
    a = addr[k]
    if a == 0:
        return
    j = e - bounds[k]
    _f32_store(a, j, _mul32(_f32_load(a, j), decay) + _mul32(value, v) / denom[e])


def fusable(sink: Sink | None, device: torch.device) -> bool:
    """Whether the decode kernel can apply ``sink`` to a whole result on ``device``: one value for every
    group with a target, a window at 0, and its tensors on ``device`` (targets contiguous fp32, checked by
    :class:`Sink`; the denominator fp32, the mask int64)."""
    if sink is None or sink.base != 0:
        return False
    known = sink.__dict__.get("_fusable")  # asked before the decode and by it: answered once a sink
    if known is not None and known[0] == device:
        return known[1]
    values = {v for v, t in zip(sink.values, sink.targets, strict=True) if t is not None}
    fits = (len(values) <= 1 and all(t.device == device for t in sink.targets if t is not None)
            and sink.denom.device == device and sink.denom.dtype == torch.float32 and sink.denom.is_contiguous()
            and (sink.mask is None or (sink.mask.device == device and sink.mask.dtype == torch.int64
                                       and sink.mask.dim() == 1)))
    sink.__dict__["_fusable"] = (device, fits)
    return fits


_TABLES: dict[tuple, tuple] = {}


def address_tables(targets, groups, valid: int, device: torch.device) -> tuple:
    """(addresses, group bounds) of ``targets`` (one per group, None for none) as kernel arrays on the device,
    made once per geometry and target memory: a bucket's sink is rebuilt every step, its parameters are not (a
    new address, e.g. after ``load_state_dict`` moved them, makes new tables)."""
    addrs = tuple(0 if t is None or t.numel() == 0 else t.data_ptr() for t in targets)
    key = (addrs, tuple(groups), valid, str(device))

    def make():
        table = torch.tensor(addrs, dtype=torch.int64).to(device)
        bounds = torch.tensor((*groups, valid), dtype=torch.int64).to(device)
        return (table, bounds, arr(table), arr(bounds))  # the tensors own the memory the arrays describe

    return memo(_TABLES, key, make, 256)[2:]


def _tables(sink: Sink, device: torch.device) -> tuple:
    return address_tables(sink.targets, sink.groups, sink.valid, device)


def sink_numbers(sink: Sink | None) -> tuple[float, float]:
    """(value, decay) of ``sink``, the numbers that change between steps: (0, 1) for none."""
    if sink is None:
        return 0.0, 1.0
    return next((v for v, t in zip(sink.values, sink.targets, strict=True) if t is not None), 0.0), sink.decay


def sink_args(sink: Sink | None, device: torch.device) -> tuple:
    """The decode kernel's sink arguments ``(addr, bounds, value, decay, denom, mask, valid)`` (``valid`` 0:
    none); ``sink`` must be :func:`fusable`."""
    f32, i64, _ = empty_arrays(device)
    value, decay = sink_numbers(sink)
    if sink is None:
        return (i64, i64, np.float32(value), np.float32(decay), f32, i64, 0)
    addr, bounds = _tables(sink, device)
    denom = sink.denom if sink.denom.dim() == 1 else sink.denom.reshape(-1)
    return (addr, bounds, np.float32(value), np.float32(decay), arr(denom),
            i64 if sink.mask is None else arr(sink.mask), sink.valid)

"""Three LLVM operations the numba CPU kernels need and numba does not expose.

* :func:`fma32`: a fused multiply-add in fp32 (one rounding). torch's CPU ``lerp`` is
  ``fma(w, end - start, start)`` (its vectorised kernel), so a kernel that evaluates a payload
  such as 1-bit Adam's ``lerp(m, g, 1 - beta1)`` needs it to give torch's bits; numba never
  contracts ``a * b + c`` by itself (no ``fastmath``), and an fp64 emulation rounds twice.
* :func:`prefetch`: a software prefetch of ``arr[i]`` into the caches. On this project's
  machines a numba loop that does more than a copy per element (a scale reduction, an encode)
  does not issue loads far enough ahead to stream memory, and prefetching a few KiB ahead makes
  a reduction over one array much faster (``benchmarks/codecs.py`` times the kernels).
  A prefetch never faults, so it may point past an array's end.
* :func:`f32_at`: an fp32 pointer from an address. A payload's gradient is read from the
  parameters' own ``.grad`` tensors (one address per tensor, ``numba.carray`` over it) instead
  of a copy in a flat bucket buffer, which cost a read and a write of the whole bucket per step.
  The caller keeps the tensors alive and checks that they are contiguous fp32 CPU tensors.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["f32_at", "fma32", "prefetch"]


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` rounded once, in fp32 (``llvm.fma.f32``; one instruction with FMA)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Prefetch ``arr[index]`` for reading (``llvm.prefetch``, all cache levels); ``index`` may lie
    past the end of ``arr`` (no bounds check, no fault)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        idx = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
        ptr = builder.bitcast(builder.gep(ary.data, [idx]), i8p)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=fnty)
        # read (0), high temporal locality (3), data cache (1)
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f32_at(typingctx, address):
    """The address (int64) of fp32 data as a pointer, for ``numba.carray(f32_at(a), n)``."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen

"""Payload sources in the numba-CUDA kernels: a Source's value at a position, one element per thread.

The device function :func:`source_at` evaluates a :class:`~..source.Source` (or reads a tensor) with
torch's roundings, exactly one per operation (see ``_fma32``/``_mul32``); :func:`kernel_input` turns
a Source into the kernels' arguments, once per expression. The CUDA counterpart of
:mod:`.numba_source`.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch
from numba import config as numba_config
from numba import cuda, float32, float64

from ..source import Source
from .numba_common import first_at_least
from .numba_common import last_at_most as _last_at_most

SIMULATED = bool(numba_config.ENABLE_CUDASIM)

# The kernels' codes of an input: a tensor, or a Source's operation. RECIPROCAL is ``quotient`` on a
# GPU, where torch divides by a Python float as ``a * (1 / b)`` (the fp32 reciprocal; its CPU divides).
TENSOR, LERP, GRADIENT, QUOTIENT, RECIPROCAL = 0, 1, 2, 3, 4
ROWS_MEAN = 5  # the server's mean over message rows, decoded by the reduction (see numba_cuda.RowsMean)
_OP = {"lerp": LERP, "gradient": GRADIENT, "quotient": QUOTIENT}


# Two fp32 operations with exactly one rounding each, whatever the compiler: libNVVM contracts a
# multiply and an add into a fused multiply-add by default (its -fma=1, which numba-cuda leaves on),
# so ``lerp * factor + state`` would round once where torch rounds the payload first. fmul_rn
# (PTX ``mul.rn``) is never contracted; cuda.fma is the fused one that torch's lerp is.
if SIMULATED:
    import threading
    import time

    from numba import njit
    from numba.cuda.simulator import kernel as _simulator

    from .numba_intrinsics import fma32 as _fma_llvm

    def _is_alive_yielding(thread: threading.Thread) -> bool:
        # The simulator runs a block's CUDA threads as Python threads and polls their is_alive() in a loop that
        # never gives the GIL up by itself, so they run only when the interpreter takes it from the poller (its
        # 5 ms switch interval); a yield per poll lets them run: the simulator's tests take 2-5x less time.
        time.sleep(0)
        return threading.Thread.is_alive(thread)

    if hasattr(_simulator, "BlockThread"):
        _simulator.BlockThread.is_alive = _is_alive_yielding

    @njit(cache=True)
    def _fma_host(a, b, c):
        return _fma_llvm(a, b, c)

    @cuda.jit(device=True)
    def _fma32(a, b, c):
        # the simulator's cuda.fma is a * b + c, rounded twice; the CPU's llvm.fma.f32 rounds once
        return float32(_fma_host(a, b, c))

    @cuda.jit(device=True)
    def _mul32(a, b):
        return a * b  # numpy fp32 scalars (the simulator has no libdevice)

    @cuda.jit(device=True)
    def _mul64(a, b):
        return a * b

    @cuda.jit(device=True)
    def _div32(a, b):
        return float32(a / b)

    @cuda.jit(device=True)
    def _add64(a, b):
        return float64(a) + float64(b)

    @cuda.jit(device=True)
    def _div64(a, b):
        return float64(a) / float64(b)

    @cuda.jit(device=True)
    def _sqrt64(a):
        return math.sqrt(a) if a >= 0.0 else math.nan  # (a NaN too)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _fma32(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True, inline=True)
    def _mul32(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _mul64(a, b):
        # min-max decode, lo + code * step: contracted, it rounds once where the CPU rounds twice
        return libdevice.dmul_rn(a, b)

    # 1-bit LAMB's kernels: torch's fp32 division and its fp64 ops, each rounded alone
    @cuda.jit(device=True, inline=True)
    def _div32(a, b):
        return libdevice.fdiv_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _add64(a, b):
        return libdevice.dadd_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _div64(a, b):
        return libdevice.ddiv_rn(a, b)

    @cuda.jit(device=True, inline=True)
    def _sqrt64(a):
        return libdevice.dsqrt_rn(a)


#: The group k of position ``pos`` (the last k with bounds[k] <= pos; bounds: starts, then the end),
#: or the block of a row that holds an element (``last_at_most(starts[r], i)``)
last_at_most = cuda.jit(device=True, inline=True)(_last_at_most)
_group_at = last_at_most
_first_at_least = cuda.jit(device=True, inline=True)(first_at_least)


@cuda.jit(device=True, inline=True)
def _extremum(a, b, bigger):
    """torch's maximum (``bigger``) or minimum of a and b: NaN where either is, so a NaN stays once it is in."""
    if b != b:
        return b
    if a == a and (b > a if bigger else b < a):
        return b
    return a


@cuda.jit(device=True, inline=True)
def _in_sorted(a, v):
    """Whether the sorted array ``a`` holds ``v`` (bisection)."""
    lo = _first_at_least(a, v)
    return lo < a.size and a[lo] == v


@cuda.jit(device=True, inline=True)
def _lerp(w, a, b):
    """torch's ``lerp(a, b, w)`` in fp32: ``fma(w, b - a, a)``, or ``fma(w - 1, b - a, b)`` from |w| = 0.5 on."""
    if abs(w) < float32(0.5):
        return _fma32(w, b - a, a)
    return _fma32(w - float32(1.0), b - a, b)


@cuda.jit(device=True, inline=True)
def source_at(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset, j):
    """Element j of the input: ``x[j]`` of a tensor, or the Source's expression at position ``offset + j``
    (0 from ``valid`` on), rounded as :meth:`~..source.Source.materialize` rounds it. ``x`` is the
    tensor or the Source's ``start``; ``end`` its flat ``end``."""
    if op == TENSOR:
        return x[j]
    i = offset + j
    if i >= valid:
        return float32(0.0)  # padding
    if mask.size and _in_sorted(mask, i):
        if nonfinite:
            return abs(_mul32(end[i], float32(0.0)))  # |0 * g|: NaN where the gradient is not finite
        return float32(0.0)
    if op == GRADIENT:
        return end[i]
    if op == LERP:
        v = _lerp(w, x[i], end[i])
        if factors.size:
            v = _mul32(v, factors[_group_at(bounds, i)])
        return v
    f = factors[_group_at(bounds, i)]
    if op == QUOTIENT:
        return x[i] / f
    return _mul32(x[i], f)  # RECIPROCAL: f is the fp32 reciprocal of the divisor


# Kernel arrays by (address, shape, strides, dtype, device): an array is only a description of memory
# (it owns none, so it keeps no tensor alive), and any tensor with that key is that memory, so the
# description made once serves every later launch on it, a view made anew each step included. Going
# through torch's ``__cuda_array_interface__`` costs tens of microseconds per array and launch (a dict
# built, numba's typing of a foreign object, and with the interface's stream a synchronize); a cached
# numba array is typed on numba's fast path.
_ARRAYS: dict[tuple, object] = {}
_ARRAYS_MAX = 4096


def memo(cache: dict, key, make, limit: int = 1024):
    """``cache[key]``, made by ``make()`` on a miss; past ``limit`` entries the oldest is dropped (the
    kernel-array caches: an entry describes memory and owns none, so dropping one only costs a remake)."""
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        hit = cache[key] = make()
    return hit


def arr(t: torch.Tensor):
    """``t`` as a kernel array: a numba device array on the same memory (a numpy array under the
    simulator), made once per memory and geometry (see ``_ARRAYS``)."""
    return memo(_ARRAYS, (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device), lambda: _describe(t.detach()),
                _ARRAYS_MAX)


_ALWAYS: dict[str, torch.Tensor] = {}


def go_array(go: torch.Tensor | None, device: torch.device):
    """A kernel's predicate ``go`` (a one-element bool tensor on ``device``) as a kernel array, or a True flag
    made once per device."""
    if go is None:
        go = memo(_ALWAYS, str(device), lambda: torch.ones(1, dtype=torch.bool, device=device))
    elif go.dtype != torch.bool or go.shape != (1,) or go.device != device:
        raise ValueError(f"go must be a one-element 1-d bool tensor on {device}")
    return arr(go)


def _describe(t: torch.Tensor):
    """A kernel array on ``t``'s memory that does not own it."""
    if t.is_cuda:
        # sync=False: the kernels run on torch's current stream, in order after what wrote ``t``
        return cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=None, sync=False)
    if not SIMULATED:
        raise ValueError("the cuda backend needs CUDA tensors (or NUMBA_ENABLE_CUDASIM=1)")
    a = t.numpy()
    if a.size == 0:
        return a
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True)) + a.itemsize
    raw = np.frombuffer((ctypes.c_char * span).from_address(t.data_ptr()), dtype=np.uint8)
    return np.lib.stride_tricks.as_strided(raw.view(a.dtype), a.shape, a.strides)


_EMPTY: dict[str, tuple] = {}


def empty_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32, int64, bool) empty tensors on ``device``, for the arguments a launch does not use: made once
    per device, not per launch."""
    key = str(device)
    if key not in _EMPTY:
        _EMPTY[key] = tuple(torch.empty(0, dtype=dt, device=device) for dt in (torch.float32, torch.int64, torch.bool))
    return _EMPTY[key]


_EMPTY_ARRAYS: dict[torch.device, tuple] = {}


def empty_arrays(device: torch.device) -> tuple:
    """:func:`empty_tensors` as kernel arrays (a few launch arguments a call: looked up by device alone)."""
    hit = _EMPTY_ARRAYS.get(device)
    if hit is None:
        hit = _EMPTY_ARRAYS[device] = tuple(arr(t) for t in empty_tensors(device))
    return hit


_BOUNDS: dict[tuple, torch.Tensor] = {}
# The group factors of a Source without a cache, on the device by value (a simulated worker's expression,
# rebuilt every step, finds equal ones there); a cached expression keeps a buffer of its own (see _expression)
_FACTORS: dict[tuple, torch.Tensor] = {}


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without waiting for it: from pinned memory on a GPU (torch's host allocator
    keeps the block until the copy is done), so factors that change (0/1 Adam's sums of step sizes, a new value
    each synchronisation) cost no stream synchronisation."""
    return _host(values, device).to(device, non_blocking=True)


def _host(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as a host tensor a copy to ``device`` does not wait for (pinned for a GPU)."""
    host = torch.from_numpy(values)
    return host.pin_memory() if device.type == "cuda" else host


def _group_bounds(groups: tuple, valid: int, device: torch.device) -> torch.Tensor:
    """A Source's group bounds (its groups' starts, then ``valid``) on the device, copied there once per
    geometry: a bucket's Source is rebuilt every step, its geometry is not."""
    key = (groups, valid, str(device))
    t = _BOUNDS.get(key)
    if t is None:
        if len(_BOUNDS) >= 256:
            _BOUNDS.pop(next(iter(_BOUNDS)))
        t = _BOUNDS[key] = torch.tensor((*groups, valid), dtype=torch.int64).to(device)
    return t


def _readable(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels read ``t`` where it is: None, or a contiguous ``dtype`` tensor on ``device``."""
    return t is None or (t.device == device and t.dtype == dtype and t.is_contiguous())


def accepts(x) -> bool:
    """Whether ``reduce``/``encode`` read ``x`` where it is (else the caller materialises it): a tensor, or a
    :class:`~..source.Source` whose tensors are contiguous fp32 (int64 mask) on one CUDA device (the CPU
    under the simulator)."""
    if not isinstance(x, Source):
        return True
    device = x.device
    ends = x.end if isinstance(x.end, tuple) else (x.end,)
    mask = x.mask if x.mask is not None and x.mask.numel() else None
    return (device.type == ("cpu" if SIMULATED else "cuda")
            and all(_readable(t, device, torch.float32) for t in (x.start, *ends))
            and _readable(mask, device, torch.int64) and (mask is None or mask.dim() == 1)
            # |0 * end| of a masked position needs an end (materialize() raises without one)
            and (mask is None or x.masked == "zero" or x.end is not None))


def _reciprocal_division(device: torch.device) -> bool:
    """Whether torch divides a tensor on ``device`` by a Python float as ``a * (1 / b)`` with the fp32
    reciprocal (its CUDA kernel does: RECIPROCAL), or divides (the CPU: QUOTIENT)."""
    return device.type == "cuda"


def _ptr(t: torch.Tensor | None) -> tuple:
    return (0, 0) if t is None else (t.data_ptr(), t.numel())


def _expression(src: Source) -> tuple:
    """(op, start, end, group bounds, factors, mask) of ``src``'s expression as kernel arrays, made once per
    expression (its windows share them, as they share its materialised value): per-group ``end`` tensors
    gathered into one flat buffer, the groups' bounds and factors copied to the device. A bucket's expression
    is rebuilt every step on the same memory: its arrays are kept in the cache it was given (the bucket's)
    while that memory stays, and a step then only gathers the ``end`` tensors again."""
    root = src._root
    arrays = root.__dict__.get("_kernel_arrays")
    if arrays is not None:
        return arrays
    spare = _spare(root)
    gathered = root.end is not None and not isinstance(root.end, torch.Tensor)
    key = None
    if root._cache is not None and not (gathered and spare is None):  # else the gathered end is a new tensor
        end = spare if gathered else root.end
        # the factors' count, not their values: new values (0/1 Adam's sums, every synchronisation) are
        # written into the entry's own factor buffer, whose kernel array stays
        key = (root.op, _ptr(root.start), _ptr(end), _ptr(root.mask), root.groups, root.valid,
               None if root.factors is None else len(root.factors), root.device)
        hit = root._cache.get("kernel_expression")
        if hit is not None and hit[0] == key:
            if gathered:
                root.flat_end(spare)  # the step's values, into the memory the arrays describe
            if root.factors is not None and hit[3] != root.factors:
                _, fs = _factor_values(root, device=root.device)
                hit[2][3].copy_(_host(fs, root.device), non_blocking=True)  # in stream order after the last reader
                hit = root._cache["kernel_expression"] = (*hit[:3], root.factors)
            root.__dict__["_kernel_tensors"] = hit[2]
            arrays = root.__dict__["_kernel_arrays"] = hit[1]
            return arrays
    device = root.device
    f32 = empty_tensors(device)[0]
    op = _OP[root.op]
    start = f32 if root.start is None else root.start if root.start.dim() == 1 else root.start.reshape(-1)
    # per-group tensors gathered here, once per expression: into the buffer the expression would be
    # materialised in, which the kernels never read (they evaluate it), so no allocation per step
    end = f32 if root.end is None else root.flat_end(spare)
    factors = f32
    if root.factors is not None:
        op, fs = _factor_values(root, device)
        # a cached expression owns its factor buffer (rewritten in place when the values change); others
        # share one by value
        factors = _to_device(fs, device) if key is not None else memo(
            _FACTORS, (fs.tobytes(), str(device)), lambda: _to_device(fs, device), 256)
    bounds = _group_bounds(tuple(root.groups), root.valid, device)
    mask = arr(root.mask) if root.mask is not None and root.mask.numel() else empty_arrays(device)[1]
    tensors = root.__dict__["_kernel_tensors"] = (start, end, bounds, factors)  # the arrays own no memory
    arrays = root.__dict__["_kernel_arrays"] = (op, *(arr(t) for t in tensors), mask)
    if key is not None:
        root._cache["kernel_expression"] = (key, arrays, tensors, root.factors)
    return arrays


def _factor_values(root: Source, device: torch.device) -> tuple[int, np.ndarray]:
    """(op, factors) as the kernels take them: a quotient on a device that multiplies by the reciprocal
    becomes RECIPROCAL with the reciprocals."""
    op, fs = _OP[root.op], np.array(root.factors, np.float32)
    if op == QUOTIENT and _reciprocal_division(device):
        with np.errstate(divide="ignore"):
            return RECIPROCAL, np.float32(1.0) / fs  # torch's fp32 reciprocal of float32(divisor)
    return op, fs


def _spare(root: Source) -> torch.Tensor | None:
    """The root's ``out`` buffer (fp32 on its device, ``valid`` elements), where nothing the expression
    reads lives, or None."""
    out = root._out
    if out is None or out.dtype != torch.float32 or out.device != root.device or out.numel() < root.valid:
        return None
    lo, hi = out.data_ptr(), out.data_ptr() + 4 * root.valid
    for t in (root.start, root.mask):
        if t is not None and t.numel() and t.data_ptr() < hi and lo < t.data_ptr() + t.numel() * t.element_size():
            return None
    return out if out.dim() == 1 and out.numel() == root.valid else out.reshape(-1)[: root.valid]


def kernel_input(x, device: torch.device) -> tuple:
    """The kernels' arguments for the input ``x``, a tensor or a :class:`~..source.Source`:
    ``(op, x, end, bounds, w, factors, mask, nonfinite, valid, offset)`` (see :func:`source_at`)."""
    if isinstance(x, Source):
        op, start, end, bounds, factors, mask = _expression(x)
        return op, start, end, bounds, np.float32(x.weight), factors, mask, x.masked == "nonfinite", x.valid, x.base
    f32, i64, _ = empty_arrays(device)
    return TENSOR, arr(x), f32, i64, np.float32(0.0), f32, i64, False, x.numel(), 0



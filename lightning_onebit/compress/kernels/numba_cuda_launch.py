"""Launching on torch's stream: the device's context, numba's stream object, a launcher per configuration,
and a launch's arguments planned once per bucket and replayed by the identity of what a call is given.

A compressed step makes the same few launches on the same memory every time: a bucket's messages, state,
scratch and parameters stay, and only the objects wrapping them (a step's payload expression, its sink)
and a few numbers (step sizes, decay) change. Building a launch's ~25 arguments from its tensors (a kernel
array looked up by address, shape, strides, dtype and device for each, the layout's tables, the scratch)
costs 10-20 us of host time a launch; :func:`planned` builds them once per layout and call, and a later
call with the same tensor objects on the same memory gets them back for a few dict and pointer checks.

A plan is found by the ``id`` of each tensor a call is given and checked by a weak reference to it (so an
``id`` reused by a new object misses, and a plan keeps no tensor alive) and by its ``data_ptr`` (so a
tensor whose memory was swapped, ``p.data = ...`` or ``set_``, misses): the arrays a plan holds describe
memory that is still what the call passed. Plans live on the layout (a bucket's, for as long as it lives),
a few per layout.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from numba import cuda

from .numba_cuda_source import SIMULATED

_PER_LAYOUT = 32  # calls a step makes on one layout, with room for a second stream or thread


def planned(layout: Any, key: tuple, tensors: tuple[torch.Tensor | None, ...], make: Callable[[], Any]) -> Any:
    """``make()``, made once per ``layout`` and call: ``key`` names the call (its site and the values the
    arguments depend on besides ``tensors``), ``tensors`` the tensors they describe (None where absent).
    ``make`` may return None (nothing to keep: it is made again next time)."""
    plans = layout.__dict__.get("_launch_plans")
    if plans is None:
        plans = layout.__dict__["_launch_plans"] = {}
    full = (*key, *map(id, tensors))
    hit = plans.get(full)
    if hit is not None:
        refs, ptrs, value = hit
        for r, t, p in zip(refs, tensors, ptrs, strict=True):
            if t is not None and (r() is not t or t.data_ptr() != p):
                break
        else:
            return value
    value = make()
    if value is not None:
        if len(plans) >= _PER_LAYOUT:
            plans.pop(next(iter(plans)), None)
        plans[full] = (tuple(None if t is None else weakref.ref(t) for t in tensors),
                       tuple(0 if t is None else t.data_ptr() for t in tensors), value)
    return value


_NO_CONTEXT = contextlib.nullcontext()  # reusable
_IS_CUDA: dict[torch.device, bool] = {}


def _is_cuda(device: torch.device) -> bool:
    """``device.type == "cuda"``, looked up by the device (reading ``type`` makes a string: a few launches a
    bucket ask it twice each)."""
    hit = _IS_CUDA.get(device)
    if hit is None:
        hit = _IS_CUDA[device] = device.type == "cuda"
    return hit


def _on(device: torch.device):
    """Launch in ``device``'s context (numba would use the thread's current one: with several GPUs
    per process, or no ``torch.cuda.set_device``, that is another device)."""
    if not _is_cuda(device):
        return _NO_CONTEXT
    return cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]


_STREAMS: dict[int, object] = {}


def _stream(device: torch.device):
    """torch's current stream of ``device`` as numba's, one object per stream: numba caches a kernel's
    launch configuration per stream object, so a new one per launch would miss that cache every time."""
    if not _is_cuda(device):
        return 0
    handle = torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        stream = _STREAMS[handle] = cuda.external_stream(handle)
    return stream


_LAUNCHERS: dict[tuple, object] = {}


def _launcher(kernel, grid: int, block: int, stream):
    """``kernel[grid, block, stream]``, made once per configuration: numba builds and checks a launch
    configuration on every subscript, and a step launches the same few configurations every time
    (the stream is :func:`_stream`'s, kept alive there, so its id names it)."""
    key = (kernel, grid, block, id(stream))
    hit = _LAUNCHERS.get(key)
    if hit is None:
        if len(_LAUNCHERS) >= 1024:
            _LAUNCHERS.pop(next(iter(_LAUNCHERS)))
        hit = _LAUNCHERS[key] = kernel[grid, block, stream]
    return hit


def _grid(work: int, threads: int) -> int:
    # Enough blocks to fill the GPU, grid-stride loops do the rest.
    return max(1, min(-(-work // threads), 65535 if not SIMULATED else 2))

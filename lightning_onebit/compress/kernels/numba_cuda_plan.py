"""A launch's arguments, planned once per bucket and replayed by the identity of what a call is given.

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

import weakref
from collections.abc import Callable
from typing import Any

import torch

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
            plans.pop(next(iter(plans)))
        plans[full] = (tuple(None if t is None else weakref.ref(t) for t in tensors),
                       tuple(0 if t is None else t.data_ptr() for t in tensors), value)
    return value

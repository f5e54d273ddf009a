"""LR schedulers after the strategy converts the optimizer they were built on."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch.optim import Optimizer

__all__ = ["repoint_scheduler"]


def _mark_step_for_schedulers(opt: Optimizer) -> None:
    """Let LR schedulers see ``opt.step`` calls, as they do for the optimizer they were built
    with (torch wraps its ``step`` at scheduler construction; without this, a re-pointed
    scheduler warns that ``optimizer.step()`` was overridden, at every epoch)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step, opt_ref = opt.step, weakref.ref(opt)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = opt_ref()
        if o is not None:
            o._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = wrapper  # type: ignore[method-assign]


def repoint_scheduler(scheduler: Any, old: Optimizer, new: Optimizer) -> None:
    """Make ``scheduler`` drive ``new`` where it drove ``old``, the schedulers it holds included
    (``SequentialLR`` and ``ChainedScheduler`` step inner schedulers that keep their own
    ``optimizer``; re-pointing only the outer one leaves the lr frozen)."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        _mark_step_for_schedulers(new)
    for inner in getattr(scheduler, "_schedulers", ()):
        repoint_scheduler(inner, old, new)
    held = _holds(scheduler, old)
    if held:  # e.g. a custom scheduler that keeps it under another name: it would drive a dead optimizer
        raise ValueError(f"the LR scheduler {type(scheduler).__name__} keeps the {type(old).__name__} it was built on "
                         f"in {held!r}, which the strategy converts to {type(new).__name__} and cannot re-point there; "
                         f"keep it in the scheduler's `optimizer` attribute (as torch's schedulers do), or build the "
                         f"scheduler on a {type(new).__name__} returned from configure_optimizers")


def _holds(obj: Any, target: object, depth: int = 2) -> str | None:
    """The attribute path under which ``obj`` still refers to ``target`` (looking ``depth`` levels
    into attributes, lists, tuples and dicts), or None."""
    if depth < 0:
        return None
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).items()
    else:
        return None
    for key, value in items:
        if value is target or getattr(value, "__self__", None) is target:
            return str(key)
        if isinstance(value, (list, tuple, dict)) or (hasattr(value, "__dict__") and hasattr(value, "step")):
            inner = _holds(value, target, depth - 1)
            if inner is not None:
                return f"{key}.{inner}"
    return None

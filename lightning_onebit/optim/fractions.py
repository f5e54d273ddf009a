"""Numbers of steps that may be given as a fraction of the run: a warm-up (the strategies' and
:class:`~lightning_onebit.callbacks.PhaseSwitch`'s, through
:func:`lightning_onebit.callbacks.phase.resolve_warmup`) and 0/1 Adam's schedule. One check and
one rounding for all of them, so that a fraction means the same number of steps everywhere."""

from __future__ import annotations

import math

__all__ = ["check_steps", "steps_of_run"]


def check_steps(name: str, value: object, *, fraction: bool) -> None:
    """``value`` must be an int >= 1 (steps), or with ``fraction`` also a float in (0, 1) (a
    fraction of the run); else a ValueError naming ``name`` and the value."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    ok = ok or (fraction and isinstance(value, float) and 0.0 < value < 1.0)
    if not ok:
        also = " or a float in (0, 1) (a fraction of the run)" if fraction else ""
        raise ValueError(f"{name} must be an int >= 1{also}, got {value!r}")


def steps_of_run(name: str, value: int | float, total_steps: int | float | None) -> int:
    """Steps of a :func:`check_steps`-valid ``value``: an int as it is, a fraction of a run of
    ``total_steps`` rounded to the nearest step and at least 1. A fraction of a run of unknown
    length (``None`` or infinite: no ``max_steps`` and endless data) is a ValueError naming ``name``."""
    if not isinstance(value, float):
        return value
    if total_steps is None or not math.isfinite(total_steps):
        raise ValueError(f"{name}={value} is a fraction of the run, but the number of steps is unknown (no "
                         "max_steps, endless data); give a number of steps instead")
    return max(1, round(value * total_steps))

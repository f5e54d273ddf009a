"""The strategies' options: checked in their constructors (before any rank starts), and compared at
setup with the optimizer ``configure_optimizers`` returned.

An option left at ``None`` is "not set": the returned optimizer's own value is kept, and the
package default applies where nothing sets it. An option set on the strategy and set otherwise on
the returned optimizer is an error naming both values (:func:`conflict`), not a silent choice of
one of them; equal values are fine.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int", "check_real", "conflict", "keyword_arguments"]


def check_bool(owner: str, name: str, value: object, *, none: bool = False) -> None:
    """``value`` is True or False (or, with ``none``, None); else a ValueError naming it."""
    if value is True or value is False or (none and value is None):
        return
    raise ValueError(f"{owner}: {name} must be {'True, False or None' if none else 'True or False'}, got {value!r}")


def check_choice(owner: str, name: str, value: object, choices: Iterable[object]) -> None:
    """``value`` is one of ``choices``; else a ValueError naming it and them."""
    choices = tuple(choices)
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")


def check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    """``value`` is an int >= ``minimum`` (not a bool, not a float); else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def check_real(owner: str, name: str, value: object) -> None:
    """``value`` is a real number (an int or a float, not a bool); else a ValueError naming it.
    The ranges are the optimizer's to check."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}")


def keyword_arguments(cls: type) -> list[str]:
    """The public keyword arguments of ``cls``'s constructor (besides ``params``), in order."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in inspect.signature(cls.__init__).parameters.items()
            if p.kind in kinds and n not in ("self", "params") and not n.startswith("_")]


def conflict(owner: str, option: str, mine: Any, returned: str, theirs: str, where: str = "") -> str:
    """The message for an option set on the strategy (``owner(option=mine)``) that the optimizer
    returned (its class name ``returned``; ``where``: e.g. " as optimizer 1 of 2") sets otherwise
    (``theirs``, already shown, e.g. ``"compression='fp32'"``)."""
    return (f"{owner}({option}={mine!r}) but configure_optimizers returned {returned}({theirs}){where}; set it in "
            "one place")

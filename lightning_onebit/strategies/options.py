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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..callbacks.phase import PhaseSwitch, resolve_warmup
from ..optim import CompressedOptimizer

__all__ = ["NOT_IN_OPTIMIZER_KWARGS", "check_bool", "check_choice", "check_int", "check_real", "check_warmup_kept",
           "checked_optimizer_kwargs", "compressed_conflicts", "conflict", "keyword_arguments", "option_value"]


def check_warmup_kept(owner: str, algorithm: str, warmup: object) -> None:
    """A ``warmup`` set for an algorithm without an uncompressed warm-up would be ignored: a ValueError
    saying so instead."""
    cls = CompressedOptimizer.algorithms()[algorithm]
    if warmup is not None and not cls.has_warmup:
        raise ValueError(f"{owner}: warmup={warmup!r}, but {cls.__name__} ({algorithm!r}) has no uncompressed "
                         "warm-up; leave warmup unset")


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


#: the converted optimizer's arguments that ``optimizer_kwargs`` cannot give, and where they come from
NOT_IN_OPTIMIZER_KWARGS = {
    "warmup_steps": "the strategy's warmup= sets it (an int is steps)",
    "simulate_workers": "the strategy runs real ranks, not simulated workers",
}


def checked_optimizer_kwargs(owner: str, cls: type[CompressedOptimizer],
                              kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``kwargs`` as a dict, each name an argument of ``cls`` that a strategy may give, and their
    values accepted by ``cls`` (it is built on a dummy parameter); else a ValueError naming them."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{owner}: optimizer_kwargs must be a dict of {cls.__name__}'s arguments, got {kwargs!r}")
    kw = dict(kwargs)
    carried = set(cls.from_adam.values())  # the conversion takes them from the returned optimizer
    accepted = [a for a in keyword_arguments(cls) if a not in carried and a not in NOT_IN_OPTIMIZER_KWARGS]
    for key, value in kw.items():
        if key in carried:
            raise ValueError(f"{owner}: optimizer_kwargs[{key!r}]={value!r}: {key} comes from the optimizer "
                             "configure_optimizers returns (the conversion keeps its hyperparameters); set it there")
        if key in NOT_IN_OPTIMIZER_KWARGS:
            raise ValueError(f"{owner}: optimizer_kwargs[{key!r}]={value!r}: {NOT_IN_OPTIMIZER_KWARGS[key]}")
        if key not in accepted:
            raise ValueError(f"{owner}: optimizer_kwargs has {key!r}, which {cls.__name__} does not take; it takes "
                             f"{accepted}")
    try:
        cls([torch.zeros(1, requires_grad=True)], **kw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{owner}: optimizer_kwargs={kw!r}: {exc}") from exc
    return kw


def option_value(opt: CompressedOptimizer, key: str) -> tuple[Any, str] | None:
    """``(value, as shown)`` of the constructor argument ``key`` as ``opt`` keeps it: in its
    defaults, its :meth:`~CompressedOptimizer.settings` (normalised, e.g. dtypes) or an attribute of
    that name; None if it keeps it nowhere."""
    if key in opt.defaults:
        return opt.defaults[key], repr(opt.defaults[key])
    settings = opt.settings()
    if key in settings:
        return settings[key], settings[key]
    attr = "process_group" if key == "group" else key
    if hasattr(opt, attr):
        return getattr(opt, attr), repr(getattr(opt, attr))
    return None


def compressed_conflicts(strategy, trainer, opts: list[CompressedOptimizer], returned: list[int]) -> list[str]:
    """The options set on the strategy ``strategy`` (a :class:`~.compressed.CompressedDDPStrategy`) that an
    optimizer ``configure_optimizers`` returned (the indices ``returned``; the converted ones took the
    strategy's) or a PhaseSwitch the user added sets otherwise, one message each, naming both values."""
    owner, out = type(strategy).__name__, []
    switch = next((cb for cb in trainer.callbacks
                   if isinstance(cb, PhaseSwitch) and cb is not strategy.phase_switch), None)
    if strategy.warmup is not None and switch is not None and switch.warmup != strategy.warmup:
        out.append(f"{owner}(warmup={strategy.warmup!r}) but the trainer's callbacks hold "
                   f"PhaseSwitch(warmup={switch.warmup!r}); set it in one place")
    probe = None
    for k in returned:
        opt = opts[k]
        cls, where = type(opt).__name__, f" as optimizer {k} of {len(opts)}" if len(opts) > 1 else ""
        if strategy.warmup is not None and opt.warmup_steps is not None and not _same_warmup(strategy, trainer, opt):
            out.append(conflict(owner, "warmup", strategy.warmup, cls, f"warmup_steps={opt.warmup_steps!r}", where))
        mine = strategy.hierarchical
        if mine is not None and opt.hierarchical is not None and opt.hierarchical != mine:
            out.append(conflict(owner, "hierarchical", strategy.hierarchical, cls,
                                f"hierarchical={opt.hierarchical!r} by set_topology", where))
        if opt.nonfinite_policy_set:
            for option, mine, theirs in (("on_nonfinite", strategy.on_nonfinite, opt.on_nonfinite),
                                         ("max_consecutive_skips", strategy.max_consecutive_skips,
                                          opt.max_consecutive_skips)):
                if mine is not None and mine != theirs:
                    out.append(conflict(owner, option, mine, cls, f"{option}={theirs!r} by set_nonfinite_policy",
                                        where))
        if strategy.optimizer_kwargs:
            probe = probe or strategy.optimizer_cls([torch.zeros(1, requires_grad=True)], **strategy.optimizer_kwargs)
            for key, mine in strategy.optimizer_kwargs.items():
                want, theirs = option_value(probe, key), option_value(opt, key)
                if want is None or theirs is None:
                    out.append(f"{owner}(optimizer_kwargs={{{key!r}: {mine!r}}}) cannot be compared with the "
                               f"{cls}{where} configure_optimizers returned (it does not expose {key}); set it in "
                               "one place")
                elif want[0] != theirs[0]:
                    out.append(conflict(owner, "optimizer_kwargs", {key: mine}, cls, f"{key}={theirs[1]}", where))
    return out


def _same_warmup(strategy, trainer, opt: CompressedOptimizer) -> bool:
    """Whether the strategy's warm-up is ``opt.warmup_steps`` steps (a fraction resolved on this
    run's length; ``"auto"`` never is)."""
    if strategy.warmup == "auto":
        return False
    if isinstance(strategy.warmup, int):
        return strategy.warmup == opt.warmup_steps
    try:
        return resolve_warmup(strategy.warmup, trainer.estimated_stepping_batches) == opt.warmup_steps
    except ValueError:  # a fraction of a run of unknown length
        return False


def sharded_variant(owner: str, sharding: str | None, target: Callable[[], type], kwargs: Mapping[str, Any]):
    """The class ``sharding="fsdp"`` builds instead of ``owner`` (``target()``, imported late), after checking
    that it takes every keyword in ``kwargs``; ``None`` for ``sharding=None``."""
    if sharding is None:
        return None
    if sharding != "fsdp":
        raise ValueError(f"{owner}: sharding must be None or 'fsdp', got {sharding!r}")
    cls = target()
    extra = sorted(k for k in kwargs if k not in keyword_arguments(cls))
    if extra:
        raise ValueError(f"{owner}(sharding='fsdp') does not take {extra}: the mesh of nodes x ranks per node sets "
                         "the layout, and FSDP2 replaces DDP's options")
    return cls

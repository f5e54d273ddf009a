"""Converting a user's Adam, AdamW or LAMB into a compressed optimizer (what the strategies do with
the optimizer ``configure_optimizers`` returns), and the argument checks the optimizers share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch.optim import Optimizer

__all__ = ["AdamConversion", "check_hyperparameters"]

_Self = TypeVar("_Self", bound="AdamConversion")


def check_hyperparameters(*, lr: float | None = None, betas: Sequence[float] | None = None,
                          **non_negative: float | None) -> None:
    """The argument checks the optimizers share: ``lr >= 0``, betas a pair in [0, 1), and every other
    keyword (eps, nu, weight_decay, ...) non-negative. Raises ``ValueError`` naming the argument."""
    if lr is not None and not lr >= 0:
        raise ValueError(f"invalid learning rate {lr!r}: it must be >= 0")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"invalid betas {tuple(betas)!r}: two values in [0, 1)")
    for name, value in non_negative.items():
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be non-negative, got {value!r}")


_ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW)


def _is_lamb(opt: Optimizer) -> bool:
    return "lamb" in type(opt).__name__.lower()


class AdamConversion:
    """Mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`: :meth:`from_optimizer` and
    :meth:`conversion_advice`, driven by the class attributes ``from_adam``, ``has_warmup`` and
    ``converts_lamb``."""

    #: Adam's hyperparameters (torch.optim.Adam/AdamW names) -> this optimizer's names, for
    #: :meth:`from_optimizer`; Adam's that are missing here are not carried over
    from_adam: ClassVar[dict[str, str]] = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
    #: besides Adam and AdamW, a LAMB optimizer converts to this one
    converts_lamb: ClassVar[bool] = False

    @classmethod
    def from_optimizer(cls: type[_Self], opt: Optimizer, **overrides: Any) -> _Self:
        """This optimizer over ``opt``'s parameter groups with its hyperparameters (``from_adam``
        maps the names; ``overrides`` are further keyword arguments). Warm-up algorithms get
        ``warmup_steps=None`` unless overridden: a phase switch (e.g. the callback) decides."""
        what = f"{cls.__name__}.from_optimizer"
        if not (isinstance(opt, _ADAM_LIKE) or (cls.converts_lamb and _is_lamb(opt))):
            raise ValueError(
                f"{what} needs an Adam-family optimizer: torch.optim.AdamW (or Adam"
                f"{', or a LAMB' if cls.converts_lamb else ''}); got {type(opt).__name__}")
        d = opt.defaults
        if d.get("amsgrad"):
            raise ValueError(f"{what}: Adam(amsgrad=True) cannot be converted; use CDAdam (AMSGrad) or amsgrad=False")
        decoupled = isinstance(opt, torch.optim.AdamW) or d.get("decoupled_weight_decay", False) or _is_lamb(opt)
        if any(g.get("weight_decay", 0) for g in opt.param_groups) and not decoupled:
            raise ValueError(f"{what}: torch.optim.Adam with weight_decay is L2-regularised Adam, which the "
                             "compressed optimizers do not implement; use torch.optim.AdamW (decoupled)")
        kw = {mine: d[theirs] for theirs, mine in cls.from_adam.items() if theirs in d}
        if cls.has_warmup:
            kw["warmup_steps"] = None
        kw.update(overrides)
        groups = []
        for g in opt.param_groups:
            ng = {k: g[k] for k in ("params", "initial_lr") if k in g}
            ng.update({mine: g[theirs] for theirs, mine in cls.from_adam.items() if theirs in g})
            groups.append(ng)
        new = cls(groups, **kw)
        # keys an LR scheduler added to the groups (initial_lr; OneCycleLR's max_lr, min_lr,
        # base_momentum, max_momentum; ...): the scheduler reads them from its optimizer's groups
        for g_old, g_new in zip(opt.param_groups, new.param_groups, strict=True):
            for k, v in g_old.items():
                if k != "params" and k not in opt.defaults and k not in g_new:
                    g_new[k] = v
        return new

    @classmethod
    def conversion_advice(cls, opt: Optimizer) -> str | None:
        """What a user should know when ``opt`` (an Adam, AdamW or LAMB) is converted to this
        algorithm with its hyperparameters (``None``: nothing; the strategies warn with it)."""
        return None

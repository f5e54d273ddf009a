"""Turn an ``algorithm`` config entry into an optimizer and a Lightning strategy.

An entry (``conf/algorithm/*.yaml``) holds a few keys for the recipe (:data:`META_KEYS`) and
everything else is a keyword argument of the optimizer class it names. The recipe builds
that optimizer itself rather than letting the strategy convert an AdamW, so every
override (``algorithm.eps_inside_sqrt=false``, ``algorithm.block_size=4096``) reaches it and
a misspelt key fails at construction instead of being ignored.

The PyTorch comm-hook baselines (``ddp_fp16``, ``ddp_bf16``, ``powersgd_r1``, ``powersgd_r4``) are
``strategy: ddp`` + AdamW like ``adam``, plus ``comm_hook`` (and PowerSGD's ``powersgd_rank``,
``powersgd_start_iter``): :func:`build_strategy` gives them :func:`lightning_onebit.strategies.ddp_hooks.hook_strategy`.
``comm_hook: post_local_sgd`` (with ``post_local_period`` and ``post_local_start_iter``) is PyTorch's post-local
SGD (:class:`PostLocalSGDStrategy`). A compressed algorithm's ``hierarchical`` and ``on_nonfinite``
(:data:`STRATEGY_KEYS`) are its strategy's, which sets them on the optimizer; DiLoCo takes both itself.

:func:`load_algorithm` reads an entry outside Hydra (the benchmarks): the yaml file resolved against the
root config's ``optim``, with overrides applied as ``algorithm.<key>=...`` would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import get_class
from lightning.pytorch.strategies import Strategy
from omegaconf import OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

from lightning_onebit import CompressedDDPStrategy, DiLoCo, DiLoCoStrategy
from lightning_onebit.callbacks import phase
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategies import BaseDDPStrategy
from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy, hook_strategy

__all__ = ["CONF_DIR", "META_KEYS", "STRATEGY_KEYS", "PostLocalSGDStrategy", "build_optimizer", "build_strategy",
           "is_compressed", "load_algorithm", "optimizer_class", "optimizer_kwargs", "resolve_warmup"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

#: keys of an algorithm entry that are not optimizer arguments
META_KEYS = ("name", "strategy", "optimizer", "warmup", "comm_hook", "powersgd_rank", "powersgd_start_iter",
             "post_local_period", "post_local_start_iter")
#: keys of a compressed algorithm's entry that are arguments of its strategy (``CompressedDDPStrategy``), which
#: sets them on the optimizer; absent, the recipes' choices (automatic topology, ``on_nonfinite="raise"``)
STRATEGY_KEYS = ("hierarchical", "on_nonfinite")


def load_algorithm(name: str, optim: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
                   **context: Any) -> dict[str, Any]:
    """``conf/algorithm/<name>.yaml`` resolved as Hydra composes it, as a plain dict.

    Its ``${optim.*}`` read the root config's ``optim`` (``conf/config.yaml``) updated by ``optim``; then
    ``overrides`` update the entry as ``algorithm.<key>=...`` (or ``+algorithm.<key>=...``) would. Their values
    may interpolate as the entry's do (``"${optim.warmup}"``), also into ``context``: further top-level
    sections, e.g. ``run={"overlap": 8}`` for ``"${run.overlap}"``.
    """
    path = CONF_DIR / "algorithm" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"no algorithm entry {name!r} in {path.parent}; the entries are {known}")
    root = OmegaConf.create({**context, "optim": OmegaConf.merge(OmegaConf.load(CONF_DIR / "config.yaml").optim,
                                                                 dict(optim or {}))})
    root.algorithm = OmegaConf.merge(OmegaConf.load(path), dict(overrides or {}))
    return OmegaConf.to_container(root.algorithm, resolve=True)  # type: ignore[return-value]


def optimizer_class(alg: Mapping[str, Any]) -> type[torch.optim.Optimizer]:
    return get_class(alg["optimizer"])


def is_compressed(alg: Mapping[str, Any]) -> bool:
    """True for the lightning_onebit algorithms, False for the DDP baselines (with or without a comm hook:
    their optimizer is a plain AdamW)."""
    return issubclass(optimizer_class(alg), CompressedOptimizer)


def has_warmup(alg: Mapping[str, Any]) -> bool:
    """The entry's optimizer has an uncompressed warm-up (each optimizer says so itself)."""
    cls = optimizer_class(alg)
    return issubclass(cls, CompressedOptimizer) and cls.has_warmup


def optimizer_kwargs(alg: Mapping[str, Any]) -> dict[str, Any]:
    skip = (*META_KEYS, *(STRATEGY_KEYS if is_compressed(alg) else ()))
    kw = {k: v for k, v in alg.items() if k not in skip}
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    return kw


def _entry_warmup(warmup: int | float | str | None) -> int | float | str:
    """A warm-up algorithm's ``algorithm.warmup``, checked (the strategies' check): the recipes give it
    in the entry, never leave it to a default."""
    if warmup is None:
        raise ValueError(f"a warm-up algorithm needs algorithm.warmup (int steps or a fraction), got {warmup!r}")
    phase.check_warmup(warmup, "algorithm.warmup")
    return warmup


def resolve_warmup(warmup: int | float | str | None, total_steps: int) -> int:
    """Warm-up steps for a plain loop: an int is steps, a float in (0, 1) a fraction of
    ``total_steps`` (:func:`lightning_onebit.callbacks.phase.resolve_warmup`). ``"auto"`` needs the
    Lightning ``PhaseSwitch`` callback."""
    if _entry_warmup(warmup) == "auto":
        raise ValueError("algorithm.warmup='auto' needs the Lightning trainer (PhaseSwitch); in the simulated "
                         "experiments give a number of steps or a fraction")
    return phase.resolve_warmup(warmup, total_steps, name="algorithm.warmup")


def build_optimizer(alg: Mapping[str, Any], params: Iterable, *, total_steps: int | None = None,
                    simulate_workers: int | None = None) -> torch.optim.Optimizer:
    """The entry's optimizer over ``params``.

    ``total_steps=None`` (Lightning): warm-up algorithms get ``warmup_steps=None`` and the
    strategy's ``PhaseSwitch`` starts compression (``algorithm.warmup``: steps, a fraction
    or ``"auto"``). Otherwise (plain loops) ``algorithm.warmup`` becomes ``warmup_steps``.
    ``simulate_workers=n`` makes a compressed optimizer an n-worker simulated cluster; the
    uncompressed baseline ignores it (the caller averages the gradients).
    """
    cls = optimizer_class(alg)
    kw = optimizer_kwargs(alg)
    if simulate_workers is not None and alg.get("comm_hook"):  # else it would be charged as fp32 DDP
        raise ValueError(f"algorithm {alg.get('name')!r}: the comm hook {alg['comm_hook']!r} needs real DDP ranks "
                         "(experiment.runner=lightning), not simulated workers")
    if simulate_workers is not None and issubclass(cls, DiLoCo):  # else one replica on averaged gradients
        raise ValueError(f"algorithm {alg.get('name')!r}: DiLoCo trains a replica per rank and needs real ranks "
                         "(experiment.runner=lightning), not simulated workers")
    if has_warmup(alg):
        kw["warmup_steps"] = None if total_steps is None else resolve_warmup(alg.get("warmup"), total_steps)
    if simulate_workers is not None and issubclass(cls, CompressedOptimizer):
        kw["simulate_workers"] = simulate_workers
    try:
        opt = cls(params, **kw)
    except TypeError as exc:
        raise TypeError(f"algorithm {alg.get('name')!r}: {cls.__name__} does not take these settings "
                        f"({sorted(kw)}): {exc}") from exc
    if total_steps is not None and isinstance(opt, CompressedOptimizer):
        opt.set_total_steps(total_steps)  # schedules given as fractions of the run (the strategies do it in fits)
    return opt


class PostLocalSGDStrategy(HookDDPStrategy):
    """PyTorch's post-local SGD through Lightning: ``post_localSGD_hook`` (DDP's global all-reduce for
    ``start_iter`` steps, then one within each node) and Lightning's ``PeriodicModelAverager`` every ``period``
    steps after them (``DDPStrategy(model_averaging_period=...)``), the hook registered on CPU too.

    The hook's state needs the process group, so it is made when DDP registers its hook; its subgroup is the
    node (the trainer's devices: ``new_subgroups``' default would size it by the CUDA devices). ``start_iter``
    may be a fraction of the run, as PowerSGD's. The recipes' byte counter charges it DDP's fp32 all-reduce
    every step, more than its local steps send.
    """

    def __init__(self, period: int, start_iter: int | float, **kwargs: Any) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"post-local SGD's period (steps between model averagings) must be an int >= 1, "
                             f"got {period!r}")
        super().__init__(start_iter=start_iter, model_averaging_period=period, **kwargs)

    def _register_ddp_hooks(self) -> None:
        self.start_step = self._resolve_start_iter()
        node, _ = dist.new_subgroups(group_size=self.num_processes)
        self._ddp_comm_state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=node,
                                                                    start_localSGD_iter=self.start_step)
        self._ddp_comm_hook = post_localSGD_hook.post_localSGD_hook
        super()._register_ddp_hooks()


def build_strategy(alg: Mapping[str, Any], start_method: str = "forkserver",
                   process_group_backend: str | None = None, **ddp_kwargs: Any) -> Strategy:
    """``ddp`` for the baselines (with ``alg['comm_hook']``: DDP with that PyTorch comm hook), else the
    package's strategy for ``alg['strategy']``.

    Built as objects rather than registry names so that the launcher and backend from the
    trainer preset and the entry's warm-up reach them. ``ddp_kwargs`` go to ``DDPStrategy``
    (``gradient_as_bucket_view``, ``timeout``, ...). The strategy sets none of the optimizer's settings:
    :func:`build_optimizer` gives them to the optimizer, which the strategy keeps.
    """
    common: dict[str, Any] = {"start_method": start_method, "process_group_backend": process_group_backend,
                              **ddp_kwargs}
    hook = alg.get("comm_hook")
    if alg["strategy"] == "ddp":
        if hook == "post_local_sgd":
            return PostLocalSGDStrategy(alg["post_local_period"], alg["post_local_start_iter"], **common)
        if hook:
            return hook_strategy(hook, rank=alg.get("powersgd_rank", 1),
                                 start_iter=alg.get("powersgd_start_iter", 1000), **common)
        # DDPStrategy with sound forkserver launches and torchrun restarts (lightning_onebit.strategies.launch)
        return BaseDDPStrategy(**common)
    if hook:
        raise ValueError(f"algorithm {alg.get('name')!r}: comm_hook needs strategy: ddp, not {alg['strategy']!r}")
    # Each setting in one place: the optimizer's arguments in the optimizer build_optimizer makes (the
    # strategy sets none of them, so it keeps that optimizer as it is), the warm-up (the optimizer has
    # warmup_steps=None in a fit) and the non-finite policy in the strategy.
    if alg["strategy"] == "diloco":  # every DiLoCo option is the optimizer's
        return DiLoCoStrategy(**common)
    warmup = _entry_warmup(alg.get("warmup")) if has_warmup(alg) else None
    # the recipes report a divergence at the step it happens (StopOnDivergence) rather than skip steps
    own = {"on_nonfinite": "raise", **{k: alg[k] for k in STRATEGY_KEYS if k in alg}}
    return CompressedDDPStrategy(algorithm=alg["strategy"], warmup=warmup, **own, **common)

"""Phase switching: when the warm-up algorithms start compressing."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..comm.agree import all_ranks
from ..optim.base import CompressedOptimizer
from ..optim.fractions import check_steps, steps_of_run
from ..optim.sharded import ShardedCompressed

__all__ = ["DEFAULT_WARMUP", "PhaseSwitch", "check_warmup", "find_compressed_optimizer", "find_compressed_optimizers",
           "resolve_warmup", "set_run_length"]

#: the warm-up when nothing else sets one: 15% of the run, the 1-bit Adam paper's advice (15-25%)
DEFAULT_WARMUP = 0.15


def check_warmup(value: object, name: str = "warmup") -> None:
    """A warm-up must be an int >= 1 (optimizer steps), a float in (0, 1) (a fraction of the run) or
    ``"auto"`` (:class:`PhaseSwitch` decides from the variance); else a ValueError naming ``name``
    and the value. The strategies, :class:`PhaseSwitch` and the recipes all check it here."""
    if isinstance(value, str) and value == "auto":
        return
    try:
        check_steps(name, value, fraction=True)
    except ValueError:
        raise ValueError(f"{name} must be an int >= 1 (steps), a float in (0, 1) (a fraction of the run) or "
                         f"'auto', got {value!r}") from None


def resolve_warmup(value: int | float | str, total_steps: int | float | None, name: str = "warmup") -> int | None:
    """The warm-up steps of ``value`` (see :func:`check_warmup`) in a run of ``total_steps``
    optimizer steps: an int as it is, a fraction ``max(1, round(value * total_steps))``, and
    ``None`` for ``"auto"`` (known only when the variance settles). A fraction of a run of unknown
    length (``total_steps`` ``None`` or infinite) is a ValueError."""
    check_warmup(value, name)
    if value == "auto":
        return None
    return steps_of_run(name, value, total_steps)


def find_compressed_optimizers(trainer, *, sharded: bool = False) -> list[CompressedOptimizer]:
    """The trainer's lightning_onebit optimizers (unwrapped from LightningOptimizer), in order; ``sharded``:
    also the optimizer on the shards of each :class:`~lightning_onebit.ShardedCompressed`."""
    opts = [getattr(opt, "_optimizer", opt) for opt in trainer.optimizers]
    return [opt.inner if isinstance(opt, ShardedCompressed) else opt for opt in opts
            if isinstance(opt, CompressedOptimizer) or (sharded and isinstance(opt, ShardedCompressed))]


def set_run_length(trainer, opts) -> int | float:
    """Tell ``opts`` the fit's length in optimizer steps (``estimated_stepping_batches``) where it is a whole
    number, so that schedules given as fractions of the run resolve against it; returns it."""
    total = trainer.estimated_stepping_batches
    if isinstance(total, int) or (isinstance(total, float) and total.is_integer()):
        for opt in opts:
            opt.set_total_steps(int(total))
    return total


def find_compressed_optimizer(trainer) -> CompressedOptimizer | None:
    """The trainer's first lightning_onebit optimizer, or None."""
    opts = find_compressed_optimizers(trainer)
    return opts[0] if opts else None


def _compressed_optimizers(trainer, who: str = "PhaseSwitch") -> list[CompressedOptimizer]:
    opts = find_compressed_optimizers(trainer)
    if opts:
        return opts
    raise no_package_optimizer(trainer, who)


def no_package_optimizer(trainer, who: str) -> ValueError:
    """The error of a callback that needs one of the package's optimizers, naming what the trainer runs."""
    names = [type(getattr(o, "_optimizer", o)).__name__ for o in trainer.optimizers]
    return ValueError(f"{who} needs a lightning_onebit optimizer (use a lightning_onebit strategy, e.g. "
                      f"strategy='onebit_adam'); this trainer runs {names or 'no optimizer'} with "
                      f"{type(trainer.strategy).__name__}")


class PhaseSwitch(Callback):
    """Start the compression phase of a warm-up algorithm (1-bit Adam, 1-bit LAMB, QAdam).

    With one optimizer the warm-up counts ``trainer.global_step``; with several (manual
    optimization, a GAN) each optimizer counts its own steps and switches on its own (Lightning's
    ``global_step`` counts the steps of all of them), and ``"auto"`` switches all of them together.

    Args:
        warmup: ``int`` - number of optimizer steps; ``float`` in (0, 1) - fraction of
            ``trainer.estimated_stepping_batches`` (the 1-bit Adam paper recommends 15-25%);
            ``"auto"`` - switch once the second moment has stabilised: every ``check_every``
            steps the relative change ||v - v_prev|| / ||v_prev|| is compared with ``tol``, and
            after ``patience`` consecutive checks below it the switch happens (the decision is
            agreed across ranks). ``min_steps`` and ``max_fraction`` bound the auto switch.
    """

    def __init__(self, warmup: int | float | str = DEFAULT_WARMUP, tol: float = 0.05, check_every: int = 10,
                 patience: int = 2, min_steps: int = 20, max_fraction: float = 0.5) -> None:
        check_warmup(warmup)
        self.warmup = warmup
        self.tol, self.check_every, self.patience = tol, check_every, patience
        self.min_steps, self.max_fraction = min_steps, max_fraction
        self.switch_step: int | None = None  # the global step at which compression started
        self._target: int | None = None
        self._prev_v: list[torch.Tensor] | None = None
        self._calm = 0
        self.history: list[tuple[int, float]] = []  # (step, relative change of v) for auto

    def on_train_start(self, trainer, pl_module) -> None:
        total = trainer.estimated_stepping_batches
        if self.warmup != "auto":
            self._target = resolve_warmup(self.warmup, total)
        else:
            self._target = max(self.min_steps, round(self.max_fraction * total)) if total != float("inf") else None

    @property
    def target(self) -> int | None:
        """Warm-up steps (known from the start of fit; ``None`` in auto mode on an endless run)."""
        return self._target

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        opts = _compressed_optimizers(trainer)
        if self._target is None or all(o.compressing for o in opts):
            return
        if len(opts) > 1 and self.warmup != "auto":
            for k, opt in enumerate(opts):  # each its own steps (global_step counts them all)
                if not opt.compressing and opt.optimizer_steps >= self._target:
                    opt.start_compression()
                    rank_zero_info(f"lightning_onebit: optimizer {k} compresses from its step {self._target + 1} "
                                   f"(warm-up of {self._target} steps done; trainer step {trainer.global_step + 1})")
            if all(o.compressing for o in opts):
                self.switch_step = trainer.global_step
            return
        if trainer.global_step >= self._target:
            self._switch(trainer, opts, reason=f"warm-up of {self._target} steps done")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.warmup != "auto":
            return
        opts = _compressed_optimizers(trainer)
        step = trainer.global_step
        if all(o.compressing for o in opts) or step == 0 or step % self.check_every:
            return
        v = [t for opt in opts for t in opt.second_moments()]
        if self._prev_v is not None:
            num = sum(float((a - b).norm() ** 2) for a, b in zip(v, self._prev_v, strict=True)) ** 0.5
            den = sum(float(b.norm() ** 2) for b in self._prev_v) ** 0.5
            change = num / den if den > 0 else float("inf")
            self.history.append((step, change))
            self._calm = self._calm + 1 if change < self.tol else 0
            # every rank must switch at the same step
            if all_ranks(self._calm >= self.patience and step >= self.min_steps):
                self._switch(trainer, opts, reason=f"variance stabilised (relative change {change:.3g} < {self.tol})")
        self._prev_v = [t.clone() for t in v]

    def _switch(self, trainer, opts: list[CompressedOptimizer], reason: str) -> None:
        for opt in opts:
            opt.start_compression()
        self.switch_step = trainer.global_step
        msg = (f"lightning_onebit: compression starts with optimizer step {self.switch_step + 1} "
               f"(after {self.switch_step} warm-up steps; {reason})")
        rank_zero_info(msg)

    def state_dict(self) -> dict:
        return {"switch_step": self.switch_step, "calm": self._calm, "history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.switch_step = state_dict["switch_step"]
        self._calm = state_dict["calm"]
        self.history = list(state_dict["history"])

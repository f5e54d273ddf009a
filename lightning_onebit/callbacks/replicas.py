"""Replicas that part between rounds (0/1 Adam's local steps) meet again where it matters."""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn

from .phase import find_compressed_optimizers

__all__ = ["ReplicaSync"]


class ReplicaSync(Callback):
    """Synchronise the replicas before validation and at the end of fit, so that what is evaluated,
    and what callbacks see at ``on_train_end``, is one model on every rank.

    Between an algorithm's rounds (0/1 Adam's local steps) each rank trains its own copy; this calls
    the optimizer's :meth:`~lightning_onebit.optim.CompressedOptimizer.sync_replicas`, one 1-bit round
    when local steps are pending and nothing otherwise (the strategies synchronise before a
    checkpoint is taken themselves). The cost: each such round ends a local interval early, so
    validating more often adds rounds and changes the run a little. The strategies insert it first
    in the callback list (its ``on_train_end`` must run before the others')."""

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._sync(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._sync(trainer)

    @staticmethod
    def ensure(trainer, opts) -> None:
        """Put one first in ``trainer``'s callbacks (others' ``on_train_end`` must see one model) if some
        optimizer of ``opts`` takes local steps and none is there yet: what the strategies do at setup."""
        if (any(getattr(opt, "has_local_steps", False) for opt in opts)
                and not any(isinstance(cb, ReplicaSync) for cb in trainer.callbacks)):
            trainer.callbacks.insert(0, ReplicaSync())

    def _sync(self, trainer) -> None:
        """Subclasses may catch what the synchronisation raises (e.g. NonFiniteGradientError)."""
        for opt in find_compressed_optimizers(trainer, sharded=True):
            opt.sync_replicas()

"""Non-finite gradients: the policy ("raise" or "skip") and the checks behind it.

A NaN/inf gradient on any rank must change nothing on any rank: "raise" lets the collectives find
it (the compressed allreduce checks every rank's input in its agreement round; the warm-up checks
the averaged gradient) and every rank raises :class:`NonFiniteGradientError` at the same step;
"skip" checks every gradient before the first collective changes any state and skips the step on
every rank, until too many in a row were skipped. Where every bucket compresses in ``step()`` (the
compression phase) that check rides in the first collective's agreement round, which every rank
fails together before anything is written, and is the calls' own scale reductions (the scales of a
payload go non-finite exactly when it does), with no pass over the gradients; elsewhere (warm-up,
simulated workers, buckets synchronised in DDP's hook) it is one tiny OR across ranks first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..comm import CompressedAllreduce, all_finite_many, any_across
from .buckets import Bucket

log = logging.getLogger(__name__)

__all__ = ["NonFiniteGradientError", "NonFinitePolicy", "check_nonfinite_policy"]


class NonFiniteGradientError(ValueError):
    """A gradient contained NaN/inf on some rank; every rank raises at the same step. Parameters and
    moments are untouched; in the DDP hook path with the policy "raise", buckets synchronised earlier
    in that backward have already updated their error state (the policy "skip" checks first)."""


def check_nonfinite_policy(policy: str, max_consecutive: int) -> None:
    """Validate an ``on_nonfinite`` policy and its bound (the optimizers' and the strategies')."""
    if policy not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {policy!r}")
    if not isinstance(max_consecutive, int) or max_consecutive < 1:
        raise ValueError(f"max_consecutive must be a positive int, got {max_consecutive!r}")


class SkippedEverywhere(Exception):
    """Internal: the first compressed call's agreement found a NaN/inf gradient on some rank, so
    every rank skips the step (the policy "skip"); nothing was written."""


class NonFinitePolicy:
    """Mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`: what a NaN/inf gradient does."""

    #: whether :meth:`set_nonfinite_policy` was called on this optimizer (by its user, or by a strategy
    #: in an earlier fit): a strategy then keeps that policy instead of applying its own default, and
    #: refuses an explicit ``on_nonfinite``/``max_consecutive_skips`` of its own that differs
    nonfinite_policy_set: bool = False

    def set_nonfinite_policy(self, policy: str = "raise", *, max_consecutive: int = 10) -> None:
        """What a NaN/inf gradient on any rank does: ``"raise"`` :class:`NonFiniteGradientError` on every
        rank, or ``"skip"`` the step on every rank - no parameter, moment or error state changes, the skip
        is counted (``skipped_steps``) and logged - until ``max_consecutive`` steps in a row were skipped,
        which raises with their step numbers. "skip" checks every gradient before the first collective
        writes anything (in the compression phase inside its agreement round, else one tiny OR across
        ranks per step), so with DDP the compressed sync moves from the backward hook
        to ``step()`` (``defer_sync_to_step``), as GradScaler needs too."""
        check_nonfinite_policy(policy, max_consecutive)
        self.on_nonfinite, self.max_consecutive_skips = policy, max_consecutive
        self.nonfinite_policy_set = True
        if policy == "skip":
            self.defer_sync_to_step = True

    def _check_finite(self, t: torch.Tensor | Sequence[torch.Tensor], what: str) -> None:
        # a sum is one cheap reduction and is non-finite whenever an element is (or it overflows:
        # then the element-wise check decides); isfinite(t).all() writes a bool per element
        ts = [t] if isinstance(t, torch.Tensor) else list(t)
        if not ts or bool(torch.isfinite(torch.stack([x.sum() for x in ts]).sum())):
            return
        if not all(bool(torch.isfinite(x).all()) for x in ts):
            raise NonFiniteGradientError(
                f"{type(self).__name__}: the {what} contains NaN or inf; the step was skipped on every "
                "rank and no optimizer state was changed (lower the learning rate, use gradient "
                "clipping, or a GradScaler with fp16)"
            )

    def _finiteness_check(self, buckets: list[Bucket], worker_grads) -> str | None:
        """How the policy "skip" learns, before any state is written, that every rank's gradients are
        finite; the same answer on every rank. When this step's first collective is a compressed call
        (real ranks, every bucket compressing in ``step()``, not synchronised in DDP's hook already), its
        agreement carries the answer: ``"payloads"`` when the calls' own scale reductions find it (every
        call phased, and a NaN/inf gradient makes the payload non-finite: no pass of its own), else
        ``"first call"`` (one pass over the gradients, sent in that agreement). ``None``: one tiny OR
        across ranks first (:meth:`_nonfinite_anywhere`)."""
        if worker_grads is not None or not buckets or not all(b.compressing and not b.sync.done for b in buckets):
            return None
        if self.payload_shows_nonfinite and all(isinstance(b.sync.collective(), CompressedAllreduce)
                                                for b in buckets):
            return "payloads"
        return "first call" if self.world_size > 1 else None

    def _locally_finite(self, buckets: list[Bucket], worker_grads=None) -> torch.Tensor:
        """This rank's gradients (or every simulated worker's) are all finite: a 0-d bool tensor, left
        on the device (no sync per tensor on a GPU)."""
        if worker_grads is not None:
            grads = [g for w in worker_grads for g in w if g is not None]
        else:
            grads = [p.grad for b in buckets for p in b.params if p.grad is not None]
        if not grads:
            return torch.ones((), dtype=torch.bool, device=buckets[0].device if buckets else "cpu")
        return all_finite_many(grads)

    def _nonfinite_anywhere(self, buckets: list[Bucket], worker_grads) -> bool:
        """Does any rank (or simulated worker) hold a NaN/inf gradient? One OR across ranks."""
        bad = ~self._locally_finite(buckets, worker_grads).reshape(1)  # read on the host once, below
        if worker_grads is None and self.world_size > 1:
            with self.sync_context.failure("agreement on finite gradients"):
                bad = any_across(bad, self.process_group)
        return bool(bad[0])

    def _skip_step(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            b.reset_step()
        self.skipped_steps += 1
        self._skip_run.append(self._step + 1)
        if len(self._skip_run) >= self.max_consecutive_skips:
            steps, self._skip_run = self._skip_run, []
            raise NonFiniteGradientError(
                f"{type(self).__name__}: {len(steps)} consecutive steps had a NaN/inf gradient on some rank and "
                f"were skipped (optimizer steps {steps}); lower the learning rate, clip gradients, or check the data")
        log.warning(f"{type(self).__name__}: a gradient contains NaN or inf on some rank; optimizer step "
                    f"{self._step + 1} skipped on every rank, no state changed ({self.skipped_steps} skipped so far)")

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

On the cuda backend an optimizer whose compressed update is the collective's sink or kernels predicated on its
flag (``skips_on_device``: 1-bit Adam, QAdam; 1-bit LAMB) decides a compression step on the device, as fused
AdamW's ``found_inf`` does: the calls' flags (with several ranks every rank's, gathered in the calls' agreement
rounds once each collective was verified on the host; in DDP's hook bucket by bucket) are ANDed there, every
write of the step (codes, error state, momentum, parameters) is predicated on the result, and the host reads it
a step later (:meth:`NonFinitePolicy.settle_device_skips`), so nothing on the step's path waits for the device.
The skip count, the ``max_consecutive`` check and "raise" then act at the next ``step()`` (or
``state_dict()``), and a skipped step's step counts are taken back then. 0/1 Adam's synchronisation is decided
there alike, and settles itself (``DeviceStep.settle``: its dropped-gradient counts, and a raise where its payload
was not finite).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..comm import CompressedAllreduce, Verdict, all_finite_many, any_across
from .buckets import Bucket

log = logging.getLogger(__name__)

__all__ = ["NonFiniteGradientError", "NonFinitePolicy", "check_nonfinite_policy"]


class NonFiniteGradientError(ValueError):
    """A gradient contained NaN/inf on some rank; every rank raises at the same step. Parameters and
    moments are untouched; in the DDP hook path with the policy "raise", buckets synchronised earlier
    in that backward have already updated their error state (the policy "skip" checks first), and where
    the device decided the step (the cuda backend) the buckets without the NaN took it and the error
    comes at the next step."""


def check_nonfinite_policy(policy: str, max_consecutive: int) -> None:
    """Validate an ``on_nonfinite`` policy and its bound (the optimizers' and the strategies')."""
    if policy not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {policy!r}")
    if not isinstance(max_consecutive, int) or max_consecutive < 1:
        raise ValueError(f"max_consecutive must be a positive int, got {max_consecutive!r}")


class SkippedEverywhere(Exception):
    """Internal: the first compressed call's agreement found a NaN/inf gradient on some rank, so
    every rank skips the step (the policy "skip"); nothing was written."""


@dataclass
class DeviceStep:
    """A step decided on the device, until the host has read its verdicts (:class:`~lightning_onebit.comm.Verdict`):
    each with the parameters whose step count it advanced (one for ``step()``'s sync, one per bucket for
    DDP's hook), and its number."""

    verdicts: list[tuple[Verdict, list[torch.Tensor]]]
    step: int
    #: what reads this step's verdicts instead of the rules below (0/1 Adam's synchronisation, whose step stands)
    settle: Callable[[DeviceStep], None] | None = None

    def ready(self) -> bool:
        return all(verdict.ready() for verdict, _ in self.verdicts)

    @property
    def on_cuda(self) -> bool:
        return any(verdict.event is not None for verdict, _ in self.verdicts)


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

    def settle_device_skips(self, wait: bool = True) -> None:
        """Read what the device decided for the steps it decided (see the module docstring): a step that
        was skipped there is counted and logged (or raises, with the policy "raise" or after
        ``max_consecutive_skips`` in a row) and its step counts are taken back. ``wait=False`` (what
        ``step()`` does first): only what has reached the host, and the oldest until one step is left
        pending, so the host learns a step late, or two when the device runs behind. A server mean that
        overflowed fp32 raises here, its collective's state reset, as it would at its next call."""
        pending = self._device_steps
        if pending and pending[0].on_cuda and torch.cuda.is_current_stream_capturing():
            return  # a graph capture: querying the device is not allowed, the host learns after it
        while pending and (wait or len(pending) > 1 or pending[0].ready()):
            done = pending.pop(0)
            if done.settle is not None:
                try:
                    done.settle(done)
                except BaseException:
                    pending.clear()
                    raise
                continue
            read = [(verdict.read(), params) for verdict, params in done.verdicts]
            bad = [params for (finite, over), params in read if not finite or over]
            if not bad:
                self._skip_run = []
                continue
            for params in bad:  # what the device skipped changed nothing: its step counts back
                for p in params:
                    self.state[p]["step"] -= 1
            partial = len(bad) < len(read)  # DDP's hook: the buckets whose gradients were finite took the step
            if not partial:
                self._step -= 1  # later steps' numbers with it
                for later in pending:
                    later.step -= 1
            overflowed = [c for (_, over), _ in read for c in over]
            if overflowed:
                pending.clear()
                overflowed[0]._server_overflowed()  # resets its error state and raises
            if self.on_nonfinite == "raise" or partial:
                pending.clear()
                raise NonFiniteGradientError(
                    f"{type(self).__name__}: a gradient of optimizer step {done.step} contained NaN or inf; the "
                    "device skipped " + ("the buckets that held it in DDP's hook (the others took the step)"
                                         if partial else "that step (no state changed)")
                    + " and the host learned it at the next step")
            self._count_skip(done.step)

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
        self._count_skip(self._step + 1)

    def _count_skip(self, step: int) -> None:
        self.skipped_steps += 1
        self._skip_run.append(step)
        if len(self._skip_run) >= self.max_consecutive_skips:
            steps, self._skip_run = self._skip_run, []
            raise NonFiniteGradientError(
                f"{type(self).__name__}: {len(steps)} consecutive steps had a NaN/inf gradient on some rank and "
                f"were skipped (optimizer steps {steps}); lower the learning rate, clip gradients, or check the data")
        log.warning(f"{type(self).__name__}: a gradient contains NaN or inf on some rank; optimizer step "
                    f"{step} skipped on every rank, no state changed ({self.skipped_steps} skipped so far)")

"""0/1 Adam's phase B: local steps that send nothing, and the 1-bit synchronisation that ends an interval.

:class:`LocalSteps` is a mixin of :class:`~lightning_onebit.optim.ZeroOneAdam` (whose docstring has
the update rules): each rank trains its own replica on its own gradients, accumulating the
lr-weighted momentum ``u``; a synchronisation sends ``u / sum(s)`` through the 1-bit collective and
every rank rebuilds the same model from the anchor (the model of the last synchronisation). A
simulated cluster keeps a replica, a momentum and ``u`` per worker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence

import torch

from ..comm import Verdict, all_finite, rank
from ..compress import Source, flat_buffer
from ..compress.source import Sink
from .buckets import Bucket
from .functional import decoupled_update_, local_adam_step_, local_fusable
from .nonfinite import DeviceStep, NonFiniteGradientError
from .sync import nonfinite_is_gradient_error, sync_together

log = logging.getLogger(__name__)

__all__ = ["LocalSteps"]


def flags_stay_on_device(device: torch.device) -> bool:
    """Whether a step keeps numbers it computes on ``device`` there rather than reading them (a local step's
    finiteness flags, 1-bit LAMB's step sizes): anywhere but the CPU, where the read waits for the device's
    queue; there they are free to read."""
    return device.type != "cpu"


class LocalSteps:
    """Mixin: the local steps, synchronisations and replicas of phase B (see the module docstring).
    Expects :class:`~lightning_onebit.optim.ZeroOneAdam`'s state (``_acc``, ``_bad``, ``_local_grads``, ``_local``,
    ``_replicas``, ``_since_sync``, ``_kind``, ``local_state``) and its ``_mask``/``_denominator``."""

    # -- phase B: local steps and synchronisations -------------------------------------------
    def _enter_local(self, buckets: list[Bucket]) -> None:
        """At the freeze (or a resume after it): the anchor and u of every bucket; at the freeze
        itself also a fresh error state, because the collective now carries momenta, not gradients."""
        for b in buckets:
            if "anchor" in b.flat:
                continue
            loaded = all(name in self.state[p] for p in b.params for name in self.local_state)
            for name in self.local_state:
                b.flat[name] = flat_buffer(b.numel, device=b.device)
            self._adopt_state(b)  # copies the loaded values, if any
            if not loaded:
                with torch.no_grad():
                    for p, view in zip(b.params, b.views(b.flat["anchor"]), strict=True):
                        view.copy_(p)
            self._acc.setdefault(b.index, [[0.0] * len(b.params), 1.0])
        if not self._local:
            masked = 0
            for b in buckets:
                b.sync.collective().reset_state()
                masked += 0 if (mask := self._mask(b)) is None else int(mask.sum())
            self._local = True
            if masked and rank() == 0:
                log.warning(f"ZeroOneAdam: the variance froze at step {self._step} with {masked} coordinates that "
                            "never had a gradient at a refresh; they stay where they are (a later var_freeze_step "
                            "trains them)")
        n = self.simulate_workers or 1
        if self._bad is None:
            self._bad = torch.zeros(n, dtype=torch.int64, device=buckets[0].device if buckets else "cpu")
        if self.simulate_workers is not None and not self._replicas:
            self._replicas = [{b.index: {"param": torch.cat([p.detach().reshape(-1) for p in b.params]),
                                         "exp_avg": b.flat["exp_avg"].clone(),
                                         "update_sum": b.flat["update_sum"].clone()} for b in buckets}
                              for _ in range(n - 1)]

    def _worker_state(self, b: Bucket, w: int) -> tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(parameters, m, u) of worker ``w``: this rank's own, or a simulated worker's replica."""
        if w == 0:
            return b.params, b.flat["exp_avg"], b.flat["update_sum"]
        r = self._replicas[w - 1][b.index]
        return b.views(r["param"]), r["exp_avg"], r["update_sum"]

    def _local_step(self, buckets: list[Bucket], worker_grads) -> None:
        self._enter_local(buckets)
        # the gradients of every worker first, where they are: a NaN/inf anywhere in a worker's drops all
        # of its step (it takes zero gradients)
        n = self.simulate_workers or 1
        grads = [[[p.grad for p in b.params] if worker_grads is None else [worker_grads[w][i] for i in b.ids]
                  for w in range(n)] for b in buckets]
        if any(g is not None and g.is_sparse for ws in grads for gs in ws for g in gs):
            raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        dev = buckets[0].device if buckets else torch.device("cpu")
        flats = None
        # fp32 buffers also where the CPU's kernels do not take the tensors (bf16 parameters and gradients)
        if flags_stay_on_device(dev) or not all(local_fusable(b.params, [g for gs in ws for g in gs])
                                                for b, ws in zip(buckets, grads, strict=True)):
            flats, bad = self._local_grads.gather(buckets, grads)
        else:  # reading the flags is free and spares a pass over the gradients
            finite = [[all_finite(g) for ws in grads for g in ws[w] if g is not None] for w in range(n)]
            bad = torch.stack([~torch.stack(f).all() if f else torch.zeros((), dtype=torch.bool, device=dev)
                               for f in finite])
            if bool(bad.any()):
                drop = bad.tolist()
                for ws in grads:
                    for w, gs in enumerate(ws):
                        if drop[w]:
                            gs[:] = [None] * len(gs)
        self._bad += bad
        self._step += 1
        sync = self._kind == "sync"
        # the flat buffers of buckets with one step size, by their hyperparameters: their updates go as one op each
        # for the whole step (a launch each on a GPU), not one a bucket
        batched: dict[tuple[float, ...], tuple[dict, list[tuple]]] = {}
        for i, (b, ws) in enumerate(zip(buckets, grads, strict=True)):
            group = self.param_groups[b.group_index]
            for p in b.params:  # every parameter steps (a missing gradient is zero): counts stay equal on all ranks
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
            sizes = self._step_sizes(b, group["lr"], group["betas"][0])
            acc = self._acc[b.index]
            acc[0] = [a + s for a, s in zip(acc[0], sizes, strict=True)]
            acc[1] *= 1 - group["lr"] * group["weight_decay"]
            mask = self._mask(b)
            d = self._denominator(b, group)
            hp = dict(beta1=group["betas"][0], lr=group["lr"], weight_decay=group["weight_decay"])
            for w, gs in enumerate(ws):
                params, m, u = self._worker_state(b, w)
                if flats is not None and len(set(sizes)) == 1:
                    # a synchronising step rebuilds the parameters from the anchor right after: not moved then
                    moved = () if sync else (params, b.kept_views("exp_avg", m) if w == 0 else b.views(m),
                                             b.kept_views("denom", d), sizes)
                    row = (flats[i][w], m, u, d, mask, sizes[0], moved)
                    batched.setdefault(tuple(hp.values()), (hp, []))[1].append(row)
                    continue
                if flats is not None:
                    gs = b.views(flats[i][w])
                # a synchronising step rebuilds the parameters from the anchor: moving them first is wasted
                local_adam_step_(params, gs, b.views(m), b.views(u), b.views(d),
                                 None if mask is None else b.views(mask), sizes, **hp, move_params=not sync)
            b.reset_step()
        for hp, rows in batched.values():
            g, m, u, d, mask, s, moved = zip(*rows, strict=True)
            local_adam_step_(None, g, m, u, d, None if all(k is None for k in mask) else mask, s, **hp,
                             move_params=False)
            if not sync:
                params, ms, ds, sizes = ([x for r in moved for x in r[k]] for k in range(4))
                decoupled_update_(params, ms, ds, sizes, lr=hp["lr"], weight_decay=hp["weight_decay"])
        self._since_sync += 1
        if sync:
            try:
                self._synchronise_local(buckets)
            except BaseException:
                self._move_unsynced(buckets)  # the model a raising synchronisation leaves: after the local step
                raise
        self.comm_counter.end_step()
        self.intra_node_counter.end_step()

    def _move_unsynced(self, buckets: list[Bucket]) -> None:
        """The parameter half of this step's local update, for the buckets that were not synchronised."""
        for b in buckets:
            if b.cache.pop("synced", False):
                continue
            group = self.param_groups[b.group_index]
            sizes = self._step_sizes(b, group["lr"], group["betas"][0])
            for w in range(self.simulate_workers or 1):
                params, m, _ = self._worker_state(b, w)
                decoupled_update_(params, b.views(m), b.views(self._denominator(b, group)), sizes, lr=group["lr"],
                                  weight_decay=group["weight_decay"])

    def _synchronise_local(self, buckets: list[Bucket]) -> None:
        """The 1-bit synchronisation that ends a local interval: every rank gets the same momentum and
        rebuilds the same model from the anchor. The buckets' calls run together (:func:`~.sync.sync_together`):
        their agreements read once, their round trips overlapped (about 3 a synchronisation, not 3 a bucket).

        Where a read would wait for the device (a GPU) nothing is read: the calls are decided there (the cuda
        backend: the rebuild's decode predicated on every rank's input being finite), the dropped-gradient counts
        and the agreements reach the host by copies that do not wait, and :meth:`_settle_sync` reads them at the
        next step, as the other algorithms' device-decided steps are read."""
        on_device = self.simulate_workers is None and bool(buckets) and flags_stay_on_device(buckets[0].device)
        if on_device:
            counts = self._dropped_counts()
            # with several ranks the count rides in the first agreement as it is, gathered with the signatures
            dropped = self._bad if self.world_size > 1 else None
        else:
            counts = self._bad.tolist()  # the one host read of the dropped-gradient counts per interval
            self.dropped_gradients += sum(counts)
            dropped = counts[0] > 0
        for b in buckets:
            mask = self._mask(b)
            if mask is not None and "mask_idx" not in b.cache:
                b.cache["mask_idx"] = mask.nonzero().view(-1)
        if self.simulate_workers is None:
            # the flag rides in the first bucket's agreement: every rank learns there that one dropped a gradient
            verdict = sync_together(_Interval(self, dropped, buckets[0] if buckets else None, on_device),
                                    [(b.sync, None, None) for b in buckets])
            if on_device:
                self._device_steps.append(DeviceStep([] if verdict is None else [(verdict, [])], self._step,
                                                     settle=functools.partial(self._settle_sync, counts=counts)))
        rebuilt: list[tuple] = []
        try:
            for i, b in enumerate(buckets):
                self._sync_bucket(i, b, counts, rebuilt)
        finally:  # the buckets rebuilt so far take their parameters (a raise leaves the others to _move_unsynced)
            self._copy_from_anchor(rebuilt)
        for b in buckets:
            b.cache.pop("synced", None)
            b.reset_step()  # sync_together marked its calls done: the next step's sync is its own
        self._bad.zero_()
        self._since_sync = 0

    def _sync_bucket(self, i: int, b: Bucket, counts, rebuilt: list[tuple]) -> None:
        """Bucket ``b``'s part of a synchronisation: a simulated cluster's call (the real calls ran together
        already), then its rebuild."""
        if self.simulate_workers is not None:
            comm = b.sync.collective()
            if b.sync.payload is None:
                b.sync.payload = flat_buffer(b.numel, device=b.device, zero=False)
            outs = [b.sync.payload, *b.worker_buffers("payload", self.simulate_workers)[1:]]
            payloads = [self._interval_payload(b, w, out) for w, out in enumerate(outs)]
            defer = {"defer": True} if hasattr(comm, "decode_pending") else {}
            with nonfinite_is_gradient_error(type(self).__name__):
                comm.allreduce_into(payloads, b.synced, flags=[c > 0 for c in counts], **defer)
            if i == 0 and comm.any_flag:
                self._report_dropped(self._step)  # a raise leaves the result undecoded: nothing changed yet
        self._rebuild(b, rebuilt)

    def _interval_payload(self, b: Bucket, w: int, out: torch.Tensor) -> Source:
        """Worker ``w``'s lr-weighted mean momentum of the interval, ``u / sum(s)``, read by the codec where it
        is; this rank's expression keeps its kernel arguments in the bucket's cache (a new sum each time)."""
        _, _, u = self._worker_state(b, w)
        idx = None if self._mask(b) is None else b.cache["mask_idx"]
        return Source.quotient(u, self._acc[b.index][0], groups=b.offsets, mask=idx, masked="zero", out=out,
                               cache=b.cache if w == 0 else None)

    def _rebuild(self, b: Bucket, rebuilt: list[tuple]) -> None:
        """After bucket ``b``'s call: m <- the synced momentum, the anchor moved by the interval, and every
        worker's momentum rebuilt from it; its parameters and u (copied from the anchor, zeroed) go into
        ``rebuilt`` for :meth:`_copy_from_anchor`."""
        group = self.param_groups[b.group_index]
        sums, decay = self._acc[b.index]
        comm, mask = b.sync.collective(), self._mask(b)
        idx = None if mask is None else b.cache["mask_idx"]
        m, anchor, synced = b.flat["exp_avg"], b.flat["anchor"], b.synced
        d = self._denominator(b, group)
        if getattr(comm, "pending", False):
            # m <- the synced momentum and the anchor's update in one pass
            comm.decode_pending(Sink(numel=b.numel, groups=b.offsets, targets=b.kept_views("anchor", anchor),
                                     denom=d, values=[-s for s in sums], decay=decay, mask=idx, cache=b.cache),
                                out=m)
        else:
            m.copy_(synced)
            if mask is not None:
                m.masked_fill_(mask, 0.0)
            anchor.mul_(decay)
            if len(set(sums)) == 1:
                anchor.addcdiv_(m, d, value=-sums[0])
            else:
                for av, mv, dv, s in zip(b.views(anchor), b.views(m), b.views(d), sums, strict=True):
                    av.addcdiv_(mv, dv, value=-s)
        for w in range(self.simulate_workers or 1):
            params, wm, u = self._worker_state(b, w)
            if wm is not m:
                wm.copy_(m)
            rebuilt.append((params, b.kept_views("anchor", anchor), u))
        b.cache["synced"] = True
        self._acc[b.index] = [[0.0] * len(b.params), 1.0]

    @staticmethod
    @torch.no_grad()
    def _copy_from_anchor(rebuilt: list[tuple]) -> None:
        """The rebuilt buckets' parameters copied from their anchors and their u zeroed, one foreach op each for
        all of them."""
        if rebuilt:
            torch._foreach_copy_([p for r in rebuilt for p in r[0]], [a for r in rebuilt for a in r[1]])
            torch._foreach_zero_([r[2] for r in rebuilt])

    def _report_dropped(self, step: int, late: bool = False) -> None:
        msg = (f"ZeroOneAdam: a rank dropped a NaN/inf gradient in a local step before optimizer step {step} "
               f"({self.dropped_gradients} dropped on this rank so far)")
        if self.on_nonfinite == "raise":
            where = ("the synchronisation, decided on the device, left it out and the host learned it at the next "
                     "step" if late else "every rank stops here, before this synchronisation changes the model")
            raise NonFiniteGradientError(f"{msg}; {where} (set_nonfinite_policy('skip') goes on without those "
                                         "gradients)")
        log.warning(msg + "; the step went on without it")

    def _dropped_counts(self) -> Verdict:
        """The interval's dropped-gradient counts on their way to the host, by a copy into pinned memory that does
        not wait (buffers made once, reused in turn as :class:`~lightning_onebit.comm.Verdict`'s are)."""
        ring = self._count_ring
        if ring is None or ring[0].shape != self._bad.shape:
            ring = self._count_ring = Verdict.buffers(self._bad)
        return Verdict(self._bad, [], ring)

    def _settle_sync(self, done: DeviceStep, counts: Verdict) -> None:
        """What the host learns a step after a synchronisation decided on the device: the counts of dropped
        gradients (reported on every rank when some rank dropped one), and whether the calls went through. One that
        did not (an interval's payload past fp32 on some rank) left the anchor and the momentum as they were, and
        every rank's model at the anchor: it raises, as the host's check raises at once where it reads."""
        dropped = counts.values().tolist()
        self.dropped_gradients += sum(dropped)
        flagged = any(dropped) if self.world_size == 1 else False
        for verdict, _ in done.verdicts:
            finite, overflowed = verdict.read()
            if overflowed:
                overflowed[0]._server_overflowed()  # resets its error state and raises
            if not finite:
                raise NonFiniteGradientError(
                    f"{type(self).__name__}: the synchronisation at optimizer step {done.step} had a NaN/inf "
                    "payload on some rank; the device skipped its update, every rank went back to the model of the "
                    "synchronisation before, and the host learned it at the next step")
            flagged = flagged or verdict.flagged()
        if flagged:  # with several ranks and no verdict the agreement was read, and reported it there
            self._report_dropped(done.step, late=True)

    # -- replicas --------------------------------------------------------------------------
    def sync_replicas(self) -> bool:
        """Synchronise the local steps since the last round now (one 1-bit round, counted in
        ``flushes``); the schedule goes on as before. Nothing to do outside phase B or right after
        a synchronisation. Collective."""
        if not self._local or self._since_sync == 0:
            return False
        self._synchronise_local(self._build_buckets())
        self.flushes += 1
        self.comm_counter.end_round()
        self.intra_node_counter.end_round()
        return True

    def worker_parameters(self, worker: int) -> contextlib.AbstractContextManager:
        super().worker_parameters(worker)  # validates
        return self._swapped_in(worker)

    @contextlib.contextmanager
    def _swapped_in(self, worker: int) -> Iterator[None]:
        if worker == 0 or not self._replicas:
            yield
            return
        own = [(p, p.detach().clone()) for b in self._buckets for p in b.params]
        with torch.no_grad():
            for b in self._buckets:
                for p, view in zip(b.params, self._worker_state(b, worker)[0], strict=True):
                    p.copy_(view)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in own:
                    p.copy_(saved)


class _Interval:
    """The synchronisation of a local interval as :func:`~.sync.sync_together` runs it (its
    :class:`~.sync.Algorithm`): the payload is each bucket's ``u / sum(s)``, the first bucket's agreement
    carries whether this rank dropped a gradient, and the result is left for :meth:`LocalSteps._rebuild`, which
    decodes it into the anchor: nothing is absorbed before every call has completed."""

    def __init__(self, opt: LocalSteps, dropped: bool | torch.Tensor | None, first: Bucket | None,
                 on_device: bool) -> None:
        self.opt, self.dropped, self.first = opt, dropped, first
        # the rebuild's writes are the deferred decode's, predicated on the calls' flags, and the parameters' copy
        # of the anchor, which is where they go either way; the flag is read with the agreement elsewhere
        self.skips_on_device = on_device

    def _payload(self, b: Bucket, grad, out: torch.Tensor) -> Source:
        return self.opt._interval_payload(b, 0, out)

    def _flag(self, b: Bucket, grad) -> bool | torch.Tensor | None:
        return self.dropped if b is self.first else None

    def _on_flag(self, b: Bucket, grads, simulated: bool) -> None:
        # the first bucket's call was decoded (not deferred) and nothing else was: a raise changes no model
        self.opt._report_dropped(self.opt._step)

    def _sync_target(self, b: Bucket) -> torch.Tensor:
        return b.synced

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        pass  # _rebuild, once every call has completed

    def _defers(self, b: Bucket) -> bool:
        return True

"""The optimizer's side of its buckets' synchronisation: what they share, what an algorithm defines, and pass 1
of a step (every bucket's gradient synchronised, :meth:`SyncPlumbing._synchronise`).

:class:`SyncPlumbing` is a base of :class:`~lightning_onebit.optim.CompressedOptimizer`. Its only state is
``self.sync_context`` (:class:`~.sync.SyncContext`: the group, topology and byte counters every bucket's
:class:`~.sync.BucketSync` shares), which it exposes under the optimizer's public names, and the hooks of
the :class:`~.sync.Algorithm` protocol with their defaults, which each algorithm overrides: the payload,
where the result goes, how it is absorbed, the flag the collective agrees on, and whether the update
decodes the result itself. Pass 1 leaves the verdict of a step decided on the device in the optimizer's
``_verdict``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..comm import any_across
from ..compress import Source
from .buckets import Bucket
from .sync import BucketSync, SyncContext, sync_together
from .warmup_mean import warmup_mean

__all__ = ["SyncPlumbing"]


def _shared(path: str, doc: str) -> property:
    """A read-only property: ``self.sync_context`` at the dotted ``path``."""
    get = operator.attrgetter(f"sync_context.{path}")
    return property(get, doc=doc)


class SyncPlumbing:
    """Base of the compressed optimizers: the shared synchronisation context and the algorithm's hooks."""

    sync_context: SyncContext
    _buckets: list[Bucket]

    # -- what the buckets share: the group, topology and counters --------------------------
    @property
    def process_group(self) -> Any:
        """The ranks that average (``None``: the default group; DDP's once attached)."""
        return self.sync_context.group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self.sync_context.group = group

    # read-only views of the context, under the optimizer's public names
    simulate_workers = _shared("simulate_workers", "A simulated cluster of that many workers (int), or None.")
    comm_counter = _shared("counter", "The ByteCounter of the bytes this rank sent (between nodes, with the "
                                      "two-level collective), per step and in total.")
    intra_node_counter = _shared("intra_counter", "The ByteCounter of the two-level collective's fp32 bytes "
                                                  "inside a node.")
    topology = _shared("topology", "The Topology its collectives run on (flat or two-level).")
    hierarchical = _shared("topology.hierarchical", "The two-level collective (fp32 inside a node, compressed "
                           "between nodes): None = automatic, on with several nodes of several ranks each; see "
                           "set_topology.")
    ranks_per_node = _shared("topology.ranks_per_node", "Ranks per node (int); None: the launcher's "
                             "LOCAL_WORLD_SIZE.")

    @property
    def warmup_comm_dtype(self) -> torch.dtype:
        """The dtype the warm-up's mean travels in (``torch.uint8``: 8-bit codes)."""
        return self.warmup_wire.torch_dtype

    def set_topology(self, *, hierarchical: bool | None = None, ranks_per_node: int | None = None) -> None:
        """Choose the flat or the two-level collective before the first compressed step.

        ``hierarchical=None`` (automatic) uses the two-level one when the default group spans several
        nodes of several ranks each; ``ranks_per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE``
        (ranks laid out ``node * ranks_per_node + local_rank``, as torchrun and Lightning lay them out).
        A layout whose ranks per node do not divide the world size falls back to flat, logged."""
        if (hierarchical, ranks_per_node) == (self.hierarchical, self.ranks_per_node):
            return
        if any(b.sync.comm is not None or b.sync.warmup_comm is not None for b in self._buckets):
            raise RuntimeError(f"{type(self).__name__}.set_topology: the collectives exist already; call it "
                               "before the first compressed step (or before loading a state_dict)")
        self.topology.set(hierarchical=hierarchical, ranks_per_node=ranks_per_node)

    def _bucket_sync(self, b: Bucket) -> BucketSync:
        """The synchronisation state of a new bucket: the wire, mode and block size of its param group."""
        return BucketSync(b, self.sync_context, wire=self.wire, mode=self.comm_mode,
                          block_size=self.param_groups[b.group_index].get("block_size"), warmup_wire=self.warmup_wire)

    # -- layout --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sync_context.world_size

    # -- the algorithm's side of a compressed sync (sync.Algorithm) ---------------------------------
    #: the payload reads the gradients where they are (a Source over the parameters' ``.grad``), so the
    #: compression phase copies no gradient into the bucket (outside DDP's hook)
    payload_reads_grads: ClassVar[bool] = False
    #: the update decodes the synchronised result itself (``_update_compressed`` calls the collective's
    #: ``decode_pending``), so that the decode and the parameter update are one pass over the bucket
    decodes_in_update: ClassVar[bool] = False

    def _payload(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None],
                 out: torch.Tensor) -> Source | None:
        """The local quantity to synchronise, from the local gradient (``b.grad``-like and flat, or one
        tensor per parameter where ``payload_reads_grads``): a :class:`~..compress.source.Source` the
        codec evaluates where it reads it, or ``None`` after writing it (fp32) to ``out``, which also
        serves as the buffer a Source is materialised into by a backend that cannot read it."""
        raise NotImplementedError

    def _sync_target(self, b: Bucket) -> torch.Tensor:
        """Where the collective writes its result. The collective writes only after every rank
        agreed the inputs are finite, so a state buffer may be the target directly (one full
        copy per step less); a failed call leaves it untouched."""
        return b.synced

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        """Fold the synchronised quantity into the bucket's state (e.g. momentum <- synced)."""

    def _flag(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None]) -> int | None:
        """A number the collective agrees on at no cost (every rank's, and their OR), e.g. "the bytes this
        rank has about coordinates the optimizer masks"; ``None``: no flag."""
        return None

    def _on_flag(self, b: Bucket, grads: Sequence, simulated: bool) -> None:
        """Called on every rank when some rank's flag was set (``grads``: the local gradient, or with
        ``simulated`` every simulated worker's; each flat, or one tensor per parameter)."""

    def _defers(self, b: Bucket) -> bool:
        """The update decodes ``b``'s result (:attr:`decodes_in_update`, parameters a sink can update)."""
        return self.decodes_in_update and self._sink_targets(b) is not None

    @staticmethod
    def _sink_targets(b: Bucket) -> list[torch.Tensor] | None:
        """The bucket's parameters as a decode sink updates them (contiguous fp32), else None."""
        ps = SyncPlumbing._detached(b)
        return ps if b.cache["params_fp32"] else None

    @staticmethod
    def _detached(b: Bucket) -> list[torch.Tensor]:
        """The bucket's parameters detached, made once per bucket and parameter memory (a step makes none)."""
        key = tuple((id(p), p.data_ptr()) for p in b.params)
        if b.cache.get("params_key") != key:
            ps = [p.detach() for p in b.params]
            b.cache["params_key"], b.cache["params_detached"] = key, ps
            b.cache["params_fp32"] = all(p.dtype == torch.float32 and p.is_contiguous() for p in ps)
        return b.cache["params_detached"]

    def _flush_pending(self) -> None:
        """Decode every result a bucket left for its update (before anything reads the state)."""
        for b in self._buckets:
            b.sync.decode(self)

    # -- pass 1 of a step: every bucket synchronised ---------------------------------------------
    def _has_grad(self, buckets: list[Bucket], worker_grads) -> list[list[bool]]:
        """Which parameters of each bucket have a gradient on some rank (or simulated worker)."""
        if worker_grads is not None:
            return [[any(wg[i] is not None for wg in worker_grads) for i in b.ids] for b in buckets]
        has = [[p.grad is not None for p in b.params] for b in buckets]
        # DDP leaves grad None on every rank for a parameter no rank used; others must agree here
        local = [i for i, b in enumerate(buckets) if not b.via_ddp]
        if local and self.world_size > 1:
            flags = torch.tensor([h for i in local for h in has[i]], dtype=torch.bool)
            with self.sync_context.failure("agreement on which parameters have gradients"):
                agreed = any_across(flags, self.process_group).tolist()
            for i in local:
                has[i], agreed = agreed[: len(has[i])], agreed[len(has[i]) :]
        return has

    def _grad_route(self, b: Bucket, has: list[bool], worker_grads) -> tuple:
        """How bucket ``b``'s gradients reach this step: (the simulated workers', or None; this rank's where they
        are, or None; a warm-up's averaged ones where they are, or None; whether they are copied into ``b.grad``
        first)."""
        s = b.sync
        # a compressed sync whose payload reads the gradients where they are copies none of them, unless its
        # codec's kernels read one flat buffer (a GPU's): then the copy is this step's one for all buckets
        in_place = b.compressing and self.payload_reads_grads and not s.done and not (b.via_ddp and s.ready)
        wflat = None
        if worker_grads is not None:
            wflat = ([[wg[i] for i in b.ids] for wg in worker_grads] if in_place
                     else self._worker_flat(b, worker_grads))
        own = (self._own_grads(b) if in_place and wflat is None and not (any(has) and _gathers_ends(b))
               else None)
        # a warm-up whose gradient is averaged already (one rank, or DDP's allreduce) may run on
        # the parameters' own gradients: no copy into the bucket
        direct = None
        averaged = self.world_size == 1 or b.via_ddp  # DDP's hook averaged it (dense, or as codes)
        if wflat is None and not b.compressing and averaged and any(has):
            direct = self._warmup_on_own_grads(b, has)
        copy = (wflat is None and direct is None and own is None and not s.done
                and not (b.via_ddp and b.compressing and s.ready))
        return wflat, own, direct, copy

    def _synchronise(self, buckets: list[Bucket], worker_grads, finite: torch.Tensor | None = None, *,
                     carry_finite: bool = False) -> list[tuple]:
        """Pass 1 of a step: every bucket's gradient synchronised (a NaN anywhere raises before any
        update); returns (bucket, has_grad, averaged warm-up gradient, state to put back) per bucket.
        ``finite`` (the policy "skip"): this rank's gradients are all finite, sent with the first
        compressed call's agreement, which raises :class:`SkippedEverywhere` on every rank if not;
        ``carry_finite``: the calls' own scale reductions check it instead (:func:`.sync.sync_together`)."""
        has_all = self._has_grad(buckets, worker_grads)
        routes = [self._grad_route(b, has, worker_grads) for b, has in zip(buckets, has_all, strict=True)]
        # the buckets that read their gradients from their own buffer: every one of them filled by one foreach copy
        gather = [b for b, route in zip(buckets, routes, strict=True) if route[3]]
        if gather:
            self._gather_grads(gather)
        plan, calls = [], []
        for b, has, (wflat, own, direct, _) in zip(buckets, has_all, routes, strict=True):
            s = b.sync
            skipped = [i for i, h in enumerate(has) if not h]
            grad, saved = None, []
            if not any(has):
                pass
            elif b.compressing:
                if s.done:  # synchronised in the DDP hook, which kept the state of locally unused params
                    saved = [k for k in s.pending if not has[k[0]]]
                else:
                    if wflat is None and self.world_size == 1 and not self.payload_shows_nonfinite:
                        # else the collective's scale check sees it
                        self._check_finite([g for g in own if g is not None] if own is not None else b.grad,
                                           "gradient")
                    saved = self._snapshot(b, skipped)
                    if wflat is None:  # synchronised below, the calls' phases interleaved
                        calls.append((s, own, finite))
                    else:
                        s.run_simulated(self, wflat)
                    finite = None  # the first call carries it: later calls need not
            elif direct is not None:
                self._check_finite(direct, "averaged gradient")
                grad = direct
            else:
                saved = self._snapshot(b, skipped)
                grad = warmup_mean(s, wflat)
                self._check_finite(grad, "averaged gradient")
            plan.append((b, has, grad, saved))
        self._verdict = sync_together(self, calls, carry_finite=carry_finite)
        return plan


def _gathers_ends(b: Bucket) -> bool:
    """Bucket ``b``'s compressed call would copy its payload's gradients into one flat buffer (its codec's kernels
    read that, not each gradient where it is)."""
    codec = getattr(b.sync.collective(), "codec", None)
    return codec is not None and codec.gathers_ends(b.device)

"""The compressed synchronisation of one bucket, the collective it runs on, and failures of the group.

:class:`BucketSync` is a mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`. A bucket's
collective is made at its first compressed sync: flat (:class:`~lightning_onebit.comm.CompressedAllreduce`)
or two-level (:class:`~lightning_onebit.comm.HierarchicalAllreduce`), or a simulated cluster. A sync
forms the payload (a :class:`~lightning_onebit.compress.Source` the codec evaluates where it reads
it), runs the collective, and folds the result into the state, or leaves its decode to the update
(``decodes_in_update``: one pass decodes and updates the parameters). The optimizer never calls
torch.distributed directly; it goes through the comm layer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from ..comm import (
    CompressedAllreduce,
    HierarchicalAllreduce,
    NonFiniteInputError,
    SimulatedCluster,
    SimulatedHierarchicalCluster,
    mean_allreduce,
    node_groups,
    ring_allreduce_bytes,
    wire_dtype,
)
from ..comm.dense import WIRE_DTYPES, launcher_ranks_per_node
from ..compress import Codec, MinMaxUInt8Codec, Source, flat_buffer
from .buckets import Bucket, _simulated_mean
from .nonfinite import NonFiniteGradientError, SkippedEverywhere
from .sparse_warmup import SparseWarmupMean

log = logging.getLogger(__name__)

__all__ = ["WARMUP_CODE_BLOCK", "BucketSync", "CollectiveError", "warmup_wire"]

#: ``warmup_comm_dtype="uint8"``: one (min, max) per this many elements of a tensor, so that an embedding
#: row whose width is a multiple of it and that got no gradient on any rank stays exactly zero (a constant
#: block decodes exactly), as it does in fp32; 8 B of scales per 128 B of codes
WARMUP_CODE_BLOCK = 128


def warmup_wire(dtype: torch.dtype | str | None) -> torch.dtype:
    """``warmup_comm_dtype`` resolved: a dense wire dtype (``None``: fp32) or ``torch.uint8`` (8-bit codes)."""
    return wire_dtype(dtype, "warmup_comm_dtype", {**WIRE_DTYPES, "uint8": torch.uint8})


class CollectiveError(RuntimeError):
    """A collective of the optimizer failed (another rank died, stalled past the process group's
    timeout, or the network broke); the message names the collective, the bucket and the step."""

    @classmethod
    def lost(cls, failed: str, exc: BaseException, then: str = "") -> CollectiveError:
        """``failed`` (what failed, and where) on this rank, with the process group's error ``exc``."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return cls(f"{failed} on rank {rank}: {exc}. Another rank has probably died or stalled; the process "
                   f"group's timeout bounds the wait{then}")


def _spans_the_world(group) -> bool:
    """``group`` holds every rank in rank order (the default group, or DDP's handle of it)."""
    if group is None:
        return True
    return dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))


class BucketSync(SparseWarmupMean):
    """Mixin: the collective of each bucket and its compressed synchronisation (see the module docstring)."""

    def set_topology(self, *, hierarchical: bool | None = None, ranks_per_node: int | None = None) -> None:
        """Choose the flat or the two-level collective before the first compressed step.

        ``hierarchical=None`` (automatic) uses the two-level one when the default group spans several
        nodes of several ranks each; ``ranks_per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE``
        (ranks laid out ``node * ranks_per_node + local_rank``, as torchrun and Lightning lay them out).
        A layout whose ranks per node do not divide the world size falls back to flat, logged."""
        if (hierarchical, ranks_per_node) == (self.hierarchical, self.ranks_per_node):
            return
        if any(b.comm is not None or b.warmup_comm is not None for b in self._buckets):
            raise RuntimeError(f"{type(self).__name__}.set_topology: the collectives exist already; call it "
                               "before the first compressed step (or before loading a state_dict)")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")
        self.hierarchical, self.ranks_per_node = hierarchical, ranks_per_node

    def _groups_of_nodes(self, ranks_per_node: int) -> tuple:
        """(node group, cross-node group) of this rank, created once (creation is collective)."""
        if self._node_groups is None:
            self._node_groups = node_groups(ranks_per_node)
        return self._node_groups

    def _ranks_per_node(self) -> int | None:
        """Ranks per node when buckets use the two-level collective, else None (flat)."""
        if self.hierarchical is False:
            return None
        local = self.ranks_per_node
        if local is None and self.simulate_workers is None:
            local = launcher_ranks_per_node()
        n = self.world_size
        why = None
        if self.simulate_workers is None and not _spans_the_world(self.process_group):
            why = "it runs on a group of every rank only (node groups are cut from the default group)"
        elif local is None:
            why = "the ranks per node are unknown (set_topology(ranks_per_node=...) or LOCAL_WORLD_SIZE)"
        elif n % local:
            why = f"{local} ranks per node do not divide the world size {n}"
        elif self.hierarchical is None and (local == 1 or local == n):
            return None  # one node, or one rank per node: nothing to gain
        if why is not None:
            if self.hierarchical:
                log.warning(f"{type(self).__name__}: the two-level collective falls back to flat: {why}")
            return None
        return local

    @contextlib.contextmanager
    def _nonfinite_is_gradient_error(self) -> Iterator[None]:
        """A collective that found a non-finite input on some rank raises :class:`NonFiniteGradientError`."""
        try:
            yield
        except ValueError as exc:
            if "not finite" in str(exc):
                raise NonFiniteGradientError(
                    f"{type(self).__name__}: {exc}. Lower the learning rate or clip gradients.") from exc
            raise

    @contextlib.contextmanager
    def _collective(self, what: str, b: Bucket | None = None) -> Iterator[None]:
        """Name the collective, bucket and step in a failure of the process group (a rank that died
        fails its peers' next collective at once, one that stalls after the group's timeout)."""
        try:
            yield
        except (ValueError, CollectiveError):  # agreement mismatches and non-finite inputs say it already
            raise
        except RuntimeError as exc:
            where = "" if b is None else f" of bucket {self._buckets.index(b)} ({b.numel} elements)"
            raise CollectiveError.lost(
                f"{type(self).__name__}: the {what}{where} failed at optimizer step {self._step + 1}", exc) from exc

    # -- the compressed synchronisation of one bucket ------------------------------------
    def _make_codec(self, b: Bucket) -> Codec:
        raise NotImplementedError

    def _comm_for(self, b: Bucket):
        if b.comm is None:
            b.comm = self._new_collective(b, self._make_codec(b), self.comm_mode)
        return b.comm

    def _new_collective(self, b: Bucket, codec: Codec, mode: str):
        """A collective of ``b``'s size: flat, two-level or simulated, as the topology says."""
        # groups: one scale never spans two parameter tensors of the bucket
        if self.simulate_workers is not None and (local := self._ranks_per_node()) is not None:
            comm = SimulatedHierarchicalCluster(codec, mode, self.simulate_workers // local, local,
                                                counter=self.comm_counter, intra_counter=self.intra_node_counter,
                                                groups=b.offsets)
        elif self.simulate_workers is not None:
            comm = SimulatedCluster(codec, mode, self.simulate_workers, counter=self.comm_counter, groups=b.offsets)
        elif (local := self._ranks_per_node()) is not None:
            lg, cg = self._groups_of_nodes(local)
            comm = HierarchicalAllreduce(codec, mode, local_group=lg, cross_group=cg, counter=self.comm_counter,
                                         intra_counter=self.intra_node_counter, groups=b.offsets)
        else:
            # verify="always": the per-call agreement is also how every rank learns that
            # some rank's gradient was not finite, so they all skip the step together
            comm = CompressedAllreduce(codec, mode, group=self.process_group, counter=self.comm_counter,
                                       verify="always", groups=b.offsets)
        comm.bind(b.numel, b.device)  # state exists before the first sync (see _snapshot)
        return comm

    # -- the warm-up's mean --------------------------------------------------------------
    @property
    def _warmup_in_codes(self) -> bool:
        """The warm-up mean travels as 8-bit codes through the optimizer's buckets (not DDP's all-reduce)."""
        return self.warmup_comm_dtype == torch.uint8

    def _warmup_wire(self) -> torch.dtype | None:
        """The dtype a dense warm-up mean travels in, ``None`` for the buckets' own fp32."""
        return None if self.warmup_comm_dtype in (torch.float32, torch.uint8) else self.warmup_comm_dtype

    def _average_warmup(self, b: Bucket, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The mean gradient of a bucket in the warm-up: exactly as DDP computes it (fp32), sent in
        ``warmup_comm_dtype`` bf16/fp16 as PyTorch's compress hooks send it, or as 8-bit codes."""
        n = len(worker_grads) if worker_grads is not None else self.world_size
        if worker_grads is None and b.via_ddp:
            return b.grad  # gathered from the parameters, where DDP's hook left the mean (dense, or as codes)
        if self._warmup_in_codes and n > 1:
            return self._coded_warmup_mean(b, worker_grads)
        wire = self._warmup_wire()
        if worker_grads is not None:  # simulation: (g_0 / n) + (g_1 / n) + ... in worker order
            _simulated_mean(worker_grads, out=b.grad, scratch=b.worker_buffers("quotient", 1)[0], dtype=wire)
            size = 4 if wire is None else wire.itemsize  # counted as the real path counts its allreduce
            self.comm_counter.add(ring_allreduce_bytes(b.numel, n, size), b.numel, n)
        else:
            with self._collective(f"{self.warmup_comm_dtype} allreduce (warm-up)", b):
                mean_allreduce(b.grad, self.process_group, self.comm_counter, dtype=wire)
        return b.grad

    def _coded_warmup_mean(self, b: Bucket, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The warm-up mean through the two-stage collective with QAdam's 8-bit min-max codes, no error
        feedback (nothing to carry across steps or into a checkpoint): each rank's gradient quantised,
        the server's mean quantised again, every tensor its own (min, max) per ``WARMUP_CODE_BLOCK``."""
        if worker_grads is not None:
            out = b.worker_buffers("warm-up mean", 1)[0]
            with self._nonfinite_is_gradient_error():
                if not self._simulated_sparse_warmup(b, worker_grads, out):
                    self._warmup_comm(b).allreduce_into(worker_grads, out)
            return out
        self._coded_warmup_start(b)
        return self._coded_warmup_complete(b)

    def _warmup_comm(self, b: Bucket):
        if b.warmup_comm is None:
            b.warmup_comm = self._new_collective(b, MinMaxUInt8Codec(block_size=WARMUP_CODE_BLOCK), "plain")
        return b.warmup_comm

    @staticmethod
    def _coded_warmup_name(comm) -> str:
        """The collective's name in errors, the same in every phase of a call."""
        return f"uint8 allreduce (warm-up, {type(comm).__name__})"

    def _coded_warmup_start(self, b: Bucket) -> None:
        """:meth:`_coded_warmup_mean` of this rank's ``b.grad`` up to its stage 1 on the wire (the flat
        collective; the two-level one runs whole here); a non-finite input raises on every rank."""
        with self._nonfinite_is_gradient_error(), self._collective("sparse mean (warm-up)", b):
            b.warmup_mean_ready = self._sparse_warmup(b)
        if b.warmup_mean_ready:
            return
        comm = self._warmup_comm(b)  # made only when codes go: a bucket that always goes sparse never pays its buffers
        with self._nonfinite_is_gradient_error(), self._collective(self._coded_warmup_name(comm), b):
            if isinstance(comm, CompressedAllreduce):
                comm.start(b.grad)
            else:
                comm(b.grad, out=b.worker_buffers("warm-up mean", 1)[0])

    def _coded_warmup_relay(self, b: Bucket) -> None:
        """Put the server rows of a call :meth:`_coded_warmup_start` began on the wire (stage 3), which
        :meth:`_coded_warmup_complete` would otherwise do: so that they travel while the caller blocks on
        something else (another bucket's sparse mean). Nothing to do for a mean that is whole already."""
        comm = b.warmup_comm
        if not b.warmup_mean_ready and isinstance(comm, CompressedAllreduce):
            with self._collective(self._coded_warmup_name(comm), b):
                comm.relay()

    def _coded_warmup_complete(self, b: Bucket) -> torch.Tensor:
        """The rest of a call :meth:`_coded_warmup_start` began: the mean, in the bucket's buffer."""
        comm, out = b.warmup_comm, b.worker_buffers("warm-up mean", 1)[0]
        if b.warmup_mean_ready:  # the sparse mean, whole already
            b.warmup_mean_ready = False
        elif isinstance(comm, CompressedAllreduce):
            with self._collective(self._coded_warmup_name(comm), b):
                comm.complete(out=out)
        return out

    #: the payload reads the gradients where they are (a Source over the parameters' ``.grad``), so the
    #: compression phase copies no gradient into the bucket (outside DDP's hook)
    payload_reads_grads: ClassVar[bool] = False

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

    def _flag(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None]) -> bool | None:
        """A bit the collective agrees on at no cost (OR over ranks), e.g. "a gradient reached a
        coordinate the optimizer masks"; ``None``: no flag."""
        return None

    def _on_flag(self, b: Bucket, grads: Sequence, simulated: bool) -> None:
        """Called on every rank when some rank's flag was set (``grads``: the local gradient, or with
        ``simulated`` every simulated worker's; each flat, or one tensor per parameter)."""

    def _sync_bucket(self, b: Bucket, worker_grads: Sequence | None = None,
                     grad: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
                     finite: torch.Tensor | None = None) -> None:
        """The compressed synchronisation of ``b``: this rank's gradient (``b.grad``, or ``grad``: one
        tensor per parameter), or every simulated worker's (``worker_grads``, flat or per parameter).
        ``finite``: this rank's other gradients are finite, checked in the call's agreement round."""
        if worker_grads is None:
            self._sync_together([(b, grad, finite)])
            return
        comm = self._comm_for(b)
        target = self._sync_target(b)
        payloads = []
        for g, out in zip(worker_grads, b.worker_buffers("payload", len(worker_grads)), strict=True):
            src = self._payload(b, g, out)
            payloads.append(out if src is None else src)
        flags = [self._flag(b, g) for g in worker_grads]
        try:
            comm.allreduce_into(payloads, target, flags=None if flags[0] is None else flags, **self._defer_kw(b))
        except ValueError as exc:
            raise NonFiniteGradientError(str(exc)) from exc
        self._sync_done(b, worker_grads, simulated=True)

    def _sync_together(self, calls: Sequence[tuple[Bucket, Sequence | None, torch.Tensor | None]]) -> None:
        """:meth:`_sync_bucket` of several buckets on this rank's gradients, ``(bucket, grad, finite)`` each,
        their calls' phases interleaved (:meth:`CompressedAllreduce.begin
        <lightning_onebit.comm.CompressedAllreduce.begin>`): every call's agreement goes on the wire, then
        each call is encoded and sent, relayed by its server, and completed. On a link of 50 ms round trips
        three buckets one after another wait 9 of them; interleaved, about 3. The two-level collective has
        no phases: its calls run one after another. A failure raises after every call in flight was
        given up, on every rank alike."""
        begun: list[tuple[Bucket, Sequence]] = []
        # until the first call's agreement is past, a NaN it found (with ``finite``: on any rank, in any
        # gradient) has changed no state: the step is skipped everywhere
        agreed = not calls or calls[0][2] is None
        try:
            for b, grad, finite in calls:
                begun.append((b, self._sync_begin(b, grad, finite)))
                if not isinstance(b.comm, CompressedAllreduce):
                    self._sync_done(b, begun.pop()[1])  # ran whole in _sync_begin
                    agreed = True
            for phase in ("send", "relay"):
                for b, _ in begun:
                    with self._nonfinite_is_gradient_error(), self._collective(self._call_name(b), b):
                        getattr(b.comm, phase)()
                    agreed = True
            for b, grads in begun:
                with self._collective(self._call_name(b), b):
                    b.comm.complete(out=self._sync_target(b), **self._defer_kw(b))
                self._sync_done(b, grads)
        except BaseException as exc:
            for b, _ in begun:
                b.comm.abandon()
            if not agreed and isinstance(exc, NonFiniteGradientError) and isinstance(exc.__cause__,
                                                                                     NonFiniteInputError):
                raise SkippedEverywhere() from exc
            raise

    def _call_name(self, b: Bucket) -> str:
        return f"compressed allreduce ({type(b.comm).__name__})"

    def _sync_begin(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None] | None,
                    finite: torch.Tensor | None) -> torch.Tensor | Sequence[torch.Tensor | None]:
        """The payload and flag of ``b`` from this rank's gradient, and its call begun (the two-level
        collective's run whole); returns the gradient the flag and ``_on_flag`` read."""
        comm = self._comm_for(b)
        grads = b.grad if grad is None else grad
        if b.payload is None:
            b.payload = flat_buffer(b.numel, device=b.device, zero=False)
        src = self._payload(b, grads, b.payload)
        x, flag = b.payload if src is None else src, self._flag(b, grads)
        extra = {} if finite is None else {"finite": finite}
        with self._nonfinite_is_gradient_error(), self._collective(self._call_name(b), b):
            if isinstance(comm, CompressedAllreduce):
                comm.begin(x, flag=flag, **extra)
            else:
                comm(x, out=self._sync_target(b), flag=flag, **self._defer_kw(b), **extra)
        return grads

    def _sync_done(self, b: Bucket, grads: Sequence, simulated: bool = False) -> None:
        """After ``b``'s call: its result folded into the state (unless the update decodes it), and the
        masked coordinates a gradient reached, if some rank flagged any."""
        comm = b.comm
        if not getattr(comm, "pending", False):  # a deferred result is absorbed by the update
            self._absorb(b, self._sync_target(b))
        if comm.any_flag:
            self._on_flag(b, grads, simulated=simulated)
        b.done = True

    #: the update decodes the synchronised result itself (``_update_compressed`` calls the collective's
    #: ``decode_pending``), so that the decode and the parameter update are one pass over the bucket
    decodes_in_update: ClassVar[bool] = False

    def _defer_kw(self, b: Bucket) -> dict:
        """Ask the collective to leave its decode to the update, where the subclass does that and the
        collective can (not the two-level one, whose result is an fp32 sum)."""
        if self.decodes_in_update and hasattr(b.comm, "decode_pending") and self._sink_targets(b) is not None:
            return {"defer": True}
        return {}

    @staticmethod
    def _sink_targets(b: Bucket) -> list[torch.Tensor] | None:
        """The bucket's parameters as a decode sink updates them (contiguous fp32), else None."""
        ps = [p.detach() for p in b.params]
        return ps if all(p.dtype == torch.float32 and p.is_contiguous() for p in ps) else None

    def _flush_pending(self) -> None:
        """Decode every result a bucket left for its update (before anything reads the state)."""
        for b in self._buckets:
            if b.comm is not None and getattr(b.comm, "pending", False):
                b.comm.decode_pending()
                self._absorb(b, self._sync_target(b))

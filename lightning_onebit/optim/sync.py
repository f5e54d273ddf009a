"""The synchronisation of a bucket: its state (:class:`BucketSync`) and a step's calls (:func:`sync_together`).

The shape is PyTorch's ``PowerSGDState`` and its hook: a state object per bucket holds the bucket's
collectives (made at first use by :class:`SyncContext`, through :func:`~lightning_onebit.comm.make_mean`:
flat, two-level or simulated) and this step's progress; the functions here run a call on it. Everything
they need comes in explicitly: the context every bucket of one optimizer shares (its group, topology, byte
counters, name and step for errors) and the algorithm, which says what the payload is and what the result
does (the :class:`Algorithm` protocol the optimizers implement). A sync forms the payload (a
:class:`~lightning_onebit.compress.Source` the codec evaluates where it reads it), runs the collective, and
folds the result into the state, or leaves its decode to the update (``decodes_in_update``: one pass decodes
and updates the parameters). The optimizer never calls torch.distributed; the comm layer does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..comm import (
    ByteCounter,
    CollectiveError,
    CompressedAllreduce,
    NonFiniteInputError,
    Topology,
    Verdict,
    Wire,
    check_together,
    group_size,
    make_mean,
)
from ..compress import Source, flat_buffer
from .buckets import Bucket
from .nonfinite import NonFiniteGradientError, SkippedEverywhere

__all__ = ["Algorithm", "BucketSync", "CollectiveError", "SyncContext", "nonfinite_is_gradient_error",
           "sync_together"]


@dataclass
class SyncContext:
    """What every bucket's synchronisation of one optimizer shares. ``group`` is DDP's once the optimizer is
    attached; ``step`` says which optimizer step is running (for errors); ``simulate_workers``: a simulated
    cluster of that many workers instead of ``group``."""

    owner: str
    group: object = None
    simulate_workers: int | None = None
    topology: Topology = field(default_factory=Topology)
    counter: ByteCounter = field(default_factory=ByteCounter)
    intra_counter: ByteCounter = field(default_factory=ByteCounter)  #: the two-level mean's fp32 bytes in a node
    step: Callable[[], int] = lambda: 0

    @property
    def world_size(self) -> int:
        return self.simulate_workers if self.simulate_workers is not None else group_size(self.group)

    def make(self, b: Bucket, wire: Wire, mode: str, block_size: int | None):
        """A mean of ``b``'s size (bound: its state exists before the first sync), every tensor of the
        bucket with scales of its own. ``verify="always"``: the per-call agreement is also how every rank
        learns that some rank's gradient was not finite, so they all skip the step together."""
        return make_mean(wire, mode=mode, group=self.group, topology=self.topology, counter=self.counter,
                         intra_counter=self.intra_counter, groups=b.offsets, block_size=block_size,
                         simulate=self.simulate_workers, numel=b.numel, device=b.device)

    def failure(self, what: str | Callable[[], str], b: Bucket | None = None) -> _Failure:
        """Name the collective (``what``, or a function that names it), bucket and step in a failure of the
        process group (a rank that died fails its peers' next collective at once, one that stalls after the
        group's timeout)."""
        return _Failure(self, what, b)


class _Failure:
    """:meth:`SyncContext.failure`'s context: a class, not a generator, as a step enters several a bucket
    (the name is made only when something failed)."""

    __slots__ = ("context", "what", "bucket")

    def __init__(self, context: SyncContext, what: str | Callable[[], str], bucket: Bucket | None) -> None:
        self.context, self.what, self.bucket = context, what, bucket

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        # agreement mismatches and non-finite inputs (ValueError) and CollectiveErrors say it already
        if typ is None or not issubclass(typ, RuntimeError) or issubclass(typ, (ValueError, CollectiveError)):
            return False
        b, what = self.bucket, self.what if isinstance(self.what, str) else self.what()
        where = "" if b is None else f" of bucket {b.index} ({b.numel} elements)"
        c = self.context
        raise CollectiveError.lost(f"{c.owner}: the {what}{where} failed at optimizer step {c.step()}", exc) from exc


class nonfinite_is_gradient_error:  # lower case: used as a function, ``with nonfinite_is_gradient_error(owner):``
    """A collective that found a non-finite input on some rank raises :class:`NonFiniteGradientError`."""

    __slots__ = ("owner",)

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if typ is not None and issubclass(typ, ValueError) and "not finite" in str(exc):
            raise NonFiniteGradientError(f"{self.owner}: {exc}. Lower the learning rate or clip gradients.") from exc
        return False


class Algorithm(Protocol):
    """What a bucket's compressed sync asks of the optimizer (see :class:`~.base.CompressedOptimizer`)."""

    def _payload(self, b: Bucket, grad, out: torch.Tensor) -> Source | None: ...
    def _flag(self, b: Bucket, grad) -> int | None: ...
    def _on_flag(self, b: Bucket, grads: Sequence, simulated: bool) -> None: ...
    def _sync_target(self, b: Bucket) -> torch.Tensor: ...
    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None: ...
    def _defers(self, b: Bucket) -> bool: ...

    #: its update of a deferred result writes only where the call's flag holds (the collective's sink, or
    #: kernels predicated on it), so a step may be decided on the device (the cuda backend): every write
    #: predicated on one flag, the host told a step later
    skips_on_device: bool


class BucketSync:
    """The synchronisation state of one bucket: its collectives and this step's progress.

    Args:
        bucket: the bucket (its size, device and tensor offsets).
        context: what the optimizer's buckets share (:class:`SyncContext`).
        wire, mode, block_size: the compressed mean's wire, its state (``"plain"``, ``"error_feedback"`` or
            ``"markov"``) and scale blocks.
        warmup_wire: the warm-up's mean: dense (DDP's all-reduce, or ``step()``'s) or 8-bit codes through
            this bucket's own collective (:mod:`.warmup_mean`).
    """

    #: ``warmup_comm_dtype="uint8"``: one (min, max) per this many elements of a tensor, so that an embedding
    #: row whose width is a multiple of it and that got no gradient on any rank stays exactly zero (a constant
    #: block decodes exactly), as it does in fp32; 8 B of scales per 128 B of codes
    WARMUP_CODE_BLOCK = 128

    def __init__(self, bucket: Bucket, context: SyncContext, *, wire: Wire, mode: str, block_size: int | None,
                 warmup_wire: Wire) -> None:
        self.bucket, self.context = bucket, context
        self.wire, self.mode, self.block_size, self.warmup_wire = wire, mode, block_size, warmup_wire
        self.comm = None  #: the compressed collective, made at the first compressed sync
        self.warmup_comm = None  #: the 8-bit warm-up's collective, made when codes first go
        self.warmup_sparse: bool | None = None  #: its 8-bit warm-up mean may go sparse (None: not tried yet)
        self.warmup_mean_ready = False  #: this step's warm-up mean went sparse and is in its buffer
        self.payload: torch.Tensor | None = None  # reused every step: fresh buffers cost page faults
        # this step's progress on the DDP hook path
        self.ready = 0  #: parameters whose local gradient is in the bucket's ``grad``
        self.done = False  #: the compressed sync of this step finished
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  #: state of locally unused parameters
        self.verdict: Verdict | None = None  #: this step's sync in DDP's hook, if the device decided it
        self.refused = False  #: a state read decoded this step's result and found the device skipped it

    def reset_step(self, discard: bool = False) -> None:
        """Forget this step's progress; ``discard``: also a result left for the update (a failed step)."""
        self.done, self.ready, self.pending, self.verdict, self.refused = False, 0, [], None, False
        if discard and self.deferred:
            self.comm.discard_pending()

    def collective(self):
        """The compressed collective of this bucket (made, and its state allocated, on first use)."""
        if self.comm is None:
            self.comm = self.context.make(self.bucket, self.wire, self.mode, self.block_size)
        return self.comm

    def warmup_collective(self):
        """The 8-bit warm-up mean's collective: plain codes, nothing to carry across steps or into a checkpoint."""
        if self.warmup_comm is None:
            self.warmup_comm = self.context.make(self.bucket, self.warmup_wire, "plain", self.WARMUP_CODE_BLOCK)
        return self.warmup_comm

    def end_warmup(self) -> None:
        """The warm-up's codes are done: free their collective (and its buffers)."""
        self.warmup_comm = None

    @property
    def deferred(self) -> bool:
        """A synchronised result waits for the update to decode it."""
        return self.comm is not None and getattr(self.comm, "pending", False)

    @property
    def phased(self) -> bool:
        """The collective runs in phases (``begin``, ``send``, ``relay``, ``complete``); else whole."""
        return isinstance(self.comm, CompressedAllreduce)

    def failure(self, what: str | None = None) -> _Failure:
        return self.context.failure(what or self._name, self.bucket)

    def _name(self) -> str:
        return f"compressed allreduce ({type(self.comm).__name__})"

    def defer_kw(self, algorithm: Algorithm) -> dict:
        """Ask the collective to leave its decode to the update, where the algorithm does that and the
        collective can (not the two-level one, whose result is an fp32 sum)."""
        return {"defer": True} if algorithm._defers(self.bucket) and hasattr(self.comm, "decode_pending") else {}

    # -- a compressed sync ------------------------------------------------------------------------
    def begin(self, algorithm: Algorithm, grad, finite: torch.Tensor | None):
        """The payload and flag of this bucket from this rank's gradient (``grad``: one tensor per parameter,
        or ``None``: the bucket's own ``grad``), and its call begun (the two-level collective's run whole);
        returns the gradient the flag and ``_on_flag`` read."""
        b, comm = self.bucket, self.collective()
        grads = b.grad if grad is None else grad
        if hasattr(comm, "skip_on_device"):  # its update must then be the deferred decode's sink alone
            comm.skip_on_device = getattr(algorithm, "skips_on_device", False) and algorithm._defers(b)
        if self.payload is None:
            self.payload = flat_buffer(b.numel, device=b.device, zero=False)
        src = algorithm._payload(b, grads, self.payload)
        x, flag = self.payload if src is None else src, algorithm._flag(b, grads)
        extra = {} if finite is None else {"finite": finite}
        with nonfinite_is_gradient_error(self.context.owner), self.failure():
            if self.phased:
                comm.begin(x, flag=flag, **extra)
            else:
                comm(x, out=algorithm._sync_target(b), flag=flag, **self.defer_kw(algorithm), **extra)
        return grads

    def finish(self, algorithm: Algorithm, grads, simulated: bool = False) -> None:
        """After this bucket's call: its result folded into the state (unless the update decodes it), and the
        masked coordinates a gradient reached, if some rank flagged any."""
        b = self.bucket
        if not self.deferred:
            algorithm._absorb(b, algorithm._sync_target(b))
        if self.comm.any_flag:
            algorithm._on_flag(b, grads, simulated=simulated)
        self.done = True

    def run_simulated(self, algorithm: Algorithm, worker_grads: Sequence) -> None:
        """The compressed sync of every simulated worker's gradient (flat, or one tensor per parameter)."""
        b, comm = self.bucket, self.collective()
        payloads = []
        for g, out in zip(worker_grads, b.worker_buffers("payload", len(worker_grads)), strict=True):
            src = algorithm._payload(b, g, out)
            payloads.append(out if src is None else src)
        flags = [algorithm._flag(b, g) for g in worker_grads]
        try:
            comm.allreduce_into(payloads, algorithm._sync_target(b), flags=None if flags[0] is None else flags,
                                **self.defer_kw(algorithm))
        except ValueError as exc:
            raise NonFiniteGradientError(str(exc)) from exc
        self.finish(algorithm, worker_grads, simulated=True)

    def decode(self, algorithm: Algorithm) -> None:
        """Decode a result left for the update now (before anything reads the state). A call the device decided
        is folded in only if it went through: the host reads that here, off the step's path, and a call that did
        not is ``refused``, so that the update the predicate would have stopped does not run in ``step()``."""
        if self.deferred:
            predicate = self.comm.pending_predicate
            self.comm.decode_pending()
            if predicate is None or bool(predicate.took[0]):
                algorithm._absorb(self.bucket, algorithm._sync_target(self.bucket))
            else:
                self.refused = True


def sync_together(algorithm: Algorithm, calls: Sequence[tuple[BucketSync, Sequence | None, torch.Tensor | None]],
                  *, carry_finite: bool = False, send_verdict: bool = True) -> Verdict | None:
    """The compressed syncs of several buckets on this rank's gradients, ``(sync, grad, finite)`` each, their
    calls' phases interleaved (:meth:`CompressedAllreduce.begin <lightning_onebit.comm.CompressedAllreduce.begin>`):
    every call's agreement goes on the wire, then each call is encoded and sent, relayed by its server, and
    completed. On a link of long round trips k buckets one after another wait 3k of them; interleaved,
    about 3. The two-level collective has no phases: its calls run one after another. ``finite`` (the first
    call's): this rank's other gradients are finite, checked in that call's agreement round.

    ``carry_finite`` (every call phased, and a NaN/inf gradient makes its payload non-finite): the calls'
    own scale reductions are the finiteness check. They begin last to first, each vouching for the calls
    after it (``finite=`` the later call's :attr:`~lightning_onebit.comm.CompressedAllreduce.input_finite`),
    so the first call's agreement, the first thing waited for, covers every gradient, with no pass over
    them of its own. A failure raises after every call in flight was given up, on every rank alike.

    Returns the :class:`~lightning_onebit.comm.Verdict` of calls decided on the device (``skips_on_device``,
    the cuda backend, with several ranks once each collective was verified: nothing was read, every write
    predicated on their flags), else None; the caller keeps it for ``settle_device_skips``, which reads it a
    step later. ``send_verdict=False``: its flags are not sent to the host yet (DDP's hook: ``step()`` sends its
    buckets' in one copy, :meth:`Verdict.send_together <lightning_onebit.comm.Verdict.send_together>`)."""
    begun: list[tuple[BucketSync, Sequence]] = []
    # until the first call's agreement is past, a NaN it found (with ``finite`` or ``carry_finite``: on any
    # rank, in any gradient) has changed no state: the step is skipped everywhere
    agreed = not calls or (calls[0][2] is None and not carry_finite)
    owner = calls[0][0].context.owner if calls else ""
    verdict = None
    try:
        if carry_finite:
            if any(finite is not None or not isinstance(s.collective(), CompressedAllreduce)
                   for s, _, finite in calls):
                raise ValueError("sync_together: carry_finite needs phased calls and no finite= of their own")
            later = None
            for s, grad, _ in reversed(calls):
                begun.append((s, s.begin(algorithm, grad, later)))
                later = s.comm.input_finite
            begun.reverse()
        for s, grad, finite in () if carry_finite else calls:
            begun.append((s, s.begin(algorithm, grad, finite)))
            if not s.phased:
                s.finish(algorithm, begun.pop()[1])  # ran whole in begin
                agreed = True
        if begun:  # the calls' agreements read from the device once, not once (twice at world size 1) a call
            with begun[0][0].failure():
                verdict = check_together([s.comm for s, _ in begun], send=send_verdict)
        for phase in ("send", "relay"):
            for s, _ in begun:
                with nonfinite_is_gradient_error(owner), s.failure():
                    getattr(s.comm, phase)()
                agreed = True
        for s, grads in begun:
            with s.failure():
                s.comm.complete(out=algorithm._sync_target(s.bucket), **s.defer_kw(algorithm))
            s.finish(algorithm, grads)
    except BaseException as exc:
        for s, _ in begun:
            s.comm.abandon()
        if not agreed and isinstance(exc, NonFiniteGradientError) and isinstance(exc.__cause__, NonFiniteInputError):
            raise SkippedEverywhere() from exc
        raise
    return verdict

"""The 8-bit warm-up mean (``warmup_comm_dtype="uint8"``) sent while backward runs, from DDP's comm hook.

DDP hands each gradient bucket to the hook. :class:`CodedWarmupSender` copies its local gradients into
the optimizer's buckets (whose tensors carry their own scales, the layout the simulation uses too) and
gives every optimizer bucket whose gradients are all in to one sender thread. The thread runs the
bucket's coded mean (:func:`~lightning_onebit.optim.warmup_mean.coded_start` and ``coded_complete``:
it starts the next bucket's call before it completes this one's) and writes it into DDP's
buckets. A DDP bucket's future completes when all its parameters have their mean, so after
``backward()`` ``p.grad`` holds the mean, as after DDP's own all-reduce: gradient clipping acts on it,
and ``step()`` updates from it directly.

Trade-offs:

* Why a thread: the coded mean waits on the link most of its time; run inside the hook it would hold
  backward back. One thread keeps the calls in the order the hooks fire, the same on every rank. Nothing
  else uses the process group during backward, and DDP waits for every future before ``backward()``
  returns, so the thread's collectives never interleave with the caller's.
* The thread and backward share the rank's cores: the codec's passes overlap with backward only where
  cores are free; the waits on the link overlap in any case.
* A non-finite gradient on any rank (the collective's agreement sees it on every rank) makes that
  bucket's mean NaN on every rank, as DDP's all-reduce would spread it, so ``step()`` skips the step
  everywhere or raises. Any other failure (a rank died) fails every future still open: ``backward()``
  raises on every rank instead of waiting.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Sender
from .buckets import Bucket
from .nonfinite import NonFiniteGradientError
from .warmup_mean import coded_complete, coded_relay, coded_start

if TYPE_CHECKING:
    from torch.distributed import GradBucket

__all__ = ["CodedWarmupSender"]


class CodedWarmupSender:
    """State of the hook path of the 8-bit warm-up mean of one optimizer (see the module docstring)."""

    def __init__(self, optimizer: Any) -> None:  # a CompressedOptimizer attached to DDP (its module imports this one)
        self.optimizer = optimizer
        self._sender: Sender | None = None  # the thread, started at the first bucket
        self._started: Bucket | None = None  # a bucket whose call the thread started and has not completed
        self._lock = threading.Lock()
        self._open: dict[int, list] = {}  # DDP bucket index -> [future, buffer, parameters still without a mean]
        self._into: dict[int, tuple[int, torch.Tensor]] = {}  # id(param) -> (DDP bucket index, its view of the buffer)
        self._failed: BaseException | None = None  # a collective failed: the group is unusable
        self._left = 0  # optimizer buckets of this backward the sender has not taken yet

    def bucket_ready(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Take a DDP bucket's local gradients; the future completes with their mean."""
        opt, buf, k = self.optimizer, bucket.buffer(), bucket.index()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        params = bucket.parameters()
        with self._lock:
            failed = self._failed
            if failed is None:
                self._open[k] = [fut, buf, len(params)]
        if failed is not None:  # the group broke earlier: fail at once, never wait
            fut.set_exception(failed)
            return fut
        if k == 0:  # DDP hands its buckets over in index order: a new backward starts (one given up counts none)
            for b in opt._buckets:
                b.sync.ready = 0
            self._left = sum(b.via_ddp for b in opt._buckets)  # the sender is idle: DDP waited for the last
        at, full = 0, []
        with torch.no_grad():
            for p in params:
                view = buf[at : at + p.numel()].view_as(p)  # the buffer's own view: DDP copies the buffer to p.grad
                at += p.numel()
                ob, i = opt._param_bucket[id(p)]
                self._into[id(p)] = (k, view)
                ob.view(ob.grad, i).copy_(view)
                ob.sync.ready += 1
                if ob.sync.ready == len(ob.params):
                    ob.sync.ready = 0
                    full.append(ob)
        for ob in full:
            self._submit(ob)
        return fut

    def _submit(self, b: Bucket) -> None:
        if self._sender is None:
            self._sender = Sender("lightning_onebit warm-up sender")
        self._sender.submit(lambda: self._next(b))

    def _next(self, b: Bucket) -> None:
        """On the thread, bucket by bucket: start each bucket's call, then complete the one before it: the
        next bucket's stage 1 goes on the wire while this one's server decodes and re-encodes (the link
        idles less). Before a bucket that may go as a sparse mean, whose rounds block the thread, the started
        call's server rows go on the wire, so that they travel meanwhile. Every rank issues its collectives in
        this one order, decided by the bucket count and the agreed ``warmup_sparse`` flags, never by timing
        (gloo pairs calls by their order). Waiting for a next bucket cannot hang: DDP waits for the futures
        only once every bucket has come through the hook."""
        self._left -= 1
        if self._failed is not None:
            return  # the futures it would complete hold the error already
        started = self._started
        if started is not None and b.sync.warmup_sparse is not False:
            # b may go as a sparse mean, whose rounds block this thread: started's server rows go on the
            # wire first and travel meanwhile (the same choice on every rank: warmup_sparse is agreed)
            self._relay(started)
            if self._failed is not None:
                return
        b_started = self._start(b)
        if started is not None:
            self._complete(started)
        self._started = b if b_started else None
        if self._left <= 0 and self._started is not None:  # the last bucket of this backward
            self._complete(self._started)
            self._started = None

    def _relay(self, b: Bucket) -> None:
        """Put ``b``'s server rows on the wire now; a failure fails every open future."""
        try:
            coded_relay(b.sync)
        except BaseException as exc:  # noqa: BLE001 - as in _complete
            self._fail(exc)

    def _complete(self, b: Bucket) -> None:
        """Complete ``b``'s call and deliver its mean; a failure fails every open future."""
        if self._failed is not None:
            return  # the group broke while ``b`` was on the wire: its futures hold the error already
        try:
            self._deliver(b, coded_complete(b.sync))
        except BaseException as exc:  # noqa: BLE001 - every open future must hear of it, or DDP waits forever
            self._fail(exc)

    def _start(self, b: Bucket) -> bool:
        """Start ``b``'s coded mean; False if it is delivered already (some rank's gradient was not
        finite: NaN) or failed (every open future holds the error)."""
        try:
            with torch.no_grad():
                coded_start(b.sync)
        except NonFiniteGradientError:  # on every rank: the agreement saw it
            self._deliver(b, None)
            return False
        except BaseException as exc:  # noqa: BLE001 - as in _complete
            self._fail(exc)
            return False
        return True

    def _deliver(self, b: Bucket, mean: torch.Tensor | None) -> None:
        """Write ``b``'s mean (``None``: NaN) into DDP's buckets; complete those that are whole."""
        done = []
        with torch.no_grad():
            means = b.views(mean) if mean is not None else [None] * len(b.params)
            for p, m in zip(b.params, means, strict=True):
                k, view = self._into.pop(id(p))
                if m is None:
                    view.fill_(float("nan"))
                else:
                    view.copy_(m)
                with self._lock:
                    entry = self._open[k]
                    entry[2] -= 1
                    if entry[2] == 0:
                        done.append(self._open.pop(k))
        for fut, buf, _ in done:
            fut.set_result(buf)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._failed = exc
            open_, self._open = list(self._open.values()), {}
            self._into.clear()
        for fut, _, _ in open_:
            fut.set_exception(exc)

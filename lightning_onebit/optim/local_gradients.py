"""A local step's gradients on a device where reading a flag would wait for it (0/1 Adam's phase B on a GPU).

Each worker's gradients are copied into its buckets' fp32 buffers, a NaN/inf anywhere in a worker's gradients
flags that worker, and a flagged worker's buffers are zeroed by the flag on the device: its step takes zero
gradients, with no host read. The buckets' own gradients are slices of one buffer
(:func:`~lightning_onebit.optim.buckets.spans`), so the zeroing is one op for a run of them, not one a bucket.
"""

from __future__ import annotations

import torch

from ..comm import nonfinite_flags_
from .buckets import Bucket, copy_or_zero_, spans

__all__ = ["LocalGradients"]


class LocalGradients:
    """The flags' buffers and the zeroing's views a local step reuses: made once, and again only when the
    buckets, the number of workers or the flags' device change."""

    def __init__(self) -> None:
        self._flags: tuple | None = None  # flags, the check's scratch and its views
        self._buckets: list[Bucket] = []  # the buckets the zeroing's views below were made for
        self._fill: tuple[tuple[torch.Tensor, ...], list[list[torch.Tensor]]] | None = None  # per worker: flag, spans

    def gather(self, buckets: list[Bucket], grads) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """``grads[bucket][worker]`` (a tensor or None each of the bucket's parameters) copied into each bucket's
        buffer of each worker (zeros for a missing gradient; one foreach copy for all buckets), with a flagged
        worker's buffers zeroed. Returns the buffers (``[bucket][worker]``) and the flags (bool, one a worker)."""
        flats, views, sources = [], [], []
        for b, ws in zip(buckets, grads, strict=True):
            bufs = [b.grad] if len(ws) == 1 else b.worker_buffers("local gradient", len(ws))
            for w, (flat, gs) in enumerate(zip(bufs, ws, strict=True)):
                views += b.kept_views("grad" if flat is b.grad else f"local gradient {w}", flat)
                sources += gs
            flats.append(bufs)
        copy_or_zero_(views, sources)
        n, dev = len(grads[0]), flats[0][0].device
        fb = self._flags
        if fb is None or fb[0].device != dev or fb[0].numel() != n:  # made once: no allocation a local step
            found = torch.empty(n, dtype=torch.float32, device=dev)
            fb = self._flags = (torch.empty(n, dtype=torch.bool, device=dev), found,
                                torch.ones((), dtype=torch.float32, device=dev), found.unbind())
            self._fill = None
        per_worker = [[f[w] for f in flats] for w in range(n)]
        bad = nonfinite_flags_(fb[0], per_worker, fb[1], fb[2], fb[3])
        # a bucket's buffers change only with the bucket and the number of workers (checked above)
        if (self._fill is None or len(self._buckets) != len(buckets)
                or any(a is not b for a, b in zip(self._buckets, buckets, strict=True))):
            self._buckets = list(buckets)
            self._fill = (bad.unbind(), [spans(bufs) for bufs in per_worker])
        for flag, views in zip(*self._fill, strict=True):
            for view in views:
                view.masked_fill_(flag, 0.0)  # NaN * 0 is NaN: a product by the flag would keep them
        return flats, bad

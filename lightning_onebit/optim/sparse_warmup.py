"""The 8-bit warm-up's mean of a bucket of mostly exact zeros (an embedding's rows no token of the batch reached).

A mixin of :class:`~lightning_onebit.optim.sync.BucketSync`. The codes cost a byte per element, zero or
not; the nonzero values in fp32 with their positions (:func:`~lightning_onebit.comm.sparse_mean`: runs of
indices, an embedding row is one) cost 4 bytes per nonzero. Every rank announces its row's length in one
small gather, and all take the cheaper way alike. The fp32 mean is exact (DDP's divide-then-sum, in rank
order), so it equals the simulation's to the bit. A bucket whose first warm-up mean went dense is never
looked at again (no counting pass, no gather); the others are, every warm-up step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import NonFiniteInputError, gather_sizes, sparse_mean, sparse_mean_bytes, sparse_row
from .buckets import Bucket, _simulated_mean

__all__ = ["SparseWarmupMean"]


class SparseWarmupMean:
    """Mixin: the sparse way of the uint8 warm-up's mean (see the module docstring)."""

    def _sparse_row(self, g: torch.Tensor, n: int) -> torch.Tensor | None:
        """This rank's :func:`~..comm.sparse_row` of flat ``g``, or None where it could not pay
        (4 bytes a nonzero against 2 (n - 1) / n bytes an element for the codes); NaN counts as nonzero."""
        if 4 * n * int(torch.count_nonzero(g)) >= 2 * g.numel():
            return None
        hit = g.nonzero().view(-1)
        return sparse_row(hit, g.index_select(0, hit), g.numel())

    def _goes_sparse(self, b: Bucket, sizes: Sequence[int], n: int) -> bool:
        """The ranks' row sizes (-1: would not pay) say the sparse mean sends fewer bytes than the codes."""
        ok = min(sizes) >= 0 and n * sparse_mean_bytes(sizes, n) < 2 * (n - 1) * b.numel
        if b.warmup_sparse is None:
            b.warmup_sparse = ok
        return ok

    def _sparse_warmup(self, b: Bucket) -> bool:
        """The warm-up mean of this rank's ``b.grad`` into the bucket's warm-up buffer as a sparse mean,
        if the ranks agree it pays (see above); False: nothing was written, take the codes."""
        if b.warmup_sparse is False:
            return False
        n, g = self.world_size, b.grad
        row = self._sparse_row(g, n)
        sizes = gather_sizes(-1 if row is None else row.numel(), self.process_group, g.device)
        if not self._goes_sparse(b, sizes, n):
            return False
        out = b.worker_buffers("warm-up mean", 1)[0]
        out.zero_()
        if max(sizes) > 0:  # else no rank has a nonzero: nothing to send
            idx, mean = sparse_mean(row, sizes, b.numel, self.process_group)
            if not bool(torch.isfinite(mean).all()):  # the same values on every rank: all raise
                raise NonFiniteInputError("the warm-up mean: some rank's gradient is not finite")
            out.index_copy_(0, idx, mean)
        self.comm_counter.add(sparse_mean_bytes(sizes, n), b.numel, n)
        return True

    def _simulated_sparse_warmup(self, b: Bucket, worker_grads: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
        """:meth:`_sparse_warmup` of the simulated workers' flat gradients: the same choice, bits and bytes."""
        if b.warmup_sparse is False:
            return False
        n = len(worker_grads)
        rows = [self._sparse_row(w, n) for w in worker_grads]
        sizes = [-1 if r is None else r.numel() for r in rows]
        if not self._goes_sparse(b, sizes, n):
            return False
        _simulated_mean(worker_grads, out=out, scratch=b.worker_buffers("quotient", 1)[0])
        if not bool(torch.isfinite(out).all()):
            raise NonFiniteInputError("the warm-up mean: some worker's gradient is not finite")
        self.comm_counter.add(sparse_mean_bytes(sizes, n), b.numel, n)
        return True

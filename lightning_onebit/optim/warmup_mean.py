"""The warm-up's mean of a bucket: dense, as DDP computes it, or as 8-bit codes, or as a sparse mean.

Each function takes the bucket's :class:`~.sync.BucketSync` (its wire, collectives and context) and
nothing else of the optimizer.

* **Dense** (``warmup_comm_dtype`` fp32, bf16, fp16): the mean exactly as DDP computes it (divide by n,
  then the sum), sent in that dtype as PyTorch's ``bf16_compress_hook`` sends it.
* **8-bit codes** (``"uint8"``): the two-stage collective with QAdam's min-max codes and no error feedback
  (nothing to carry across steps or into a checkpoint): each rank's gradient quantised, the server's mean
  quantised again, every tensor its own (min, max) per ``WARMUP_CODE_BLOCK`` elements.
* **Sparse**, a bucket of mostly exact zeros (an embedding's rows no token of the batch reached) under the
  8-bit wire: the codes cost a byte per element, zero or not; the nonzero values in fp32 with their positions
  (:func:`~lightning_onebit.comm.sparse_mean`: runs of indices, an embedding row is one) cost 4 bytes per
  nonzero. Every rank announces its row's length in one small gather, and all take the cheaper way alike.
  The fp32 mean is exact (DDP's divide-then-sum, in rank order), so it equals the simulation's to the bit. A
  bucket whose first warm-up mean went dense is never looked at again (no counting pass, no gather); the
  others are, every warm-up step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import (
    CompressedAllreduce,
    DenseMean,
    NonFiniteInputError,
    SimulatedDenseMean,
    gather_sizes,
    simulated_mean,
    sparse_mean,
    sparse_mean_bytes,
    sparse_row,
)
from ..comm.wire import Wire
from .sync import BucketSync, nonfinite_is_gradient_error

__all__ = ["coded_complete", "coded_relay", "coded_start", "warmup_mean"]

_FP32 = Wire.dense()


def warmup_mean(s: BucketSync, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """The mean gradient of ``s``'s bucket in the warm-up: of this rank's ``b.grad`` over the group, or of the
    simulated workers' flat gradients (``worker_grads``)."""
    b, ctx = s.bucket, s.context
    n = len(worker_grads) if worker_grads is not None else ctx.world_size
    if worker_grads is None and b.via_ddp:
        return b.grad  # gathered from the parameters, where DDP's hook left the mean (dense, or as codes)
    if not s.warmup_wire.is_dense and n > 1:
        return _coded_mean(s, worker_grads)
    wire = s.warmup_wire if s.warmup_wire.is_dense else _FP32  # codes on one rank: nothing to quantise for
    if worker_grads is not None:  # simulation: (g_0 / n) + (g_1 / n) + ... in worker order
        SimulatedDenseMean(wire, n, ctx.counter).allreduce_into(worker_grads, b.grad,
                                                                 scratch=b.worker_buffers("quotient", 1)[0])
    else:
        with ctx.failure(f"{s.warmup_wire.torch_dtype} allreduce (warm-up)", b):
            DenseMean(wire, ctx.group, ctx.counter)(b.grad)
    return b.grad


def _coded_mean(s: BucketSync, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
    if worker_grads is not None:
        out = s.bucket.worker_buffers("warm-up mean", 1)[0]
        with nonfinite_is_gradient_error(s.context.owner):
            if not _simulated_sparse(s, worker_grads, out):
                s.warmup_collective().allreduce_into(worker_grads, out)
        return out
    coded_start(s)
    return coded_complete(s)


def _name(comm) -> str:
    """The collective's name in errors, the same in every phase of a call."""
    return f"uint8 allreduce (warm-up, {type(comm).__name__})"


def coded_start(s: BucketSync) -> None:
    """The coded mean of this rank's ``b.grad`` up to its stage 1 on the wire (the flat collective; the
    two-level one runs whole here); a non-finite input raises on every rank."""
    b, ctx = s.bucket, s.context
    with nonfinite_is_gradient_error(ctx.owner), ctx.failure("sparse mean (warm-up)", b):
        s.warmup_mean_ready = _sparse(s)
    if s.warmup_mean_ready:
        return
    comm = s.warmup_collective()  # made only when codes go: a bucket that always goes sparse never pays its buffers
    with nonfinite_is_gradient_error(ctx.owner), ctx.failure(_name(comm), b):
        if isinstance(comm, CompressedAllreduce):
            comm.start(b.grad)
        else:
            comm(b.grad, out=b.worker_buffers("warm-up mean", 1)[0])


def coded_relay(s: BucketSync) -> None:
    """Put the server rows of a call :func:`coded_start` began on the wire (stage 3), which
    :func:`coded_complete` would otherwise do: so that they travel while the caller blocks on something else
    (another bucket's sparse mean). Nothing to do for a mean that is whole already."""
    comm = s.warmup_comm
    if not s.warmup_mean_ready and isinstance(comm, CompressedAllreduce):
        with s.context.failure(_name(comm), s.bucket):
            comm.relay()


def coded_complete(s: BucketSync) -> torch.Tensor:
    """The rest of a call :func:`coded_start` began: the mean, in the bucket's buffer."""
    comm, out = s.warmup_comm, s.bucket.worker_buffers("warm-up mean", 1)[0]
    if s.warmup_mean_ready:  # the sparse mean, whole already
        s.warmup_mean_ready = False
    elif isinstance(comm, CompressedAllreduce):
        with s.context.failure(_name(comm), s.bucket):
            comm.complete(out=out)
    return out


# -- the sparse way ---------------------------------------------------------------------------------
def _sparse_row(g: torch.Tensor, n: int) -> torch.Tensor | None:
    """This rank's :func:`~..comm.sparse_row` of flat ``g``, or None where it could not pay (4 bytes a
    nonzero against 2 (n - 1) / n bytes an element for the codes); NaN counts as nonzero."""
    if 4 * n * int(torch.count_nonzero(g)) >= 2 * g.numel():
        return None
    hit = g.nonzero().view(-1)
    return sparse_row(hit, g.index_select(0, hit), g.numel())


def _goes_sparse(s: BucketSync, sizes: Sequence[int], n: int) -> bool:
    """The ranks' row sizes (-1: would not pay) say the sparse mean sends fewer bytes than the codes."""
    ok = min(sizes) >= 0 and n * sparse_mean_bytes(sizes, n) < 2 * (n - 1) * s.bucket.numel
    if s.warmup_sparse is None:
        s.warmup_sparse = ok
    return ok


def _sparse(s: BucketSync) -> bool:
    """The warm-up mean of this rank's ``b.grad`` into the bucket's warm-up buffer as a sparse mean, if the
    ranks agree it pays; False: nothing was written, take the codes."""
    if s.warmup_sparse is False:
        return False
    b, ctx = s.bucket, s.context
    n, g = ctx.world_size, b.grad
    row = _sparse_row(g, n)
    sizes = gather_sizes(-1 if row is None else row.numel(), ctx.group, g.device)
    if not _goes_sparse(s, sizes, n):
        return False
    out = b.worker_buffers("warm-up mean", 1)[0]
    out.zero_()
    if max(sizes) > 0:  # else no rank has a nonzero: nothing to send
        idx, mean = sparse_mean(row, sizes, b.numel, ctx.group)
        if not bool(torch.isfinite(mean).all()):  # the same values on every rank: all raise
            raise NonFiniteInputError("the warm-up mean: some rank's gradient is not finite")
        out.index_copy_(0, idx, mean)
    ctx.counter.add(sparse_mean_bytes(sizes, n), b.numel, n)
    return True


def _simulated_sparse(s: BucketSync, worker_grads: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
    """:func:`_sparse` of the simulated workers' flat gradients: the same choice, bits and bytes."""
    if s.warmup_sparse is False:
        return False
    n = len(worker_grads)
    rows = [_sparse_row(w, n) for w in worker_grads]
    sizes = [-1 if r is None else r.numel() for r in rows]
    if not _goes_sparse(s, sizes, n):
        return False
    simulated_mean(worker_grads, out=out, scratch=s.bucket.worker_buffers("quotient", 1)[0])
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteInputError("the warm-up mean: some worker's gradient is not finite")
    s.context.counter.add(sparse_mean_bytes(sizes, n), s.bucket.numel, n)
    return True

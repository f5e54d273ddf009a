"""DDP communication-hook adapter: hands each gradient bucket to its owner while backward runs.

The hook is deliberately thin (compare PowerSGD's state + hook): all algorithm state lives in
the object behind :class:`BucketSyncer` (the compressed optimizer), which decides per
bucket whether to run a full-precision averaged allreduce (warm-up) or to take the local
gradients into its own fixed buckets and synchronise them compressed (compression phase).

Trade-offs, documented because they are visible to users:

* In the compression phase the future completes with the bucket's *local* gradients, so
  after ``backward()`` ``p.grad`` holds this rank's un-averaged gradient; the optimizer
  already holds the synchronised momentum/gradient. Gradient clipping therefore acts on the
  averaged gradient during warm-up and has no effect on the update during compression.
* The compressed sync of a bucket runs inside the hook call (gloo has no GPU streams to
  overlap on), so backward waits for it. The 8-bit warm-up mean, which carries no state
  across steps, goes to a sender thread instead and overlaps with backward
  (:mod:`lightning_onebit.optim.coded_warmup`).

:func:`register_local_hook` is the other mode: DDP sends nothing and every optimizer
synchronises its own parameters in ``step()`` (several optimizers on one model, where a
backward's gradients are final only when their optimizer steps). Nothing then overlaps
with backward.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from .dense import ready_future

__all__ = ["BucketSyncer", "CompressionHookState", "compression_hook", "local_gradients_hook",
           "register_compression_hook", "register_local_hook"]


class BucketSyncer(Protocol):
    def ddp_bucket_ready(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]: ...


@dataclass
class CompressionHookState:
    syncer: BucketSyncer


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.syncer.ddp_bucket_ready(bucket)


def register_compression_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, syncer: BucketSyncer) -> None:
    ddp_model.register_comm_hook(CompressionHookState(syncer), compression_hook)


def local_gradients_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Leave the bucket's local gradients in place: the optimizers synchronise them in ``step()``."""
    return ready_future(bucket.buffer())


def register_local_hook(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    ddp_model.register_comm_hook(None, local_gradients_hook)

"""The DDP path of a compressed optimizer: ``attach`` a DDP model, then its comm hook delivers
each gradient bucket while backward runs (see :mod:`lightning_onebit.comm.ddp_hook`).

During warm-up the hook averages in fp32 (one allreduce per DDP bucket, as DDP would; or in
``warmup_comm_dtype``, as PyTorch's ``bf16_compress_hook`` would; its 8-bit codes go through the
optimizer's buckets, whose tensors have scales of their own, on a sender thread while backward
runs: :mod:`.coded_warmup`); in the
compression phase it copies the local gradients into the optimizer's own buckets and
synchronises each one, compressed, as soon as all its gradients have arrived. The future
completes with the local gradients: the optimizer already holds the synchronised result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import DenseMean, enable_duplex, is_default_group, ready_future
from .coded_warmup import CodedWarmupSender
from .sync import sync_together

if TYPE_CHECKING:
    from torch.distributed import GradBucket

__all__ = ["DDPHookPath", "attach_several"]


def attach_several(ddp_model: torch.nn.parallel.DistributedDataParallel, optimizers: list) -> None:
    """Several compressed optimizers on one DDP model (a GAN's generator and discriminator): DDP
    sends nothing, and each optimizer synchronises its own parameters in its ``step()``.

    A backward's gradients are final only when their optimizer steps (a GAN's generator loss
    also reaches the discriminator, whose gradient is then zeroed), and the compressed
    algorithms fold the gradient into their state when they synchronise, so they must not
    synchronise in DDP's hook. The price: no communication overlaps with backward."""
    from ..comm.ddp_hook import register_local_hook

    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        opt._check_attachable()
        for p in opt.params_in_order():
            if id(p) in owner:
                raise ValueError(f"optimizers {owner[id(p)]} and {k} share a parameter; each parameter must belong "
                                 "to one optimizer")
            owner[id(p)] = k
    orphans = _unowned(ddp_model, set(owner))
    if orphans:
        raise ValueError(f"the DDP model has trainable parameters no optimizer owns ({orphans[:3]}...); with "
                         "several optimizers DDP does not average gradients, so every trainable parameter must "
                         "belong to one of them (or set requires_grad=False)")
    for opt in optimizers:
        opt._use_ddp_group(ddp_model)
    register_local_hook(ddp_model)


def _unowned(ddp_model: torch.nn.parallel.DistributedDataParallel, owned: set[int]) -> list[str]:
    """Names of the DDP model's trainable parameters whose ids are not in ``owned``."""
    return [n for n, p in ddp_model.module.named_parameters() if p.requires_grad and id(p) not in owned]


class DDPHookPath:
    """Mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`: the DDP comm-hook path."""

    def _check_attachable(self) -> None:
        if self.simulate_workers is not None:
            raise RuntimeError("a simulated-cluster optimizer cannot be attached to DDP")

    def _use_ddp_group(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """DDP's process group (unless this optimizer was given one), and the node groups of the
        two-level collective, or the default group's duplex twin, made now: their creation is
        collective, and here every rank is at the same point (in the hook it might not be)."""
        if ddp_model.process_group is not None and self.process_group is None:
            self.process_group = ddp_model.process_group
        if (local := self.topology.two_level(self.process_group)) is not None:
            self.topology.node_groups(local)
        elif is_default_group(self.process_group):
            enable_duplex()  # gloo: each direction of the exchanges on its own connection (comm.duplex)

    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Synchronise through ``ddp_model``'s gradient buckets from now on (the one call a
        plain PyTorch DDP user makes). Communication then runs in a DDP comm hook during
        backward, and ``step()`` only applies the update."""
        from ..comm.ddp_hook import register_compression_hook

        self._check_attachable()
        foreign = _unowned(ddp_model, {id(p) for p in self.params_in_order()})
        if foreign:
            raise ValueError(f"{type(self).__name__}.attach: the DDP model has trainable parameters this "
                             f"optimizer does not own ({foreign[:3]}...); one optimizer must own them all")
        self._use_ddp_group(ddp_model)
        # the parameters DDP's reducer syncs (those trainable when DDP was built); others sync in step()
        ignored = set(getattr(ddp_model, "parameters_to_ignore", ()))
        self._ddp_params = {id(p) for n, p in ddp_model.module.named_parameters()
                            if p.requires_grad and n not in ignored}
        self._ddp_find_unused = bool(getattr(ddp_model, "find_unused_parameters", False))
        for b in self._buckets:  # built already (a state_dict was loaded): mark which DDP feeds
            inside = {id(p) in self._ddp_params for p in b.params}
            if len(inside) > 1:
                raise RuntimeError(f"{type(self).__name__}.attach: a bucket mixes parameters DDP syncs and others "
                                   "it does not; attach before loading a state_dict or taking a step")
            b.via_ddp = inside.pop()
        self._build_buckets()
        register_compression_hook(ddp_model, self)
        self._ddp_attached = True

    def ddp_bucket_ready(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The comm hook's work: average in fp32 during warm-up; in the compression phase
        copy the local gradients into this optimizer's buckets and synchronise every bucket
        that is complete."""
        buf = bucket.buffer()
        self._update_phase()
        if not self._compressing:
            return self._warmup_future(bucket)
        if self.defer_sync_to_step:
            return ready_future(buf)  # local gradients; step() synchronises them
        with torch.no_grad():
            grads = bucket.gradients()
            places = [self._param_bucket[id(p)] for p in bucket.parameters()]
            # every gradient into this optimizer's buckets in one foreach copy, before any of them syncs
            torch._foreach_copy_([ob.grad_views()[i] for ob, i in places], grads)
            for (ob, i), g in zip(places, grads, strict=True):
                s = ob.sync
                # a parameter no rank used keeps grad None (DDP with find_unused_parameters): step()
                # learns that only after this sync, so keep its state now if it was unused here
                if self._ddp_find_unused and not bool(g.any()):
                    s.pending += self._snapshot(ob, [i])
                s.ready += 1
                if s.ready == len(ob.params):  # decided on the device where it can be: step() sends the
                    # buckets' verdicts to the host in one copy, and reads them a step later
                    s.verdict = sync_together(self, [(s, None, None)], send_verdict=False)
        return ready_future(buf)

    def _warmup_future(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The warm-up's mean of a DDP bucket: dense (in ``warmup_comm_dtype``), or as 8-bit codes
        through the optimizer's buckets on a sender thread (:class:`~.coded_warmup.CodedWarmupSender`)."""
        wire = self.warmup_wire
        if not wire.is_dense and self.world_size > 1:  # one rank: nothing to send, no code error either
            if self._coded_warmup is None:
                self._coded_warmup = CodedWarmupSender(self)
            return self._coded_warmup.bucket_ready(bucket)
        dense = DenseMean(wire if wire.is_dense else type(wire).dense(), self.process_group, self.comm_counter)
        return dense.future(bucket.buffer())

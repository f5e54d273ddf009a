"""How :class:`~lightning_onebit.optim.DiLoCo` averages a fragment's pseudo-gradients: one fp32 or bf16
all-reduce (as DDP and PyTorch's ``bf16_compress_hook`` run them), or the package's compressed collective,
flat or two-level (see the ``compression`` list in DiLoCo's module docstring)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..comm import CompressedAllreduce, HierarchicalAllreduce
from ..comm.accounting import ring_allreduce_bytes
from ..comm.dense import group_size, launcher_ranks_per_node
from ..comm.hierarchical import node_groups
from ..compress import Codec, MinMaxCodec, SignCodec
from .sync import _spans_the_world

__all__ = ["DiLoCoAllreduce"]

log = logging.getLogger(__name__)


class DiLoCoAllreduce:
    """Mixin of :class:`~lightning_onebit.optim.DiLoCo`: the outer all-reduce of each fragment and its
    collective (built on first use, one per fragment, every tensor with its own scales). Uses DiLoCo's
    settings, byte counters, fragments and error state."""

    def _average(self, delta: torch.Tensor, f: int, asynchronous: bool = False,
                 finite: torch.Tensor | None = None) -> tuple[object, torch.Tensor]:
        """(the all-reduce's handle or None, the mean pseudo-gradient once it completes; bf16 stays bf16).
        ``finite`` (compressed modes): this rank's pseudo-gradients are finite, checked in the agreement."""
        n, group = group_size(self.process_group), self.process_group
        if self.compression == "fp32":
            work = None
            if n > 1:
                delta.div_(n)
                work = dist.all_reduce(delta, group=group, async_op=asynchronous)
                self._wire.add(ring_allreduce_bytes(delta.numel(), n), delta.numel(), n)
            return work, delta
        if self.compression == "bf16":
            err = self._outer.setdefault(f"error{f}", torch.zeros_like(delta))
            e = delta.add_(err).div_(n)  # what this rank should contribute, with the last call's residual
            q = e.to(torch.bfloat16)
            err.copy_(e.sub_(q.float()).mul_(n))  # the residual, in pseudo-gradient units
            work = None
            if n > 1:
                work = dist.all_reduce(q, group=group, async_op=asynchronous)
                self._wire.add(ring_allreduce_bytes(q.numel(), n, 2), q.numel(), n)
            return work, q
        if f not in self._collectives:
            self._collectives[f] = self._make_collective(f)
        return None, self._collectives[f](delta, finite=finite)

    def _codec(self) -> Codec:
        return SignCodec("l2") if self.compression == "1bit" else MinMaxCodec(int(self.compression[0]))

    def two_level(self) -> int | None:
        """Ranks per node when the compressed outer all-reduce runs two-level, else None (flat)."""
        if self.compression in ("fp32", "bf16") or self.hierarchical is False:
            return None
        local = self.ranks_per_node or launcher_ranks_per_node()
        n, group, why = group_size(self.process_group), self.process_group, None
        if not _spans_the_world(group):
            why = "it runs on a group of every rank only (node groups are cut from the default group)"
        elif local is None:
            why = "the ranks per node are unknown (ranks_per_node=... or LOCAL_WORLD_SIZE)"
        elif n % local:
            why = f"{local} ranks per node do not divide the {n} ranks"
        elif local in (1, n):
            why = "one node, or one rank per node: nothing to gain"
        if why is None:
            return local
        if self.hierarchical:
            log.warning(f"DiLoCo: the two-level outer all-reduce falls back to flat: {why}")
        return None

    def _make_collective(self, f: int) -> CompressedAllreduce | HierarchicalAllreduce:
        offsets = self._fragment_spans()[f][2]  # every tensor of the fragment gets its own scales
        if (local := self.two_level()) is not None:
            if self._node_groups is None:  # collective: every rank reaches here at the same outer step
                self._node_groups = node_groups(local)
            lg, cg = self._node_groups
            return HierarchicalAllreduce(self._codec(), "error_feedback", local_group=lg, cross_group=cg,
                                         counter=self._wire, intra_counter=self.intra_node_counter, groups=offsets)
        return CompressedAllreduce(self._codec(), "error_feedback", group=self.process_group, counter=self._wire,
                                   groups=offsets)

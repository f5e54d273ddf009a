"""How :class:`~lightning_onebit.optim.DiLoCo` averages a fragment's pseudo-gradients: :class:`OuterMeans`.

Every fragment's mean is built by :func:`~lightning_onebit.comm.make_mean` from DiLoCo's ``compression``
wire: one fp32 or bf16 all-reduce (as DDP and PyTorch's ``bf16_compress_hook`` run them; bf16 with error
feedback), or the package's compressed collective, flat or two-level (the topology decides, as it does for
the Adam family). See the ``compression`` list in DiLoCo's module docstring.

With ``overlap`` > 0 an outer all-reduce runs while the replicas train on. fp32 and bf16 are one async
collective. The compressed collective is several rounds with the codec's passes between them, so it runs on
a sender thread (:class:`~lightning_onebit.comm.ThreadedMean`), one call after another in the order the outer
steps start, the same on every rank. Trade-offs:

* The thread's collectives must never interleave with the caller's (Lightning's logging, barriers): over
  every rank they run on a process group of their own (:meth:`~lightning_onebit.comm.Topology.own_group`),
  made at the first compressed outer step (collective: every rank is there at the same inner step); the
  two-level layout's node groups are DiLoCo's own anyway. A ``process_group`` the user passes is used as it
  is: nothing else may use it while an outer step is in flight.
* The thread shares the rank's cores with the inner steps: the codec's passes overlap with them only where
  cores are free; the waits on the link (bandwidth and round trips) overlap in any case.
* A non-finite pseudo-gradient (the collective's agreement sees it on every rank) fails the outer step when
  it lands, on every rank; its outer step is not applied. A failed link fails it there too, after the
  process group's timeout, never later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import ByteCounter, DenseMean, Flight, Sender, ThreadedMean, Topology, Wire, group_size, make_mean

__all__ = ["OUTER_WIRES", "OuterMeans"]

#: what DiLoCo's ``compression`` may name
OUTER_WIRES = ("fp32", "bf16", "8bit", "4bit", "2bit", "1bit")


class OuterMeans:
    """The outer all-reduce of each fragment of one DiLoCo, and the collectives it keeps.

    Args:
        wire: what goes on the wire (DiLoCo's ``compression``).
        group: the ranks that average.
        topology: flat or two-level, the node groups and the thread's own group.
        overlap: the outer all-reduces run while the replicas train (an async collective, or the thread).
        wire_counter: the bytes this thread sends; ``coded_counter``: what the compressed collectives count,
            on whichever thread runs them; ``intra_counter``: the two-level layout's fp32 bytes in a node.
    """

    def __init__(self, wire: Wire, *, group, topology: Topology, overlap: bool, wire_counter: ByteCounter,
                 coded_counter: ByteCounter, intra_counter: ByteCounter) -> None:
        self.wire, self.group, self.topology, self.overlap = wire, group, topology, overlap
        self.wire_counter, self.coded_counter, self.intra_counter = wire_counter, coded_counter, intra_counter
        #: fragment -> its compressed collective (made on first use; its error state is the rank's own)
        self.collectives: dict[int, object] = {}
        self._sender: Sender | None = None

    def two_level(self) -> int | None:
        """Ranks per node when the compressed outer all-reduce runs two-level, else None (flat)."""
        return None if self.wire.is_dense else self.topology.two_level(self.group)

    def make(self, offsets: Sequence[int]):
        """A compressed collective of a fragment whose tensors start at ``offsets`` (each its own scales)."""
        if (local := self.two_level()) is not None:  # collective: every rank is at the same outer step
            self.topology.node_groups(local)
        group = self.topology.own_group(self.group) if self.overlap else self.group
        return make_mean(self.wire, mode="error_feedback", group=group, topology=self.topology,
                         counter=self.coded_counter, intra_counter=self.intra_counter, groups=offsets)

    def start(self, f: int, delta: torch.Tensor, offsets: Sequence[int], *, asynchronous: bool,
              finite: torch.Tensor | None, error: torch.Tensor | None, counter: ByteCounter) -> tuple[Flight, bool]:
        """The mean of fragment ``f``'s pseudo-gradients ``delta`` (overwritten) on its way, and whether it counts
        its bytes into ``counter`` itself when it lands (the thread's). ``error``: bf16's error feedback.
        ``finite`` (compressed wires): this rank's pseudo-gradients are finite, checked in the agreement."""
        n = group_size(self.group)
        if self.wire.is_dense:
            return DenseMean(self.wire, self.group, self.wire_counter).start(delta, error=error,
                                                                            async_op=asynchronous), False
        if f not in self.collectives:
            self.collectives[f] = self.make(offsets)
        coded = self.collectives[f]
        if self._sender is None and asynchronous and n > 1:
            self._sender = Sender("lightning_onebit DiLoCo outer all-reduce")
        mean = ThreadedMean(coded, self._sender, self.coded_counter)
        if not (asynchronous and n > 1):
            result, sent = mean.run(delta, finite)
            self.wire_counter.add(sent, 0, n)
            return Flight(None, result), False
        return mean.start(delta, out=torch.empty_like(delta), counter=counter, world_size=n, finite=finite), True

"""How :class:`~lightning_onebit.optim.DiLoCo` averages a fragment's pseudo-gradients: one fp32 or bf16
all-reduce (as DDP and PyTorch's ``bf16_compress_hook`` run them), or the package's compressed collective,
flat or two-level (see the ``compression`` list in DiLoCo's module docstring).

With ``overlap`` > 0 an outer all-reduce runs while the replicas train on. fp32 and bf16 are one async
collective. The compressed collective is several rounds with the codec's passes between them, so it runs
on a sender thread (:class:`OuterSender`), one call after another in the order the outer steps start, the
same on every rank. Trade-offs:

* The thread's collectives must never interleave with the caller's (Lightning's logging, barriers):
  over every rank they run on a process group of their own, made at the first compressed outer step
  (collective: every rank is there at the same inner step); the two-level layout's node groups are
  DiLoCo's own anyway. A ``process_group`` the user passes is used as it is: nothing else may use it
  while an outer step is in flight.
* The thread shares the rank's cores with the inner steps: the codec's passes overlap with them only
  where cores are free; the waits on the link (bandwidth and round trips) overlap in any case.
* A non-finite pseudo-gradient (the collective's agreement sees it on every rank) fails the outer step
  when it lands, on every rank; its outer step is not applied. A failed link fails it there too, after the
  process group's timeout, never later.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..comm import CompressedAllreduce, HierarchicalAllreduce
from ..comm.accounting import ByteCounter, ring_allreduce_bytes
from ..comm.dense import group_size, launcher_ranks_per_node
from ..comm.duplex import enable_duplex, group_timeout
from ..comm.hierarchical import node_groups
from ..compress import Codec, MinMaxCodec, SignCodec
from .sync import _spans_the_world

__all__ = ["DiLoCoAllreduce", "OuterFlight", "OuterSender"]

log = logging.getLogger(__name__)


class OuterSender:
    """One daemon thread that runs jobs in the order they are submitted (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # the thread holds the queue only, so that dropping the sender ends it
        threading.Thread(target=self._run, args=(self._jobs,), daemon=True,
                         name="lightning_onebit DiLoCo outer all-reduce").start()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiter, re-raised on the caller's thread
                future.set_exception(exc)
            del fn, future, job

    def submit(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def __del__(self) -> None:
        self._jobs.put(None)


class OuterFlight:
    """A compressed outer all-reduce on the sender thread: :meth:`wait` blocks until it is done, copies its
    mean into ``out`` and counts its bytes once (as an async collective's handle, for ``DiLoCo._pending``)."""

    def __init__(self, future: Future, out: torch.Tensor, counter: ByteCounter, world_size: int) -> None:
        self.future, self.out, self.counter, self.world_size = future, out, counter, world_size

    def wait(self) -> bool:
        if self.future is not None:
            mean, sent = self.future.result()  # the thread's exception, if any, is raised here
            self.out.copy_(mean)
            self.counter.add(sent, 0, self.world_size)
            self.future = None
        return True


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
        collective, wire = self._collectives[f], self._coded_wire

        def mean() -> tuple[torch.Tensor, int]:  # the collective counts into a counter only it writes
            before = wire.total.bytes_sent
            return collective(delta, finite=finite), wire.total.bytes_sent - before

        if not (asynchronous and n > 1):
            result, sent = mean()
            self._wire.add(sent, 0, n)
            return None, result
        if self._sender is None:
            self._sender = OuterSender()
        out = torch.empty_like(delta)
        return OuterFlight(self._sender.submit(mean), out, self.comm_counter, n), out

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

    def _collective_group(self):
        """The process group of the compressed outer all-reduce: with ``overlap`` over every rank, a group of
        its own (see the module docstring), else ``process_group``."""
        if not (self.overlap and _spans_the_world(self.process_group) and group_size(self.process_group) > 1):
            return self.process_group
        if self._own_group is None:  # collective: every rank reaches here at the same outer step
            # the default group's timeout bounds every wait of the thread
            self._own_group = dist.new_group(timeout=group_timeout(),
                                             group_desc="lightning_onebit DiLoCo outer all-reduce")
            enable_duplex(self._own_group)
        return self._own_group

    def _make_collective(self, f: int) -> CompressedAllreduce | HierarchicalAllreduce:
        offsets = self._fragment_spans()[f][2]  # every tensor of the fragment gets its own scales
        if (local := self.two_level()) is not None:
            if self._node_groups is None:  # collective: every rank reaches here at the same outer step
                self._node_groups = node_groups(local)
            lg, cg = self._node_groups
            return HierarchicalAllreduce(self._codec(), "error_feedback", local_group=lg, cross_group=cg,
                                         group=self._collective_group(), counter=self._coded_wire,
                                         intra_counter=self.intra_node_counter, groups=offsets)
        return CompressedAllreduce(self._codec(), "error_feedback", group=self._collective_group(),
                                   counter=self._coded_wire, groups=offsets)

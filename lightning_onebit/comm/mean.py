"""One builder of every mean both families send: :func:`make_mean`.

What a mean sends is a :class:`~.wire.Wire`; where it runs is a group and a :class:`~.topology.Topology`
(flat or two levels, made once); what it sent goes to byte counters. The builder returns

* a dense wire: :class:`DenseMean`, the mean as DDP computes it (each rank divides by n, then the sum),
  sent in fp32, or in bf16/fp16 as PyTorch's ``bf16_compress_hook`` sends it, optionally with error
  feedback (what the cast dropped is added to the next input: DiLoCo's bf16 outer step);
* a coded wire: the two-stage compressed collective, flat
  (:class:`~lightning_onebit.comm.CompressedAllreduce`) or on two levels
  (:class:`~lightning_onebit.comm.HierarchicalAllreduce`), each owning its error state;
* with ``simulate=n``: the same arithmetic for n workers in one process, bit for bit
  (:class:`SimulatedDenseMean`, :class:`~lightning_onebit.comm.SimulatedCluster`,
  :class:`~lightning_onebit.comm.SimulatedHierarchicalCluster`).

A mean that must run while the caller goes on (DiLoCo's overlapped outer step) is started with
:meth:`DenseMean.start` (an async collective) or :class:`ThreadedMean` (the compressed collective's rounds and
codec passes on a :class:`Sender` thread, on the topology's group of its own). Trade-offs of the thread: its
collectives must never interleave with the caller's, hence the group of its own; it shares the rank's cores,
so the codec's passes overlap with the caller's work only where cores are free, the waits on the link always.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
import torch.distributed as dist

from .accounting import ByteCounter, ring_allreduce_bytes
from .allreduce import CompressedAllreduce
from .dense import group_size, mean_allreduce, mean_allreduce_future, to_wire
from .hierarchical import HierarchicalAllreduce, SimulatedHierarchicalCluster
from .simulated import SimulatedCluster
from .topology import Topology
from .wire import Wire

__all__ = ["DenseMean", "Flight", "Sender", "SimulatedDenseMean", "ThreadedMean", "make_mean", "simulated_mean"]


class Flight:
    """A mean on its way: :meth:`wait` blocks until it is done and returns it (once; later calls return it
    again at no cost). ``work`` is an async collective's handle, or ``None`` for a mean already done."""

    def __init__(self, work, result: torch.Tensor, on_done: Callable[[], None] | None = None) -> None:
        self.work, self.result, self._on_done = work, result, on_done

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # gloo's and NCCL's errors, or the sender thread's, are raised here
            self.work = None
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()
        return self.result


class DenseMean:
    """The full-precision mean over ``group`` in ``wire``'s dtype, counted as a ring all-reduce.

    ``x / n`` is taken in fp32 before the cast, so fp16's sum of n quotients stays in range where the sum of
    the inputs would not. With an ``error`` buffer (error feedback), ``x + error`` is sent and ``error``
    keeps what the cast dropped, in ``x``'s units."""

    def __init__(self, wire: Wire, group=None, counter: ByteCounter | None = None) -> None:
        if not wire.is_dense:
            raise ValueError(f"DenseMean sends a dense wire, got {wire}")
        self.wire, self.group, self.counter = wire, group, counter

    @property
    def _cast(self) -> torch.dtype | None:
        return None if self.wire.dtype == torch.float32 else self.wire.dtype

    def _count(self, numel: int, n: int) -> None:
        if self.counter is not None:
            self.counter.add(ring_allreduce_bytes(numel, n, self.wire.dtype.itemsize), numel, n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """In place: ``x`` <- the mean of ``x`` over the group (a no-op on one rank)."""
        return mean_allreduce(x, self.group, self.counter, dtype=self._cast)

    def future(self, x: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """:meth:`__call__` started asynchronously, as a DDP comm hook returns it (the future holds ``x``)."""
        return mean_allreduce_future(x, self.group, self.counter, dtype=self._cast)

    def start(self, x: torch.Tensor, *, error: torch.Tensor | None = None, async_op: bool = False) -> Flight:
        """The mean of ``x`` (overwritten), with error feedback into ``error`` if given; the flight's result
        is in the wire's dtype (bf16 stays bf16)."""
        n = group_size(self.group)
        if n == 1 and error is None:
            return Flight(None, x)
        if error is None:
            q = to_wire(x, n, self._cast)
        else:
            e = x.add_(error).div_(n)  # what this rank contributes, with the last call's residual
            q = e if self._cast is None else e.to(self._cast)
            if q is e:
                error.zero_()
            else:
                error.copy_(e.sub_(q.float()).mul_(n))  # the residual, in the input's units
        work = None
        if n > 1:
            work = dist.all_reduce(q, group=self.group, async_op=async_op)
            self._count(q.numel(), n)
        return Flight(work if async_op else None, q)


def simulated_mean(worker_grads: Sequence[torch.Tensor], out: torch.Tensor | None = None,
                   scratch: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(g_0 / n) + (g_1 / n) + ... in worker order: what DDP's divide-then-sum gives on n ranks
    (into ``out``, with ``scratch`` for the quotients, when given: no fresh buffers). ``dtype``: the
    quotients and the sum in that dtype, rounded after each add as a collective summing it would."""
    n = len(worker_grads)
    if dtype is not None and dtype != worker_grads[0].dtype and n > 1:
        acc = (worker_grads[0] / n).to(dtype)
        for g in worker_grads[1:]:
            acc += (g / n).to(dtype)
        return out.copy_(acc) if out is not None else acc.to(worker_grads[0].dtype)
    acc = torch.div(worker_grads[0], n, out=out) if out is not None else worker_grads[0] / n
    for g in worker_grads[1:]:
        acc += torch.div(g, n, out=scratch) if scratch is not None else g / n
    return acc


class SimulatedDenseMean:
    """:class:`DenseMean` of ``world_size`` simulated workers in one process, counted as the real one."""

    def __init__(self, wire: Wire, world_size: int, counter: ByteCounter | None = None) -> None:
        self.wire, self.world_size, self.counter = wire, world_size, counter

    def allreduce_into(self, xs: Sequence[torch.Tensor], out: torch.Tensor,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
        dtype = None if self.wire.dtype == torch.float32 else self.wire.dtype
        simulated_mean(xs, out=out, scratch=scratch, dtype=dtype)
        if self.counter is not None:
            n = len(xs)
            self.counter.add(ring_allreduce_bytes(out.numel(), n, self.wire.dtype.itemsize), out.numel(), n)
        return out


Mean = DenseMean | SimulatedDenseMean | CompressedAllreduce | HierarchicalAllreduce | SimulatedCluster \
    | SimulatedHierarchicalCluster


def make_mean(wire: Wire, *, mode: str = "plain", group=None, topology: Topology | None = None,
              counter: ByteCounter | None = None, intra_counter: ByteCounter | None = None,
              groups: Sequence[int] | None = None, block_size: int | None = None, simulate: int | None = None,
              verify: str = "always", numel: int | None = None, device: torch.device | str | None = None) -> Mean:
    """The mean that sends ``wire`` (see the module docstring).

    Args:
        mode: a coded mean's state: ``"plain"``, ``"error_feedback"`` (worker and server error) or
            ``"markov"``; a dense mean has none (its error feedback is :meth:`DenseMean.start`'s ``error``).
        group: the ranks that average (``None``: the default group).
        topology: flat or two levels, and the node groups (``None``: flat).
        counter: the bytes between nodes (all of them when flat); ``intra_counter``: the two-level mean's
            fp32 bytes inside a node.
        groups: where the tensors of a flat input start: no scale spans two of them.
        block_size: the codec's scale blocks within a tensor.
        simulate: that many workers in one process instead of ``group``.
        verify: the compressed collective's agreement round, ``"always"`` or ``"first"``.
        numel, device: bind the collective to this size now (its state exists before the first call).
    """
    if wire.is_dense:
        return DenseMean(wire, group, counter) if simulate is None else SimulatedDenseMean(wire, simulate, counter)
    codec = wire.codec(block_size)
    local = None if topology is None else topology.two_level(group, simulate)
    if simulate is not None and local is not None:
        mean = SimulatedHierarchicalCluster(codec, mode, simulate // local, local, counter=counter,
                                            intra_counter=intra_counter, groups=groups)
    elif simulate is not None:
        mean = SimulatedCluster(codec, mode, simulate, counter=counter, groups=groups)
    elif local is not None:
        lg, cg = topology.node_groups(local)
        mean = HierarchicalAllreduce(codec, mode, local_group=lg, cross_group=cg, group=group, counter=counter,
                                     intra_counter=intra_counter, verify=verify, groups=groups)
    else:
        mean = CompressedAllreduce(codec, mode, group=group, counter=counter, verify=verify, groups=groups)
    if numel is not None:
        mean.bind(numel, device if device is not None else "cpu")
    return mean


class Sender:
    """One daemon thread that runs jobs in the order they are submitted: the same order on every rank, so
    the collectives they issue pair up across ranks. Dropping the sender ends the thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # the thread holds the queue only, so that dropping the sender ends it
        threading.Thread(target=self._run, args=(self._jobs,), daemon=True, name=name).start()

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


class _FutureWork:
    """A sender job as an async collective's handle (``wait`` raises the job's error)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> bool:
        self.future.result()
        return True


class ThreadedMean:
    """A compressed mean that runs on a :class:`Sender` thread: :meth:`start` returns at once with a
    :class:`Flight` whose ``wait`` copies the mean into ``out`` and adds its bytes to ``counter`` on the
    caller's thread. The collective counts into a counter only the thread writes (``own_counter``)."""

    def __init__(self, mean: CompressedAllreduce | HierarchicalAllreduce, sender: Sender,
                 own_counter: ByteCounter) -> None:
        self.mean, self.sender, self.own_counter = mean, sender, own_counter

    def run(self, x: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The mean now, on this thread, and the bytes it sent."""
        before = self.own_counter.total.bytes_sent
        return self.mean(x, finite=finite), self.own_counter.total.bytes_sent - before

    def start(self, x: torch.Tensor, *, out: torch.Tensor, counter: ByteCounter, world_size: int,
              finite: torch.Tensor | None = None) -> Flight:
        future = self.sender.submit(lambda: self.run(x, finite))

        def land() -> None:
            mean, sent = future.result()
            out.copy_(mean)
            counter.add(sent, 0, world_size)

        return Flight(_FutureWork(future), out, land)

"""Threads of the numba CPU kernels: a threading layer that leaves torch alone, one budget per rank.

Two things would make results depend on numba's thread count; both are handled here:

* numba's OpenMP threading layer shares the OpenMP runtime with PyTorch, and starting numba's
  thread pool sets that runtime's thread count to numba's (all cores by default). torch's
  intra-op thread count then changes under the user's feet the first time a compression kernel
  runs (``OMP_NUM_THREADS=1`` becomes 2 on two cores), so torch's reductions and matmuls - the
  model's gradients - depend on numba's thread count, and a resumed process, whose first step
  runs before any kernel, computes differently from an uninterrupted one. Unless the user chose
  a layer (``NUMBA_THREADING_LAYER[_PRIORITY]``), numba tries TBB (where its library loads, e.g.
  conda's ``tbb``), then its own ``workqueue`` layer, before OpenMP. The kernels run about as fast
  on ``workqueue`` as on OpenMP (``benchmarks/codecs.py`` measures them; run it with
  ``NUMBA_THREADING_LAYER=workqueue`` and ``=omp`` to compare). ``workqueue`` must not be
  entered from two threads at once; the package launches kernels from one thread at a time:
  the thread that calls it, or during backward the 8-bit warm-up's sender thread, which
  DDP waits for before ``backward()`` returns. If the OpenMP layer is active anyway, torch's
  thread count is put back after every launch.
* The kernels' own reductions sum in a fixed order (:mod:`.layout`), whatever the thread count.

Budget: ranks that share a host each start numba with all cores and oversubscribe it. The
strategies (and ``attach`` under torchrun) give each rank ``cores / ranks on the host`` threads,
as torchrun does for OpenMP, unless the user set ``NUMBA_NUM_THREADS`` or called
``numba.set_num_threads``; the budget is applied on the thread that launches a kernel (numba's
setting is per thread).

Small inputs: starting numba's parallel region costs more than the whole kernel on a small
tensor (a bias, a simulated worker's share; ``benchmarks/codecs.py --sizes`` times any size).
:func:`parallel_and_serial` compiles a kernel twice and runs inputs of fewer than ``SERIAL_BELOW``
elements on the serial copy; the summation order is the layout's, not the threads', so both give
the same bits.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import numba
import torch

__all__ = ["SERIAL_BELOW", "apply_thread_budget", "available_cores", "parallel_and_serial", "parallel_kernel",
           "set_thread_budget", "thread_budget", "variant"]

SERIAL_BELOW = 1 << 15
"""Element count from which a :func:`parallel_and_serial` kernel runs its parallel copy."""

_budget: int | None = None
_applied: int | None = None  # the budget a kernel launch last set numba's thread count to
_logged: set[str] = set()
F = TypeVar("F", bound=Callable[..., Any])


def _choose_layer() -> None:
    """TBB, else numba's workqueue, before OpenMP - unless the user chose (before numba's pool starts)."""
    if os.environ.get("NUMBA_THREADING_LAYER") or os.environ.get("NUMBA_THREADING_LAYER_PRIORITY"):
        return
    try:
        from numba.np.ufunc import parallel

        started = parallel._is_initialized
    except (ImportError, AttributeError):  # numba's internals moved: leave its default
        return
    if not started and numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER_PRIORITY = ["tbb", "workqueue", "omp"]


_choose_layer()


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_budget() -> int | None:
    """Threads the kernels run with (``None``: numba's own setting)."""
    return _budget


def set_thread_budget(n: int | None) -> None:
    """Run the numba kernels with ``n`` threads (``None``: numba's own setting)."""
    global _budget
    if n is not None and not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"thread budget must be in [1, {numba.config.NUMBA_NUM_THREADS}] (numba's pool), got {n}")
    _budget = n


def _user_chose() -> str | None:
    if "NUMBA_NUM_THREADS" in os.environ:
        return f"NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']}"
    n = numba.get_num_threads()
    # a count other than numba's own is the user's, unless a kernel launch set it to the budget (a rank
    # that ran kernels before the strategy or the optimizer applied the budget again)
    if n != numba.config.NUMBA_NUM_THREADS and n != _applied:
        return f"numba.set_num_threads({n})"
    return None


def apply_thread_budget(local_ranks: int) -> str | None:
    """Give the kernels ``available_cores() // local_ranks`` threads (at least 1), unless the user
    chose numba's thread count. Returns a line saying what was chosen the first time a choice is
    made in this process (for the caller to log), else None."""
    chosen = _user_chose()
    if chosen is not None:
        set_thread_budget(None)
        msg = f"lightning_onebit: numba kernels use {numba.get_num_threads()} threads per rank ({chosen})"
    else:
        cores = available_cores()
        n = max(1, min(cores // max(local_ranks, 1), numba.config.NUMBA_NUM_THREADS))
        set_thread_budget(n)
        msg = (f"lightning_onebit: numba kernels use {n} threads per rank ({cores} cores / {local_ranks} ranks on "
               "this host; set NUMBA_NUM_THREADS to choose)")
    if msg in _logged:
        return None
    _logged.add(msg)
    return msg


def parallel_kernel(fn: F) -> F:
    """Wrap a function that launches numba parallel kernels: apply the budget on this thread and
    leave torch's thread count as it was (numba's OpenMP layer shares the OpenMP runtime with
    torch, and its pool start and ``numba.set_num_threads`` change torch's count)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch_threads = torch.get_num_threads()
        global _applied
        if _budget is not None and numba.get_num_threads() != _budget:
            numba.set_num_threads(_budget)
            _applied = _budget
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)

    return wrapper  # type: ignore[return-value]


def variant(fn: Callable, name: str, **names: Any) -> Callable:
    """A copy of ``fn`` named ``name`` (numba caches each copy apart) whose globals ``names`` are bound
    to other objects: one source for kernels that differ only in the functions they call, each
    compiled with its own (numba reads globals when it compiles), so a kernel holds only its code."""
    scope = {**fn.__globals__, **names} if names else fn.__globals__
    copy = types.FunctionType(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__.rpartition(".")[0] + "." + name if "." in fn.__qualname__ else name
    return copy


class parallel_and_serial:  # noqa: N801  (used as a decorator, like numba's njit)
    """A numba kernel compiled twice, ``parallel=True`` and serial, both cached on disk (the serial
    one is a copy of the function under another name, so the cache keeps them apart). Called with
    the element count first: fewer than ``SERIAL_BELOW`` run serially. A copy's first call in a
    process compiles it (or loads numba's cache) under the host's compile lock
    (:func:`.compile_once.host_lock`), so the ranks of a host compile each kernel once."""

    #: every kernel made so far (:func:`.compile_once.compile_kernels` compiles their parallel copies)
    instances: list[parallel_and_serial] = []

    def __init__(self, fn: Callable) -> None:
        serial = variant(fn, fn.__name__ + "_serial")
        self.parallel = numba.njit(parallel=True, nogil=True, cache=True)(fn)
        self.serial = numba.njit(nogil=True, cache=True)(serial)
        parallel_and_serial.instances.append(self)

    def __call__(self, numel: int, *args: Any) -> Any:
        kernel = self.serial if numel < SERIAL_BELOW else self.parallel
        if kernel.overloads:  # compiled in this process (for some argument types: enough to tell a first call)
            return kernel(*args)
        from .compile_once import host_lock

        with host_lock():
            return kernel(*args)

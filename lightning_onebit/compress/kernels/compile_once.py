"""The numba CPU kernels compiled once per host, not once per rank.

numba compiles a ``cache=True`` kernel on its first call in a process, or loads it from its on-disk
cache. On a first run every rank of a host would compile the same kernels at the same time (minutes
of CPU each on a small machine, where they also race to write numba's cache index). Instead, a
first call compiles under a host-wide lock (:func:`host_lock`): the first rank to get there compiles
and writes the cache, the others wait and then load it.

* :func:`compile_kernels` compiles (or loads) every kernel of the codecs at once; the strategies
  call it at setup, so that no training step pays for compilation. It is idempotent and costs
  nothing once done.
* Every other first call of a kernel (:class:`~.threads.parallel_and_serial`: the optimizers'
  kernels, a plain-DDP user's first encode) takes the same lock, so those too compile once.

The lock is ``fcntl.flock`` on a file beside numba's cache of this package (its ``__pycache__``, or
under ``NUMBA_CACHE_DIR``), the directory every rank of the host loads the kernels from. The OS drops
a flock when its holder exits, a killed one included, so a crash never blocks a later run; a wait
is bounded by :data:`LOCK_TIMEOUT_S`, after which the process compiles without the lock (what every
rank did before: the same kernels, only compiled twice) and warns.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from functools import cache

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no host lock, every process compiles for itself
    fcntl = None

__all__ = ["LOCK_NAME", "LOCK_TIMEOUT_S", "compile_kernels", "host_lock", "lock_path"]

LOCK_NAME = "lightning_onebit-compile.lock"
LOCK_TIMEOUT_S = 900.0
"""Seconds a process waits for another's compilation before it compiles by itself (a first compile of
every kernel takes minutes on 2 busy cores; loading them from the cache, seconds)."""

_guard = threading.RLock()  # one holder per process: a flock belongs to an open file, not to a thread
_depth = 0  # host_lock blocks this process is inside
_fd: int | None = None  # the lock file while held
_done = False


def _here() -> None:
    """A function of this module: numba's cache locator finds the package's cache folder from it."""


@cache
def lock_path() -> str:
    """The lock file: beside numba's cache of this package's kernels (the folder is created if need be)."""
    try:
        from numba.core.caching import FunctionCache

        locator = FunctionCache(_here)._impl.locator
        locator.ensure_cache_path()
        folder = locator.get_cache_path()
    except Exception:  # numba's internals moved, or no cache folder it can write: one per user on the host
        folder = os.path.join(tempfile.gettempdir(), f"lightning_onebit-{getattr(os, 'getuid', lambda: 0)()}")
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, LOCK_NAME)


def _acquire(fd: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


@contextlib.contextmanager
def host_lock(timeout: float | None = None) -> Iterator[bool]:
    """Hold the host-wide compile lock for the block (re-entrant within a process; other threads of the
    process wait for it). Yields whether the lock is held: False where the wait ran out (``timeout``,
    default :data:`LOCK_TIMEOUT_S`; a warning says so) or the platform has no ``fcntl``; the block runs
    either way."""
    global _depth, _fd
    with _guard:
        if _depth or fcntl is None:
            _depth += 1
            try:
                yield fcntl is not None
            finally:
                _depth -= 1
            return
        fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            wait = LOCK_TIMEOUT_S if timeout is None else timeout
            got = _acquire(fd, wait)
            if not got:
                warnings.warn(f"lightning_onebit: waited {wait:.0f} s for another process to compile the numba "
                              f"kernels ({lock_path()}); compiling here too", RuntimeWarning, stacklevel=3)
            _depth, _fd = 1, fd
            try:
                yield got
            finally:
                _depth, _fd = 0, None
        finally:
            os.close(fd)  # the only descriptor of the open file: closing it drops the flock


def _after_fork_in_child() -> None:
    # forked while another thread held the lock: the child holds neither the guard nor (by itself) the flock
    global _guard, _depth, _fd
    _guard = threading.RLock()
    if _fd is not None:
        with contextlib.suppress(OSError):
            os.close(_fd)
    _depth, _fd = 0, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def compile_kernels(device: torch.device | str | None = None) -> None:
    """Compile, or load from numba's cache, every numba CPU kernel of the codecs, once per host.

    Runs each codec operation once on a few elements on the numba backend (which compiles the serial
    copy of every kernel, with the argument types real calls use) and then compiles the parallel
    copies for the same types, all under :func:`host_lock`. Idempotent: later calls return at once.
    ``device``: where the codecs will run (a strategy's root device); the CPU kernels are compiled only
    for a CPU device (or None), since CUDA tensors use the CUDA backend. The strategies call it at
    setup; without it, each kernel's first call takes the lock by itself."""
    global _done
    if _done or (device is not None and torch.device(device).type != "cpu"):
        return
    with host_lock():
        if not _done:
            _warm_up()
            _done = True


def _warm_up() -> None:
    from ..codecs import MinMaxCodec, SignCodec
    from ..source import Sink, Source
    from . import numba_cpu
    from .threads import parallel_and_serial

    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(64, generator=g), torch.randn(64, generator=g)
    for codec in (SignCodec(backend="numba"), MinMaxCodec(8, backend="numba")):  # each kernel serves every kind
        enc = codec.encode_error_feedback(Source.lerp(m, x, 0.1, groups=[0, 40]), torch.zeros(64), nseg=2)
        codec.decode(enc, out=torch.empty(64), accumulate=True)
        sink = Sink(numel=64, groups=[0], targets=[torch.zeros(64)], denom=torch.ones(64), values=[1.0], decay=1.0)
        codec.decode(enc, out=torch.empty(64), sink=sink)
        rows = codec.encode_markov(x, torch.zeros(64), nseg=2)
        codec.decode_mean(rows)
        codec.server_step(rows, torch.zeros(32))  # the rows' mean read inside both passes
        codec.server_step(codec.encode(x, nseg=4), torch.zeros(16))  # decoded into a buffer first
    numba_cpu.mean_rows(x.view(2, 32), torch.empty(32))
    for kernel in parallel_and_serial.instances:
        for sig in kernel.serial.signatures:  # the parallel copy for the types the serial one was called with
            kernel.parallel.compile(sig)

"""The numba CPU kernels compiled once per host, not once per rank.

numba compiles a ``cache=True`` kernel on its first call in a process, or loads it from its on-disk
cache. On a first run every rank of a host would compile the same kernels at the same time (each
a long compile on a small machine, and a race to write numba's cache index). Instead, a first call
compiles under a host-wide lock (:func:`host_lock`): the first rank to get there compiles and
writes the cache, the others wait and then load it.

* A kernel's first call in a process (:class:`~.threads.parallel_and_serial`: the codecs' and the
  optimizers' kernels, a plain-DDP user's first encode as much as a strategy's) takes the lock, so
  a first run compiles what it uses, once per host.
* :func:`~lightning_onebit.compress.compile_kernels`, which the strategies call at setup, loads what
  the cache holds under the lock before the first step (idempotent, and nothing to do once done);
  ``every=True`` compiles every codec kernel up front (the test session).

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

try:
    import fcntl
except ImportError:  # not POSIX: no host lock, every process compiles for itself
    fcntl = None

__all__ = ["LOCK_NAME", "LOCK_TIMEOUT_S", "host_lock", "lock_path"]

LOCK_NAME = "lightning_onebit-compile.lock"
LOCK_TIMEOUT_S = 900.0
"""Seconds a process waits for another's compilation before it compiles by itself: more than a first
compile of every kernel takes on a small, busy machine (loading them from the cache is quick)."""

_guard = threading.RLock()  # one holder per process: a flock belongs to an open file, not to a thread
_depth = 0  # host_lock blocks this process is inside
_fd: int | None = None  # the lock file while held


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
            pause = min(2 * pause, 0.1)  # at most a tenth of a second late, ten polls a second


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

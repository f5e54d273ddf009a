"""How ranks start: the DDPStrategy every strategy of this package builds on.

:class:`BaseDDPStrategy` is Lightning's ``DDPStrategy`` with two launch problems fixed.

**Forkserver launches that are correct and fast.** ``start_method="spawn"`` starts a fresh
interpreter per rank, which imports torch and Lightning again (several seconds of CPU per rank
and fit). ``"forkserver"`` forks ranks from a server process that has imported them once, but
Lightning treats it like ``"fork"``: on CPU the model's tensors reach the ranks in shared memory,
so every rank updates *the same* parameters (each step is applied once per rank), and the ranks
see the forkserver's environment and RNG state instead of the launching process's. Here a
forkserver launch gets what a spawn launch gets: a private copy of every module, the launching
process's environment (``PL_GLOBAL_SEED``, ``OMP_NUM_THREADS``, ...), its RNG states and its
deterministic-algorithm flags, so both give the same bits; and its DataLoader workers start as a
torchrun rank's do (fork on Linux), not through a forkserver of their own. When the forkserver is not running
yet and nobody chose its preload, it preloads ``__main__``, torch, Lightning and this package.

**Restarts under ``torchrun --max-restarts``.** torchrun's c10d rendezvous shares one TCPStore
between the agent and its workers and keeps it across restarts (``TORCHELASTIC_USE_AGENT_STORE``,
the same ``MASTER_PORT`` on every attempt), while ``init_process_group("env://")`` adds no
per-attempt prefix to its keys. Gloo's full-mesh connect publishes each rank's listening address
under a fixed key, so a restarted rank can read the address its peer had *before* the restart and
fail with "connectFullMesh failed ... Connection refused" (or wait in the connect); on a 2-core
machine that happened on most restarts of a 2-rank job. The process group is started here in keys
of ``TORCHELASTIC_RESTART_COUNT`` (what torch did before the store was shared:
:func:`~lightning_onebit.comm.process_group.init_for_attempt`). Outside torchrun nothing changes.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.launchers.multiprocessing import _disable_module_memory_sharing
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot, _MultiProcessingLauncher

from ..comm.process_group import attempt_store, init_for_attempt

__all__ = ["FORKSERVER_PRELOAD", "BaseDDPStrategy", "attempt_store", "destroy_process_group_at_exit"]

#: what the forkserver imports once for all ranks, unless its preload was chosen elsewhere
FORKSERVER_PRELOAD = ["__main__", "torch", "torch.distributed", "lightning.pytorch", "lightning_onebit"]

_CLEANUP_REGISTERED = False


#: futex(2)'s number by machine, to read what a blocked thread waits in from /proc
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT_BITSET = 9  # what glibc's pthread_cond_wait waits with (its mutexes use FUTEX_WAIT, 0)


def _gloo_workers_idle() -> bool | None:
    """Whether every gloo worker thread of this process waits for new work; ``None`` where /proc
    cannot tell (not Linux, an unknown machine).

    An idle worker is blocked in ``pthread_cond_wait`` on its queue: a futex wait-bitset without a
    timeout. A worker that still has to release a finished work is running, waits for the GIL (a
    timed wait) or for the queue's mutex (a plain futex wait)."""
    futex = _FUTEX_SYSCALL.get(os.uname().machine)
    if futex is None or not os.path.isdir("/proc/self/task"):
        return None
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                call = f.read().split()  # "running", or: number, 6 arguments, stack and program pointers
        except (FileNotFoundError, ProcessLookupError):  # the thread has ended
            continue
        except OSError:  # not readable here (a ptrace policy): cannot tell
            return None
        if not (len(call) >= 5 and call[0] == str(futex) and int(call[2], 16) & 0x7F == _FUTEX_WAIT_BITSET
                and int(call[4], 16) == 0):
            return False
    return True


def _destroy_process_group(timeout: float = 5.0) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # Groups that objects still alive hold (a DDP model in a global, the optimizers) outlive this;
    # their worker threads must be idle before the interpreter finalises (see the docstring below).
    # Sleeping lets a worker that waits for the GIL take it.
    # Idle twice, 5 ms apart: a worker just notified of new work still shows its wait until it runs.
    deadline = time.monotonic() + timeout
    idle, streak = _gloo_workers_idle(), 0
    while idle is not None and streak < 2 and time.monotonic() < deadline:
        streak = streak + 1 if idle else 0
        time.sleep(0.005 if idle else 0.001)
        idle = _gloo_workers_idle()
    if idle is None:
        time.sleep(0.05)  # cannot see the workers here: a grace period


def destroy_process_group_at_exit() -> None:
    """At interpreter exit, destroy the default process group (whatever its backend) and wait
    (5 s at most) until gloo's worker threads are idle.

    Lightning destroys the group only for NCCL. A gloo worker thread releases each work after
    completing it, and the release needs the GIL when a tensor of the work still has its Python
    object. If the main thread has already gone on to exit, the worker takes the GIL while the
    interpreter finalises, which ends the thread inside a destructor: "terminate called without an
    active exception", SIGABRT, after a run that completed (reported by ``spawn`` as "process 1
    terminated with signal SIGABRT", by torchrun as exit code -6). Destroying the group is not
    enough, since whatever still holds it (DDP, the optimizers) keeps its threads; so the exit also
    waits, with the GIL released, until every gloo worker waits for new work. Idempotent.
    """
    global _CLEANUP_REGISTERED
    if not _CLEANUP_REGISTERED:
        atexit.register(_destroy_process_group)
        _CLEANUP_REGISTERED = True


def _preload_forkserver() -> None:
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", 1) is None and getattr(server, "_preload_modules", None) == ["__main__"]:
        multiprocessing.forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)


class _AsIfSpawned:
    """The rank's entry point, run first in the forked rank: the launching process's environment,
    global torch state and private copies of the modules, as a spawned rank has them."""

    def __init__(self, function: Callable, cpu: bool) -> None:
        self.function, self.cpu = function, cpu
        self.env = dict(os.environ)
        self.state = _GlobalStateSnapshot.capture()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        local_rank = os.environ["LOCAL_RANK"]  # set by Lightning's wrapping function, like OMP_NUM_THREADS
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ.clear()
        os.environ.update(self.env, LOCAL_RANK=local_rank)
        os.environ.setdefault("OMP_NUM_THREADS", threads or "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the forkserver's libgomp read its own env
        self.state.restore()
        # multiprocessing made this rank's default start method the forkserver (it is a forkserver
        # child): its DataLoader workers would each come from a new server that imports everything
        # again. Give it the platform's default, what a rank torchrun started has (fork on Linux).
        multiprocessing.set_start_method(None, force=True)
        if self.cpu:  # the tensors arrived in shared memory: one copy per rank, as spawn makes
            args, kwargs = _disable_module_memory_sharing((args, kwargs))
        return self.function(*args, **kwargs)


class _ForkserverLauncher(_MultiProcessingLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _preload_forkserver()
        entry = _AsIfSpawned(function, isinstance(self._strategy.accelerator, CPUAccelerator))
        return super().launch(entry, *args, trainer=trainer, **kwargs)


class BaseDDPStrategy(DDPStrategy):
    """:class:`~lightning.pytorch.strategies.DDPStrategy` with sound ``start_method="forkserver"``
    launches and process groups that survive ``torchrun --max-restarts`` (see the module
    docstring); the base of this package's strategies, and what the recipes' plain-DDP baseline uses."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "forkserver":
            self._launcher = _ForkserverLauncher(self, start_method="forkserver")

    def setup_distributed(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            self.set_world_ranks()
            init_for_attempt(self._get_process_group_backend(), rank=self.global_rank, world_size=self.world_size,
                             timeout=self._timeout, device=self.root_device)
        super().setup_distributed()  # finds the group initialised and keeps it
        destroy_process_group_at_exit()

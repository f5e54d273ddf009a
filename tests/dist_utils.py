"""Run a function on n gloo ranks (processes forked from the session's forkserver, see conftest.py)
and collect what each returns."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

import numba.core.config
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "reduce_scatter_tensor", "gather", "scatter", "barrier")


@contextlib.contextmanager
def counting_collectives(on_call: Callable[[str], None]) -> Iterator[None]:
    """Inside, every torch.distributed collective this process starts first calls ``on_call(name)``
    (the package calls them as ``dist.<name>``); the originals come back on exit."""
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str, f: Callable) -> Callable:
        def call(*a, **k):
            on_call(name)
            return f(*a, **k)
        return call

    for name, f in real.items():
        setattr(dist, name, counted(name, f))
    try:
        yield
    finally:
        for name, f in real.items():
            setattr(dist, name, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, outdir: str, fn, args, timeout_s: float, env: dict) -> None:
    os.environ.clear()  # the test's environment, not the forkserver's
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      NUMBA_NUM_THREADS="1")
    # numba read its config when the forkserver imported it (NUMBA_NUM_THREADS = all cores); the first kernel
    # this rank compiles would reload it and refuse the new count once a cached kernel had started the threads
    numba.core.config.reload_config()
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent, which decides
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Start ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``.

    Returns one ``("ok", value)`` or ``("error", text)`` per rank. ``fn`` must be a
    module-level function (the ranks import it).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("forkserver")
        # The store lives here, not in rank 0: a rank that returns first and exits must not take it
        # away from ranks still inside a collective that waits on it (a new group's store barrier).
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        port = store.port
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, outdir, fn, args, timeout_s, dict(os.environ)))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s + 120
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [p.pid for p in procs if p.is_alive()]
            if hung:
                raise TimeoutError(f"rank processes {hung} did not finish")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            results.append(torch.load(path, weights_only=False))
        return results


def values(results: list) -> list:
    """The ranks' return values; fails with the first rank's traceback if any rank raised."""
    for r, (status, v) in enumerate(results):
        if status != "ok":
            raise AssertionError(f"rank {r} raised:\n{v}")
    return [v for _, v in results]


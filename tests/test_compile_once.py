"""The numba kernels compile once per host: the first process to reach a kernel compiles it under the
host's compile lock and writes numba's cache, the others wait and load it; a lock whose holder died
is free again, and a wait is bounded."""

import os
import sys
import textwrap
import time
import warnings

import pytest

from dist_utils import run_ranks, values
from proc_utils import started

KERNEL = textwrap.dedent("""
    from numba import prange

    from lightning_onebit.compress.kernels.threads import parallel_and_serial


    @parallel_and_serial
    def double(x, out):
        for i in prange(x.size):
            out[i] = 2 * x[i]
""")


def _race(rank: int, world_size: int, folder: str) -> dict:
    """Both ranks call a fresh kernel's two copies at the same moment (after a barrier)."""
    import numpy as np
    import torch.distributed as dist

    from lightning_onebit.compress.kernels import compile_once as kcompile

    sys.path.insert(0, folder)
    import fresh_kernel  # written by the test; numba caches it under the test's NUMBA_CACHE_DIR

    x, out = np.arange(8, dtype=np.float32), np.empty(8, np.float32)
    dist.barrier()
    fresh_kernel.double(0, x, out)  # the serial copy
    fresh_kernel.double(1 << 30, x, out)  # the parallel copy (the count only picks the copy)
    assert (out == 2 * x).all()
    stats = {name: getattr(fresh_kernel.double, name).stats for name in ("serial", "parallel")}
    return {"lock": kcompile.lock_path(),
            **{name: (sum(s.cache_misses.values()), sum(s.cache_hits.values())) for name, s in stats.items()}}


@pytest.mark.budget(40)  # two ranks, each compiling or loading a parallel kernel
def test_two_ranks_compile_a_kernel_once(tmp_path, monkeypatch):
    """With an empty cache, one rank compiles each copy of the kernel (a cache miss) and the other
    loads what it wrote (a cache hit); without the lock both would miss and compile."""
    (tmp_path / "fresh_kernel.py").write_text(KERNEL)
    cache = tmp_path / "cache"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))  # the ranks reload numba's config from the environment
    ranks = values(run_ranks(_race, 2, str(tmp_path), timeout_s=120.0))
    for copy in ("serial", "parallel"):
        misses, hits = zip(*(r[copy] for r in ranks), strict=True)
        assert sorted(misses) == [0, 1] and sorted(hits) == [0, 1] and misses != hits, (copy, ranks)
    assert {r["lock"] for r in ranks} == {ranks[0]["lock"]} and ranks[0]["lock"].startswith(str(cache))


def _codec_kernels() -> list:
    from lightning_onebit.compress.kernels.threads import parallel_and_serial

    return [k for k in parallel_and_serial.instances
            if k.serial.py_func.__module__.startswith("lightning_onebit.compress.")]


def test_compile_kernels_every_compiles_each_codec_kernel_once_per_process(monkeypatch):
    """``compile_kernels(every=True)`` (the session start ran it) leaves every numba kernel of the codecs
    with its serial and parallel copy, and a second call does nothing; the lock sits in numba's cache
    folder of the kernels."""
    from lightning_onebit.compress import compile as kready
    from lightning_onebit.compress.kernels import compile_once as kcompile
    from lightning_onebit.compress.kernels import numba_cpu

    kready.compile_kernels(every=True)
    assert len(_codec_kernels()) >= 6
    for k in _codec_kernels():
        assert k.serial.overloads and list(k.parallel.overloads) == list(k.serial.overloads), k.serial.py_func
    monkeypatch.setattr(kready, "_warm_up", lambda: pytest.fail("compile_kernels ran twice"))
    kready.compile_kernels(every=True)
    kready.compile_kernels()
    assert os.path.dirname(kcompile.lock_path()) == numba_cpu._decode_rows.serial.stats.cache_path


def _load_only(rank: int, world_size: int) -> list:
    from lightning_onebit.compress import compile_kernels

    compile_kernels()
    return [(k.serial.py_func.__name__, len(k.serial.overloads), len(k.parallel.overloads),
             sum(k.serial.stats.cache_misses.values()) + sum(k.parallel.stats.cache_misses.values()))
            for k in _codec_kernels()]


def test_compile_kernels_loads_what_the_cache_holds_and_compiles_nothing():
    """A fresh process (a rank) after the session's compile: ``compile_kernels()`` loads every codec
    kernel copy from numba's cache, without a cache miss (nothing compiled) and before any call."""
    (loaded,) = values(run_ranks(_load_only, 1))
    assert len(loaded) >= 6
    assert all(serial >= 1 and parallel >= 1 and misses == 0 for _, serial, parallel, misses in loaded), loaded


HOLD = textwrap.dedent("""
    import fcntl, sys, time
    f = open(sys.argv[1], "w")
    fcntl.flock(f, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(120)
""")


def test_a_held_lock_bounds_the_wait_and_a_killed_holder_frees_it(tmp_path, monkeypatch):
    """Another process holds the lock: a wait gives up after its timeout (with a warning) and the
    block runs anyway; once the holder is killed, the OS has dropped its lock and it is taken at
    once. Inside a held lock the process takes it again without waiting (re-entrant)."""
    from lightning_onebit.compress.kernels import compile_once as kcompile

    lock = tmp_path / "compile.lock"
    monkeypatch.setattr(kcompile, "lock_path", lambda: str(lock))
    with started([sys.executable, "-c", HOLD, str(lock)], tmp_path / "holder.log") as holder:
        for _ in range(600):  # 30 s at most
            if (tmp_path / "holder.log").read_text().startswith("held") or holder.poll() is not None:
                break
            time.sleep(0.05)
        assert (tmp_path / "holder.log").read_text().startswith("held"), "the holder did not take the lock"
        with pytest.warns(RuntimeWarning, match="compiling here too"), kcompile.host_lock(timeout=0.2) as got:
            assert got is False
        holder.kill()
        holder.wait(timeout=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kcompile.host_lock(timeout=30) as got, kcompile.host_lock(timeout=0) as again:
            assert got is True and again is True

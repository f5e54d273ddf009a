"""Suite-wide plumbing: one forkserver for every rank the tests start, no process outliving its
test, a time limit on every test and a time budget that keeps the suite fast.

Budgets: a test's setup + call may take ``DEFAULT_BUDGET_S`` seconds, or what its
``@pytest.mark.budget(seconds)`` marker says; one over its budget fails with its duration, so a
test that grows slow is seen on the day it lands rather than when CI runs out of time. Budgets are
about 2-3x what a test takes on the 2-core reference machine, so a slow day does not fail them, and
they stretch by how much slower this machine runs a fixed piece of the suite's kind of work
(:func:`_speed_factor`, at least 1), so a slower machine does not fail a test that only ran at its speed;
``LIGHTNING_ONEBIT_BUDGETS=off`` switches the check off (a profiler run, a debugger)."""

import functools
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (codec_cases, ...)
sys.path.insert(1, str(Path(__file__).parents[1]))  # `recipes` is run from the repository, not installed

from proc_utils import alive, descendants  # noqa: E402

# Every rank the tests start (Lightning fits with start_method="forkserver", dist_utils.run_ranks)
# is forked from one server process that imported these once, instead of a fresh interpreter that
# imports torch and Lightning again (lightning_onebit.strategies.launch says why that is sound).
multiprocessing.forkserver.set_forkserver_preload([
    "torch", "torch.distributed", "lightning.pytorch", "lightning_onebit", "sklearn.datasets", "lit_models",
    "dist_utils", "recipes.runners"])

# The CUDA-simulator tests run in their own interpreter (tests/test_cuda_simulator.py).
collect_ignore = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["cudasim"]

DEFAULT_BUDGET_S = 20.0

REFERENCE_S = 0.188
""":func:`_calibration` on the reference machine (a 2-core Intel Xeon VM with AVX-512). It gave 0.41 s on a
2-core AMD EPYC VM with AVX2, whose whole suite ran 2.18x as long (1974 s against 907 s): 0.41 / 2.18."""


def _calibration() -> float:
    """Seconds of 10 forward and backward passes of a transformer layer on one thread, the best of 3: the
    matmuls and op dispatch most tests spend their time in."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        x = torch.randn(8, 64, 256)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(10):
                layer.zero_grad()
                layer(x).square().mean().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _speed_factor() -> float:
    """How many times longer than the reference machine this one takes (measured once; at least 1)."""
    return max(1.0, _calibration() / REFERENCE_S)


def pytest_configure(config):
    config.addinivalue_line("markers", "budget(seconds): this test's time budget (setup + call), over the default")


def pytest_sessionstart(session):
    """Compile the numba kernels (both paths) before the first test, so that no test's budget pays
    for it: a fresh clone compiles for minutes, later runs load numba's on-disk cache (and parallel
    sessions, pytest-xdist's workers, wait for the first one's compile instead of compiling too)."""
    from lightning_onebit.compress import compile_kernels

    compile_kernels(every=True)


def pytest_report_header(config):
    if os.environ.get("LIGHTNING_ONEBIT_BUDGETS") != "off":
        return f"test budgets x {_speed_factor():.2f} (this machine against the reference machine)"
    return None


def _budget(item) -> float:
    mark = item.get_closest_marker("budget")
    return (float(mark.args[0]) if mark else DEFAULT_BUDGET_S) * _speed_factor()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item._setup_s = time.monotonic()
    try:
        return (yield)
    finally:
        item._setup_s = time.monotonic() - item._setup_s


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    t0 = time.monotonic()
    result = yield
    took = getattr(item, "_setup_s", 0.0) + time.monotonic() - t0
    if os.environ.get("LIGHTNING_ONEBIT_BUDGETS") != "off" and took > _budget(item):
        pytest.fail(f"took {took:.1f} s (setup + call), over its budget of {_budget(item):.0f} s "
                    f"(x {_speed_factor():.2f} for this machine's speed): make it cheaper "
                    "(reuse a fit or the rank pool, a smaller model, fewer steps) or raise its "
                    "@pytest.mark.budget with the reason", pytrace=False)
    return result


def _infrastructure() -> set[int]:
    """The session's own helpers: the forkserver and the resource tracker (and nothing below them)."""
    keep = {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in keep if p}


@pytest.fixture
def fresh_process_group():
    """In-process (devices=1) fits leave a process group behind, and its store keeps listening on
    MASTER_PORT after ``destroy_process_group`` until the trainer that holds it is collected: a
    spawned fit that followed on the same port would fail to bind it ("address already in use") or
    its ranks would read the stale store. Modules that fit in-process use it for every test."""
    import gc

    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # closes the store's socket
    os.environ.clear()
    os.environ.update(saved)


#: MASTER_PORT as the session began (unset, unless the caller set it)
_SESSION_PORT = os.environ.get("MASTER_PORT")


@pytest.fixture(autouse=True)
def _each_test_picks_its_own_port():
    """Lightning's launcher writes the port it picked into MASTER_PORT, and every later fit of the
    process reuses it. A port picked once for the whole session (by a module's fixture, say) can be
    taken meanwhile (as another socket's ephemeral port, by a store still open), so each test's
    first fit picks a free one again."""
    yield
    if os.environ.get("MASTER_PORT") != _SESSION_PORT:
        if _SESSION_PORT is None:
            os.environ.pop("MASTER_PORT", None)
        else:
            os.environ["MASTER_PORT"] = _SESSION_PORT


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """Kill whatever a test left running (ranks below the forkserver included), and say so."""
    yield
    keep = _infrastructure()
    left = [p for p in descendants(os.getpid()) if p not in keep and alive(p)]
    for pid in left:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"processes {left} outlived the test and were killed", pytrace=False)

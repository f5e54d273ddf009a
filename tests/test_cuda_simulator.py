"""Runs tests/cudasim in a child process with numba's CUDA simulator enabled.

The simulator must be switched on before numba.cuda is first imported, which this
process has already done for the CPU kernels, hence the separate interpreter."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from proc_utils import run as proc_run

HERE = Path(__file__).parent


# The simulator runs every CUDA thread as a Python thread under one GIL: two worker processes
# (pytest-xdist, in the dev extra) use both cores while this process only waits.
XDIST = ["-n", "2"] if importlib.util.find_spec("xdist") else []


@pytest.mark.cudasim
@pytest.mark.budget(120)  # the whole simulator suite in a child process (two-rank runs among them), 110-130 s here
def test_cuda_kernels_under_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", LIGHTNING_ONEBIT_BACKEND="")
    proc = proc_run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "cudasim"),
         "--rootdir", str(HERE.parent), *XDIST],
        env=env, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail

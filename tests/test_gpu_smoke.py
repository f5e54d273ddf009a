"""benchmarks/gpu_smoke.py, the first command to run on a GPU, runs its checks under numba's CUDA
simulator here so that it works when a GPU is lent."""

import os
import sys
from pathlib import Path

import pytest

from proc_utils import run as proc_run

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_smoke.py"


@pytest.mark.slow
@pytest.mark.cudasim
@pytest.mark.budget(45)  # a child process running every kernel under the simulator: 29 s on a machine 2.27x as slow
def test_gpu_smoke_checks_pass_under_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    # sizes past one simulated block (8 threads); the simulator pays per launch, not per value
    proc = proc_run([sys.executable, str(SCRIPT), "--cudasim", "--sizes", "0", "13"], timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in ("parity n=0 | ok", "parity n=13 | ok", "update in the decode kernel, n=100 | ok",
                  "layer statistics in one kernel, n=100 | ok", "SimulatedCluster pieces 1 vs 3 | ok",
                  "resume in the compression phase | ok", "NaN step decided on the device | ok",
                  "0 failed check(s)"):
        assert check in proc.stdout, check


def test_gpu_smoke_without_a_gpu_says_so():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = proc_run([sys.executable, str(SCRIPT)], timeout=300, env=env)
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout


FIT = SCRIPT.parent / "gpu_fit.py"


@pytest.mark.slow
@pytest.mark.budget(60)  # one torchrun of 2 ranks: four short fits
def test_gpu_fit_resumes_an_attention_model_bit_for_bit_on_cpu():
    """benchmarks/gpu_fit.py, the Lightning fits a GPU run checks, on CPU: 2 torchrun ranks fit the
    attention model with 1-bit Adam, also with its uint8 warm-up sent from DDP's hook on the sender thread;
    one epoch + save + resume equals the two-epoch fit bit for bit."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = proc_run([sys.executable, str(FIT), "--accelerator", "cpu", "--cases", "onebit_adam 32-true",
                     "onebit_adam uint8-warm-up 32-true", "resume"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in ("| onebit_adam 32-true | ok | replicas identical", "state on ['cpu'], kernels numba",
                  "| onebit_adam uint8-warm-up 32-true | ok | replicas identical",
                  "| resume == uninterrupted | ok |", "0 failed row(s)"):
        assert check in proc.stdout, check

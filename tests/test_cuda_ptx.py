"""The CUDA path without a GPU: every kernel compiles to PTX with its launch signature, the
backend falls back when numba-cuda has no compiler, collectives pick their device by backend."""

import os
import re
import sys
import warnings

import pytest
import torch

from lightning_onebit.compress import kernels

from proc_utils import run


def _nvvm_or_skip():
    why = kernels.cuda_compiler_available()
    if why is not None:
        if os.environ.get("LIGHTNING_ONEBIT_REQUIRE_NVVM") == "1":  # CI installs the cuda13 extra
            pytest.fail(f"NVVM is required here but cannot be loaded: {why}")
        pytest.skip(f"numba-cuda has no NVVM here ({why}); install lightning_onebit[cuda13]")


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="the simulator compiles nothing")
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_every_kernel_compiles_to_ptx(cc):
    _nvvm_or_skip()
    from lightning_onebit.compress.kernels import numba_cuda as kc

    ptx = kc.compile_ptx(cc)
    assert set(ptx) == set(kc.kernel_signatures()) == {
        "_reduce_kernel", "_combine_kernel", "_reduce_scales_kernel", "_encode_kernel", "_decode_kernel",
        "_scaled_step_kernel", "_lamb_stats_kernel", "_lamb_factors_kernel"}
    for name, text in ptx.items():
        assert f".target sm_{cc[0]}{cc[1]}" in text, name
        assert ".visible .entry" in text and name in text, name
    for name in ("_encode_kernel", "_decode_kernel"):  # lo + code * step rounds twice, as on the CPU
        assert "fma.rn.f64" not in ptx[name] and "mul.rn.f64" in ptx[name], name
    # the decode's update (a Sink): t * decay and v * u rounded alone (never contracted), the quotient correctly
    assert "fma.rn.f32" not in ptx["_decode_kernel"] and ptx["_decode_kernel"].count("mul.rn.f32") >= 2
    assert "div.rn.f32" in ptx["_decode_kernel"]
    # 1-bit LAMB's scaled step: p * decay rounded alone, then one fused multiply-add, as the CPU's kernel
    step = ptx["_scaled_step_kernel"]
    assert step.count("fma.rn.f32") == step.count("mul.rn.f32") >= 1 and "add.f32" not in step
    # 1-bit LAMB's moments and layer statistics: every fp32 op an explicitly rounded one (the CPU kernel's fused
    # multiply-adds, d / d_fresh as torch rounds it), none approximated or left for ptxas to contract; the dot
    # products' fp64 products are exact, so contracted they round alike
    stats = ptx["_lamb_stats_kernel"]
    assert all(op in stats for op in ("sqrt.rn.f32", "div.rn.f32", "add.rn.f32", "mul.rn.f32", "fma.rn.f32"))
    assert not re.search(r"\b(add|sub|mul|div|sqrt)\.(f32|approx|full)", stats), "an fp32 op of the compiler's rounding"
    # 1-bit LAMB's layer factors: the fp64 torch ops' roundings, each op rounded alone (no fused multiply-add)
    factors = ptx["_lamb_factors_kernel"]
    assert all(op in factors for op in ("add.rn.f64", "mul.rn.f64", "div.rn.f64", "sqrt.rn.f64"))
    assert not re.search(r"\b(fma|add|sub|mul|div|sqrt)\.(f64|rn\.f32|approx)|\bfma\.rn\.f64", factors)
    # the scales: torch's fp64 quotient and square root, correctly rounded, then one rounding to fp32
    assert "div.rn.f64" in ptx["_reduce_scales_kernel"] and "sqrt.rn.f64" in ptx["_reduce_scales_kernel"]


def _loop_bodies(ptx: str) -> list[list[str]]:
    """The instructions of each loop of a PTX function: from a label to the last branch back to it."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if ln.startswith("$L") and ln.endswith(":")}
    bodies = []
    for label, at in labels.items():
        back = [i for i, ln in enumerate(lines) if i > at and "bra" in ln and ln.endswith(f"{label};")]
        if back:
            bodies.append(lines[at:back[-1] + 1])
    return bodies


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="the simulator compiles nothing")
def test_element_kernels_divide_only_before_their_tile_walk():
    # an integer division by a run-time value is a long instruction sequence on a GPU: the encode and
    # decode kernels find each tile's row by stepping, not by a division per element
    _nvvm_or_skip()
    from lightning_onebit.compress.kernels import numba_cuda as kc

    ptx = kc.compile_ptx((9, 0))
    for name in ("_encode_kernel", "_decode_kernel"):
        assert any(ln.strip().startswith("div.") for ln in ptx[name].splitlines()), name  # the prologue's
        loops = _loop_bodies(ptx[name])
        assert loops, name
        for body in loops:
            divisions = [ln for ln in body if ln.startswith(("div.s", "div.u", "rem."))]
            assert not divisions, (name, divisions)


def test_auto_backend_falls_back_to_torch_without_a_compiler(monkeypatch):
    monkeypatch.setattr(kernels, "cuda_compiler_available", lambda: "NvvmSupportError: libNVVM cannot be found")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels._warn_once.cache_clear()
    cuda = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_backend_name(cuda) == "torch"
        assert kernels.resolve_backend_name(cuda) == "torch"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "libNVVM cannot be found" in msgs[0] and "[cuda13]" in msgs[0]
    assert kernels.resolve_backend_name(torch.device("cpu")) == "numba"  # CPU tensors are not affected
    monkeypatch.setattr(kernels, "cuda_compiler_available", lambda: None)
    assert kernels.resolve_backend_name(cuda) == "cuda"


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="the simulator compiles nothing")
def test_a_numba_cuda_that_cannot_compile_falls_back_with_its_reason(tmp_path):
    """A loadable NVVM is not enough: numba-cuda 0.30 imports ``np.row_stack``, which numpy 2.5 removed,
    when it compiles its first kernel, so every launch raised. A fresh process without ``row_stack`` (as
    numpy 2.5 has it) gets the torch backend with a warning that names the cause and both versions."""
    _nvvm_or_skip()
    code = (
        "import warnings, numpy, torch\n"
        "from lightning_onebit.compress import kernels\n"
        "del numpy.row_stack\n"  # after the imports that star-import numpy, before numba-cuda's first compile
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(kernels.resolve_backend_name(torch.device('cuda', 0)))\n"
        "print('|'.join(str(w.message) for w in caught))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (kernels.ENV_VAR, "NUMBA_ENABLE_CUDASIM")}
    proc = run([sys.executable, "-c", code], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    backend, message = proc.stdout.splitlines()[-2:]
    assert backend == "torch"
    assert "cannot compile its kernels here (AttributeError: module 'numpy' has no attribute 'row_stack'" in message
    assert "numba-cuda 0." in message and "numpy 2." in message


@pytest.mark.parametrize("spec,cpu,cuda", [
    ("gloo", "gloo", "gloo"),
    ("nccl", None, "nccl"),
    ("cuda:nccl", None, "nccl"),
    ("cpu:gloo,cuda:nccl", "gloo", "nccl"),
    ("mpi", "mpi", "mpi"),
])
def test_collectives_pick_their_device_by_backend(monkeypatch, spec, cpu, cuda):
    from lightning_onebit.comm import dense

    monkeypatch.setattr(dense.dist, "get_backend", lambda group=None: spec)
    dev_cpu, dev_cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert dense.backend_for(None, dev_cpu) == cpu and dense.backend_for(None, dev_cuda) == cuda
    assert dense.collective_device(None, dev_cpu) == dev_cpu
    assert dense.collective_device(None, dev_cuda) == (dev_cuda if cuda else dev_cpu)
    assert dense._has_bitwise_or(None, dev_cpu) == (cpu == "gloo")

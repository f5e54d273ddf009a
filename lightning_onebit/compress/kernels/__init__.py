"""Kernel backends behind one dispatch; each is a module with ``reduce``, ``encode`` and ``decode``.

``torch``  :mod:`.torch_reference`: plain-torch reference (any device),
``numba``  :mod:`.numba_cpu`: ``njit(parallel=True)`` kernels for CPU tensors,
``cuda``   :mod:`.numba_cuda`: numba-cuda kernels for CUDA tensors (zero-copy, on torch's current stream).

``auto`` (the default) picks ``cuda`` for CUDA tensors and ``numba`` for CPU tensors. If
numba-cuda cannot compile (no NVVM: ``pip install lightning_onebit[cuda13]``, or ``[cuda12]``, to
match torch's CUDA major version; or a numba-cuda that does not work with the installed numpy),
``auto`` runs CUDA tensors on ``torch`` instead, with one warning that says why. A
backend can be forced per codec (``backend=...``) or process-wide with the environment
variable ``LIGHTNING_ONEBIT_BACKEND``; forcing ``cuda`` on CPU tensors is only meaningful
under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which is how the CUDA kernels
are tested on machines without a GPU.

:func:`compile_kernels` compiles (or loads from numba's cache) the numba CPU kernels once per host
(:mod:`.compile_once`); the strategies call it at setup.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

# importing .threads chooses numba's threading layer before any parallel kernel runs
from .threads import apply_thread_budget, set_thread_budget, thread_budget

__all__ = ["BACKENDS", "ENV_VAR", "apply_thread_budget", "cuda_compiler_available", "get_backend",
           "resolve_backend_name", "set_thread_budget", "thread_budget"]

BACKENDS = ("torch", "numba", "cuda")
ENV_VAR = "LIGHTNING_ONEBIT_BACKEND"

_modules: dict[str, ModuleType] = {}
_MODULE_NAMES = {"torch": "torch_reference", "numba": "numba_cpu", "cuda": "numba_cuda"}


def _load(name: str) -> ModuleType:
    if name not in _modules:
        _modules[name] = importlib.import_module(f"{__name__}.{_MODULE_NAMES[name]}")
    return _modules[name]


def cuda_simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@functools.cache
def cuda_compiler_available() -> str | None:
    """None if numba-cuda can compile kernels here, else why not (checked once per process)."""
    if cuda_simulated():
        return None
    try:
        from numba.cuda.cudadrv import nvvm

        if not nvvm.is_available():
            nvvm.NVVM()  # raises with numba-cuda's own explanation
            return "NVVM is not available"
        _compile_probe()
        return None
    except Exception as exc:  # a missing library, an incompatible version, ...
        return f"{type(exc).__name__}: {exc}".strip() + _versions()


def _compile_probe() -> None:
    """Compile a one-line kernel to PTX: a loadable NVVM is not enough. The first compile also loads
    numba-cuda's target, which fails where numba-cuda and numpy disagree (numba-cuda 0.30 with
    numpy 2.5: ``np.row_stack`` is gone), and then every kernel launch would raise."""
    from numba import cuda, float32

    def probe(a):
        a[0] = 1.0

    cuda.compile_ptx(probe, (float32[:],), cc=(8, 0))  # the oldest target the kernels are tested for


def _versions() -> str:
    try:
        import numba_cuda
        import numpy

        return f" (numba-cuda {getattr(numba_cuda, '__version__', '?')}, numpy {numpy.__version__})"
    except ImportError:
        return ""


def resolve_backend_name(device: torch.device, forced: str | None = None) -> str:
    name = forced or os.environ.get(ENV_VAR, "auto") or "auto"
    if name == "auto":
        if device.type == "cuda":
            why = cuda_compiler_available()
            if why is None:
                return "cuda"
            _warn_once(f"lightning_onebit: numba-cuda cannot compile its kernels here ({why}); CUDA tensors use "
                       "the torch backend (slower, same codes). Install the compiler with "
                       "`pip install lightning_onebit[cuda13]` (or [cuda12], matching torch.version.cuda).")
            return "torch"
        return "numba" if device.type == "cpu" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown compression backend {name!r}; expected 'auto' or one of {BACKENDS}")
    if name == "numba" and device.type != "cpu":
        raise ValueError(f"the numba backend runs on CPU tensors, got a tensor on {device}")
    if name == "cuda" and device.type != "cuda" and not cuda_simulated():
        raise ValueError(
            f"the cuda backend needs CUDA tensors (got {device}); set NUMBA_ENABLE_CUDASIM=1 "
            "before importing numba to run it on CPU tensors under the simulator"
        )
    return name


@functools.cache
def _warn_once(msg: str) -> None:
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


_RESOLVED: dict[tuple, ModuleType] = {}


def get_backend(device: torch.device, forced: str | None = None) -> ModuleType:
    """The backend module for ``device``, resolved once per device, ``forced`` and value of ``ENV_VAR``: a
    codec asks several times per bucket and step (numba's simulator switch is fixed once numba is imported).
    Keyed by the device itself, which hashes faster than its ``type`` is read."""
    key = (device, forced, os.environ.get(ENV_VAR))
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _load(resolve_backend_name(device, forced))
        if len(_RESOLVED) < 64:
            _RESOLVED[key] = hit
    return hit

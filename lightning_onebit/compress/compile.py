"""The numba CPU kernels ready before the first step, each compiled once per host.

:func:`compile_kernels` is what the strategies call at setup (and the test session, with ``every=True``);
the host-wide lock it and every kernel's first call take is :func:`~.kernels.compile_once.host_lock`
(see there). It sits above the kernels because compiling every kernel means running the codecs.
"""

from __future__ import annotations

import torch

from .kernels.compile_once import host_lock

__all__ = ["compile_kernels"]

_done = False  # every kernel compiled (compile_kernels(every=True))
_loaded = False  # the cached kernels loaded (compile_kernels())


def compile_kernels(device: torch.device | str | None = None, *, every: bool = False) -> None:
    """Have the numba CPU kernels ready in this process, each compiled once per host.

    By default it loads, under :func:`host_lock`, every kernel that numba's cache holds for the
    current sources (what earlier runs on this host compiled), and compiles nothing: a kernel that is
    not in the cache compiles on its first call, under the same lock, so a first run compiles only
    what it uses, once per host. ``every=True`` compiles every codec kernel now, both copies (a small
    run of each codec operation on the numba backend, then the parallel copies for the same argument
    types): a first fit would pay for kernels it never calls; the test session does it, so that no
    test's time budget pays for a compile. Idempotent: a later call returns at once (one
    with ``every=True`` after a plain one still compiles). ``device``: where the codecs will run (a
    strategy's root device); nothing is done for a CUDA device, whose tensors use the CUDA kernels."""
    global _done, _loaded
    if _done or (_loaded and not every) or (device is not None and torch.device(device).type != "cpu"):
        return
    with host_lock():
        if every and not _done:
            _warm_up()
            _done = True
        elif not _loaded:
            _load_cached()
        _loaded = True


def _load_cached() -> None:
    """Load every kernel copy numba's cache holds for the current sources, this machine and these
    types (numba's index lists them; an entry for other sources or another CPU is passed over)."""
    from .kernels import numba_cpu  # noqa: F401  (the codec kernels, which the backend imports on its first use)
    from .kernels.threads import parallel_and_serial

    for kernel in parallel_and_serial.instances:
        for copy in (kernel.serial, kernel.parallel):
            try:
                codegen = copy.targetctx.codegen()
                keys = list(copy._cache._cache_file._load_index())  # numba's index: {key: data file}
                for key in keys:
                    sig = key[0]
                    if tuple(sig) not in copy.overloads and copy._cache._index_key(sig, codegen) == key:
                        copy.compile(sig)
            except Exception:  # numba's internals moved, or an unreadable index: the first call compiles it
                continue


def _warm_up() -> None:
    from .codecs import MinMaxCodec, SignCodec
    from .kernels import numba_cpu
    from .kernels.threads import parallel_and_serial
    from .source import Sink, Source

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

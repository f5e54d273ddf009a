"""Counting the host work of a step on the CUDA path, on a CPU: what :mod:`gpu_host_path` measures.

A GPU step is cheap when the host only queues work: every kernel launch, array-interface conversion,
host-to-device copy, device-to-host read, torch call and allocation costs host time (a read also waits
for the device). :class:`HostPathCounter` counts them while the package's ``cuda`` backend runs under
numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is imported), where CPU tensors
stand in for device memory. It counts through public seams only, so that it keeps counting while the
package's host path changes underneath it:

* **kernel launches**: the simulator's kernel object (the class ``numba.cuda.jit`` returns) has its
  launch replaced by a stub that counts, sets the floating-point arrays it is given to one (so the host's
  finiteness checks and updates see finite values, as after a real launch, and a denominator the kernel
  only reads divides nothing by zero) and returns: the
  simulator's Python threads never run. The stubs' own time is left out of the host time.
* **array-interface conversions**: calls of ``numba.cuda.as_cuda_array`` /
  ``from_cuda_array_interface``, and their stand-in under the simulator, ``Tensor.numpy()`` of a step
  tensor whose array reaches a kernel launch (on a GPU ``.numpy()`` of a CUDA tensor raises, so the
  package reaches it only through the simulator's branch of a conversion). A conversion made once
  and kept counts once.
* **device and host tensors**: a :class:`~torch.overrides.TorchFunctionMode` sees every call into
  torch's tensor API and tags the tensors it returns. Host tensors are those made from host data or
  without a ``device=``: ``torch.from_numpy`` (not inside the package's ``flat_buffer``, which takes
  numpy's allocator for large buffers on the CPU and ``torch.zeros(device=)`` on a GPU),
  ``torch.tensor``/``as_tensor`` of a list, scalar or array without ``device=``, a factory without
  ``device=``, ``.cpu()``, and what ops make of host tensors alone. Everything else is on the device:
  tensors made before the counter started (the model), by autograd or by DDP, those given a
  ``device=`` (even the CPU: so with several ranks the buffers the package makes for gloo's
  collectives count as the device's, as NCCL's would), moved with ``.to(device)``, and what ops make
  of a device tensor. Under the simulator both kinds are CPU tensors, so a ``.to(device)`` of a host
  tensor hands back a fresh alias to tag.
* **host-to-device copies**: a host tensor moved to a device (``.to(device)``, ``.cuda()``, a device
  tensor's ``copy_`` from it), ``torch.tensor``/``as_tensor``/``new_tensor`` of host data with a
  device, ``numba.cuda.to_device``, and a host tensor of one element or more handed to an op on
  device tensors (an index, a table: torch copies it). Blocking unless ``non_blocking=True``, which
  is counted apart (pinned memory cannot be had without a GPU).
* **device-to-host reads**: ``bool``, ``int``, ``float``, ``.item()``, ``.tolist()``, ``.cpu()`` of a
  device tensor, and a host tensor's ``copy_`` from one; with ``non_blocking=True`` (into pinned memory
  on a GPU, which waits for nothing) such a copy is counted apart, as a non-blocking one.
  ``.to("cpu")`` cannot be told from ``.to(device)`` when the device is the CPU, so it is not counted.
* **torch ops**: every call into torch's tensor API outside the kernels, metadata queries (shape,
  dtype, device, strides, ``numel``, ``data_ptr``, attributes), ``no_grad`` and the profiler's marks
  and the ``.numpy()`` of a conversion left out; the rows above are among them. Of them, **views and
  no-ops** run no kernel on a GPU: every tensor they return shares an input's storage and they
  write nothing (``view``, ``detach``, basic indexing, ``.float()`` of an fp32 tensor, ...).
* **allocations**: tensors an op returns whose storage none of its inputs has (factories, copies,
  out-of-place results), split into device and host ones.
* **CPU-only branches**: ``Tensor.numpy()`` of a step tensor whose array reaches no kernel: the
  package took a path for CPU tensors there (its numba CPU update, say) that a GPU would not take.
  Other such branches (``device.type == "cpu"`` checks) cannot be seen from outside and run as on a
  CPU, so the counts describe the CUDA backend as it runs on CPU tensors.

Counts accumulate only inside :meth:`HostPathCounter.window` (the optimizer's step, a DDP comm hook's
call: :meth:`HostPathCounter.counting_ddp_hooks`); :meth:`HostPathCounter.take` returns and resets
them. ``sites`` names the package line of each transfer, read and CPU-only branch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["COUNTERS", "HostPathCounter"]

#: what :meth:`HostPathCounter.take` counts, in the order the tables print them
COUNTERS = ("launches", "conversions", "h2d", "h2d_async", "d2h", "d2h_async", "torch_ops", "torch_views",
            "allocations", "host_allocations", "cpu_branches")

# Calls that only read a tensor's metadata (no op on a GPU): not counted. Attribute reads and writes
# (``.shape``, ``.grad``, ``.data``, ...) reach a mode as ``__get__``/``__set__``.
_META = frozenset({
    "__get__", "__set__", "__delete__", "size", "stride", "dim", "ndimension", "numel", "nelement", "is_contiguous",
    "storage_offset", "data_ptr", "element_size", "untyped_storage", "storage", "_typed_storage", "is_floating_point",
    "is_complex", "is_signed", "is_inference", "get_device", "is_pinned", "is_shared", "is_set_to", "has_names",
    "_is_view", "__len__", "__repr__", "__str__", "__format__", "__hash__", "__reduce_ex__", "__deepcopy__",
    "__getstate__", "__setstate__", "__dir__", "__sizeof__", "__dlpack__", "__dlpack_device__", "result_type",
    "can_cast", "promote_types", "is_same_size", "is_tensor", "is_storage",
    # not tensor ops: a device object made, ``no_grad`` and the profiler's marks around Optimizer.step
    "device", "_set_grad_enabled", "_record_function_enter_new", "_record_function_exit._RecordFunction"})
_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "is_nonzero"})
_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})

_PACKAGE = os.sep + "lightning_onebit" + os.sep


def _name(func: Callable) -> str:
    return getattr(func, "__name__", None) or str(func)


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested lists, tuples and dicts of arguments or results)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
        return None


def _site() -> str:
    """``path:line`` of the innermost package frame calling into torch (or numba) now."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        i = path.rfind(_PACKAGE)
        if i >= 0:
            return f"{path[i + 1:]}:{f.f_lineno}"
        f = f.f_back
    return "?"


class _Mode(TorchFunctionMode):
    """The counter's view of torch calls (see the module docstring)."""

    def __init__(self, counter: HostPathCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c._internal:
            return out
        return c._seen(func, _name(func), args, kwargs, out)


class HostPathCounter:
    """Counts the host work of the package's CUDA path (see the module docstring).

    ``stubs()`` stubs the simulator's kernels (and wraps numba's conversion and copy functions),
    ``tracking()`` tags tensors and counts torch calls; counts accumulate inside ``window()``.
    ``tracking()`` should start before the optimizer is made, so that the tables it keeps are tagged
    host or device when they are made; it can be left for timed steps (``stubs()`` alone).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()  # launches by kernel name
        self.ops: Counter[str] = Counter()  # torch ops by name
        self.op_sites: Counter[str] = Counter()  # torch ops by "name at path:line"
        self.sites: Counter[str] = Counter()  # "counter at path:line"
        self.stub_s = 0.0  # thread time spent in the kernel stubs (left out of host times)
        self.hook_s = 0.0  # thread time spent in the comm hooks (see counting_ddp_hooks)
        self._window = 0
        self._internal = 0
        self._tracking = False
        self._host = WeakTensorKeyDictionary()  # tensors on the host (absent: on the device)
        self._fresh: dict[int, np.ndarray] = {}  # arrays of step tensors not yet seen by a launch

    # -- what it counts -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Count what happens inside (windows nest)."""
        self._window += 1
        try:
            yield
        finally:
            self._window -= 1

    def take(self) -> dict[str, Any]:
        """The counts since the last ``take`` (every name of :data:`COUNTERS`, plus ``kernels``, ``ops``,
        ``op_sites`` (the torch ops by name and package line) and ``sites``: Counters by name), and reset
        them. An array of a step tensor that reached no launch counts as a CPU-only branch here."""
        for _ in self._fresh:
            self.counts["cpu_branches"] += 1
        self._fresh.clear()
        out: dict[str, Any] = {k: self.counts.get(k, 0) for k in COUNTERS}
        out.update(kernels=dict(self.kernels), ops=dict(self.ops), op_sites=dict(self.op_sites),
                   sites=dict(self.sites))
        self.counts, self.kernels, self.ops, self.op_sites, self.sites = (Counter(), Counter(), Counter(), Counter(),
                                                                          Counter())
        return out

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host tensor (see the module docstring)."""
        return t in self._host

    def _count(self, what: str, n: int = 1, site: bool = False) -> None:
        if self._window and n:
            self.counts[what] += n
            if site:
                self.sites[f"{what} at {_site()}"] += n

    def _tag(self, t: torch.Tensor, host: bool) -> None:
        if host:
            self._host[t] = True
        else:
            self._host.pop(t, None)

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor object on ``t``'s storage: the simulator's stand-in for a copy on another device."""
        self._internal += 1
        try:
            return t.view_as(t)
        finally:
            self._internal -= 1

    def _seen(self, func: Callable, name: str, args: tuple, kwargs: dict, out: Any) -> Any:
        """Count one torch call and tag what it returned."""
        if name in _META:
            if name == "__get__" and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) \
                    and out is not args[0] and self.is_host(args[0]):
                self._tag(out, True)  # .data, .T, .mT of a host tensor
            return out
        ins = _tensors(args, [])
        _tensors(kwargs, ins)
        host_in = [self.is_host(t) for t in ins]
        if name == "numpy":
            if ins and not host_in[0] and self._window:
                self._fresh[id(out)] = out  # a conversion if a launch takes it, else a CPU-only branch
                self.sites[f"numpy at {_site()}"] += 1
            return out
        self._count("torch_ops")
        if self._window:
            self.ops[name] += 1
            self.op_sites[f"{name} at {_site()}"] += 1
        device_kw = kwargs.get("device")
        new_host: bool | None = None  # how to tag new result tensors (None: by the inputs)
        if name in _READS:
            if ins and not host_in[0]:
                self._count("d2h", site=True)
        elif name == "cpu":
            if not host_in[0]:
                self._count("d2h", site=True)
                if out is args[0]:
                    out = self._alias(out)
            new_host = True
        elif name in ("to", "cuda"):
            if name == "cuda":
                to_device, non_blocking = True, bool(kwargs.get("non_blocking", False))
            else:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                to_device = device is not None
            if to_device and host_in[0]:
                self._count("h2d_async" if non_blocking else "h2d", site=True)
                if out is args[0]:
                    out = self._alias(out)
                new_host = False
        elif name == "copy_":
            dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if isinstance(src, torch.Tensor):
                if self.is_host(src) and not self.is_host(dst):
                    self._count("h2d_async" if non_blocking else "h2d", site=True)
                elif self.is_host(dst) and not self.is_host(src):  # into pinned memory a copy waits for nothing
                    self._count("d2h_async" if non_blocking else "d2h", site=True)
        elif name in _FROM_DATA:
            data = args[0] if args else kwargs.get("data")
            if name == "new_tensor":  # a method: the data follow self, on self's device unless told
                data = args[1] if len(args) > 1 else kwargs.get("data")
                if device_kw is None and not self.is_host(args[0]):
                    device_kw = args[0].device
            if isinstance(data, torch.Tensor):  # as_tensor(t, device=): a move if t is a host tensor
                if device_kw is not None and self.is_host(data):
                    self._count("h2d", site=True)
                    if out is data:
                        out = self._alias(out)
                new_host = self.is_host(data) if device_kw is None else False
            else:  # host data (a list, a scalar, an array)
                if device_kw is not None:
                    self._count("h2d", site=True)
                new_host = device_kw is None
        else:
            if any(not h for h in host_in):
                # a host tensor with elements handed to an op on device tensors: torch copies it over
                moved = sum(1 for t, h in zip(ins, host_in, strict=True) if h and t.dim() > 0)
                self._count("h2d", moved, site=True)
        if new_host is None:
            new_host = (all(host_in) and device_kw is None) if ins else device_kw is None
        fresh, outs = self._allocated(ins, out, new_host)
        if (outs and not fresh and not (name.endswith("_") and not name.endswith("__")) and "out" not in kwargs
                and name not in _READS and name not in ("copy_", "to", "cpu", "cuda")):
            self._count("torch_views")  # a view of its input, or the input itself: no kernel on a GPU
        return out

    def _allocated(self, ins: list[torch.Tensor], out: Any, host: bool) -> tuple[int, int]:
        """Tag the new tensors in ``out`` and count those on storage of their own as allocations; returns
        (how many those were, how many tensors ``out`` holds)."""
        outs = _tensors(out, [])
        known = {id(t) for t in ins}
        storages = {_storage(t) for t in ins}
        fresh = 0
        for t in outs:
            if id(t) in known:
                continue  # in place, or handed back: keeps its tag
            self._tag(t, host)
            if _storage(t) not in storages:
                fresh += 1
                self._count("host_allocations" if host else "allocations")
        return fresh, len(outs)

    # -- the seams ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Tag tensors and count torch calls inside: a TorchFunctionMode, and ``torch.tensor``,
        ``as_tensor``, ``asarray`` and ``from_numpy`` wrapped (a mode does not see them)."""
        from lightning_onebit.compress import flat_buffer

        buffer_code = getattr(flat_buffer, "__code__", None)
        real = {name: getattr(torch, name) for name in (*_FROM_DATA - {"new_tensor"}, "from_numpy")}

        def wrapped(name: str, f: Callable) -> Callable:
            @functools.wraps(f)
            def call(*args, **kwargs):
                self._internal += 1
                try:
                    out = f(*args, **kwargs)
                finally:
                    self._internal -= 1
                if name != "from_numpy":
                    return self._seen(f, name, args, kwargs, out)
                # host data, but for the package's buffers: numpy's allocator on the CPU, torch.zeros on a GPU
                device_buffer = sys._getframe(1).f_code is buffer_code
                self._tag(out, not device_buffer)
                self._count("torch_ops")
                if self._window:
                    self.ops[name] += 1
                self._count("allocations" if device_buffer else "host_allocations")
                return out
            return call

        for name, f in real.items():
            setattr(torch, name, wrapped(name, f))
        self._tracking = True
        try:
            with _Mode(self):
                yield
        finally:
            self._tracking = False
            for name, f in real.items():
                setattr(torch, name, f)

    def _mode_again(self) -> contextlib.AbstractContextManager:
        """The mode inside a callback of autograd's engine (a comm hook), which runs without the caller's
        function modes: one more only if none of this counter's is on the stack."""
        stack = torch.overrides._get_current_function_mode_stack()
        if self._tracking and not any(isinstance(m, _Mode) and m.counter is self for m in stack):
            return _Mode(self)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def stubs(self) -> Iterator[None]:
        """Inside, the simulator's kernels only count their launches (see the module docstring);
        numba's conversions and host-to-device copies are counted. Needs ``NUMBA_ENABLE_CUDASIM=1``."""
        from numba import config as numba_config
        from numba import cuda

        if not numba_config.ENABLE_CUDASIM:
            raise RuntimeError("the kernel stubs need numba's CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 before "
                               "numba is imported")
        kernel_type = type(cuda.jit(lambda a: None))  # the simulator's kernel object
        real_call = kernel_type.__call__

        def launch(kernel, *args):
            if getattr(kernel, "_device", False):  # a device function: only ever called inside a kernel
                return real_call(kernel, *args)
            t0 = time.thread_time()
            if self._window:
                self.counts["launches"] += 1
                self.kernels[getattr(kernel, "__name__", "?")] += 1
            for a in args:
                if isinstance(a, np.ndarray):
                    self._claim(a)
                    if a.dtype.kind == "f" and a.size:
                        # what the kernel writes, finite; one, not zero: the arrays it only reads get it too,
                        # a denominator among them (the decode's sink), which later torch ops divide by
                        a.fill(1)
            self.stub_s += time.thread_time() - t0

        patched: list[tuple[Any, str, Any]] = [(kernel_type, "__call__", real_call)]
        kernel_type.__call__ = launch
        for name, what in (("as_cuda_array", "conversions"), ("from_cuda_array_interface", "conversions"),
                           ("to_device", "h2d")):
            real = getattr(cuda, name, None)
            if real is None:
                continue
            patched.append((cuda, name, real))
            setattr(cuda, name, self._counted(real, what))
        # the package's conversion (a kernel array described once per memory and geometry): each call one
        # conversion, whatever it does inside (on a GPU from_cuda_array_interface, here a .numpy())
        from lightning_onebit.compress.kernels import numba_cuda_source as source

        patched.append((source, "_describe", source._describe))
        source._describe = self._counted(source._describe, "conversions", internal=True)
        try:
            yield
        finally:
            for owner, name, real in patched:
                setattr(owner, name, real)

    def _counted(self, f: Callable, what: str, internal: bool = False) -> Callable:
        """``f`` counted as one ``what`` per call (``internal``: the torch calls inside it not counted)."""
        @functools.wraps(f)
        def call(*a, **k):
            self._count(what, site=True)
            self._internal += internal
            try:
                return f(*a, **k)
            finally:
                self._internal -= internal
        return call

    def _claim(self, a: np.ndarray) -> None:
        """A launch takes ``a``: if it (or the array it views) is a step tensor's fresh ``.numpy()``, that
        was a conversion."""
        while a is not None:
            if self._fresh.pop(id(a), None) is not None:
                self._count("conversions")
                return
            a = a.base if isinstance(a.base, np.ndarray) else None

    @contextlib.contextmanager
    def counting_ddp_hooks(self) -> Iterator[None]:
        """Comm hooks registered inside count their calls (a window each) and add their thread time to
        ``hook_s``: DDP's ``register_comm_hook`` wraps the hook it is given."""
        ddp = torch.nn.parallel.DistributedDataParallel
        real = ddp.register_comm_hook

        def register(model, state, hook):
            @functools.wraps(hook)  # DDP reads the hook's signature
            def counted(state, bucket):
                t0 = time.thread_time()
                try:
                    with self.window(), self._mode_again():
                        return hook(state, bucket)
                finally:
                    self.hook_s += time.thread_time() - t0

            return real(model, state, counted)

        ddp.register_comm_hook = register
        try:
            yield
        finally:
            ddp.register_comm_hook = real

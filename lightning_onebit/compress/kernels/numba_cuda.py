"""Numba-CUDA backend: kernels on CUDA tensors, zero-copy, on torch's current stream.

The kernels are in :mod:`.numba_cuda_kernels` (one element per thread, the layout's summation
order for the scales, so they give the numba CPU backend's bits) and read a payload
:class:`~..source.Source` in place (:mod:`.numba_cuda_source`); this module launches them on
torch's tensors (the device's context and current stream, the layout's arrays cached on the
device) and compiles them ahead of time to PTX for the checks (:func:`compile_ptx`). Under
numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) CPU tensors stand in for device memory.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ..source import Source
from .layout import FORMATS, REDUCE_TILE, Layout, code_bytes_padded
from .numba_cuda_factors import _lamb_factors_kernel as _lamb_factors_kernel  # compile_ptx finds them here
from .numba_cuda_factors import lamb_factors  # 1-bit LAMB's factors, statistics and step
from .numba_cuda_kernels import LANES as LANES  # the kernels moved there; their constants stay importable
from .numba_cuda_kernels import (
    RTHREADS,
    THREADS,
    _combine_kernel,
    _decode_kernel,
    _encode_kernel,
    _reduce_kernel,
    _reduce_scales_kernel,
)
from .numba_cuda_launch import _grid, _launcher, _on, _stream, planned
from .numba_cuda_sink import fusable, sink_args, sink_numbers
from .numba_cuda_source import ROWS_MEAN, SIMULATED, accepts, empty_arrays, empty_tensors, go_array, kernel_input, memo
from .numba_cuda_source import arr as _arr
from .numba_cuda_update import _lamb_stats_kernel as _lamb_stats_kernel
from .numba_cuda_update import _scaled_step_kernel as _scaled_step_kernel
from .numba_cuda_update import lamb_stats, scaled_step

#: ``reduce``/``encode`` evaluate a :class:`~..source.Source` in place (see :func:`accepts`)
FUSES_SOURCES = True
#: a server's mean is a :class:`RowsMean` for any number of rows: it is decoded once (by the reduction)
ROWS_MEAN_MAX = None


# --- torch-facing wrappers ------------------------------------------------------------


def _codes_arr(codes: torch.Tensor):
    """Codes rows that are views into a packed ``[codes | scales]`` buffer, widened to the full
    row stride: the simulator only takes contiguous arrays, and the kernels never index past
    the code bytes of a row. Made once per memory and geometry, like :func:`arr`'s arrays."""
    def make():
        if codes.dim() == 2 and not codes.is_contiguous() and codes.stride(1) == 1:
            return _arr(torch.as_strided(codes, (codes.shape[0], codes.stride(0)), (codes.stride(0), 1)))
        return _arr(codes)

    return memo(_CODES, (codes.data_ptr(), codes.shape, codes.stride(), codes.device), make)


_CODES: dict[tuple, object] = {}


def _state(st, device):
    """The state as a kernel array (empty without one)."""
    return empty_arrays(device)[0] if st is None else _arr(st)


def accepts_sink(sink) -> bool:
    """Whether ``decode`` applies ``sink``, predicated or not (:func:`.numba_cuda_sink.fusable`)."""
    return fusable(sink, sink.denom.device)


def _tiles(layout: Layout, device: torch.device) -> tuple:
    """(tile rows, tile starts, tile ends, each block's first tile) of the reduction, on the device."""
    return layout.device_arrays("tiles", device, lambda: layout.reduce_tiles(REDUCE_TILE))


def _layout_arrays(layout: Layout, what: str, device: torch.device, make) -> tuple:
    """A layout's device tables (:meth:`~.layout.Layout.device_arrays`) as kernel arrays, made once per
    layout, table and device: the tensors they describe live as long as the layout."""
    cache = layout.__dict__.setdefault("_kernel_arrays", {})
    hit = cache.get((what, device))
    if hit is None:
        hit = cache[(what, device)] = tuple(_arr(t) for t in layout.device_arrays(what, device, make))
    return hit


class RowsMean:
    """The server stage's input: the mean over the rows of ``messages`` (an Encoded whose rows are cut
    alike). :func:`reduce_to_scales` decodes it while it reduces and writes it into ``out`` (its tiles
    cover every element), and :func:`encode`, next on the stream, reads it from there: one launch less
    than decoding it first, the same bits (the decode kernel's expression, element by element)."""

    def __init__(self, messages, out: torch.Tensor | None = None) -> None:
        self.messages = messages
        self.device = messages.codes.device
        n = messages.seg_len
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=self.device)
        elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < n or out.device != self.device:
            raise ValueError(f"RowsMean: out must be a contiguous fp32 buffer of >= {n} elements on {self.device}")
        self.out = out if out.dim() == 1 and out.numel() == n else out.reshape(-1)[:n]

    def numel(self) -> int:
        return self.messages.seg_len

    def rows(self) -> tuple:
        """(codes, scales, scales' first column, block starts, data ends) as the kernels take them."""
        m = self.messages
        scales, col0, copy = _scales_in(m.kind, m.codes.shape[0], m.seg_len, m.scales)
        self._copy = copy  # held until the launch
        return (_codes_arr(m.codes), scales, col0, *_starts(m.layout, self.device))


_NO_ROWS: dict[str, tuple] = {}


def _no_rows(device: torch.device) -> tuple:
    """The rows arguments of a reduction whose input is not a :class:`RowsMean`: empty, once per device."""
    key = str(device)
    if key not in _NO_ROWS:
        u8 = torch.empty(0, 0, dtype=torch.uint8, device=device)
        f32 = torch.empty(0, 0, dtype=torch.float32, device=device)
        i64 = torch.empty(0, 0, dtype=torch.int64, device=device)
        _NO_ROWS[key] = (u8, f32, i64, (_arr(u8), _arr(f32), 0, _arr(i64), _arr(empty_tensors(device)[1])))
    return _NO_ROWS[key][3]


def _reduce_input(x, st, device: torch.device) -> tuple:
    """The reduction kernels' input arguments (see ``_tile_partial``): a tensor's or a Source's, or a
    :class:`RowsMean`'s (op ``ROWS_MEAN``, its ``out`` in the input's place), then the state and the rows."""
    if isinstance(x, RowsMean):
        f32, i64, _ = empty_arrays(device)
        inp = (ROWS_MEAN, _arr(x.out), f32, i64, np.float32(0.0), f32, i64, False, x.numel(), 0)
        return (*inp, _state(st, device), *x.rows())
    return (*kernel_input(x, device), _state(st, device), *_no_rows(device))


def _launch_reduce(kind, mode, layout: Layout, x, st, tiles: tuple, partials: torch.Tensor, stream) -> None:
    """The first pass of the reduction: one partial per tile, into ``partials``."""
    t_row, t_lo, t_hi, _ = tiles
    if t_row.numel():
        _launcher(_reduce_kernel, _grid(t_row.numel(), 1), RTHREADS, stream)(
            kind, mode, *_reduce_input(x, st, x.device), layout.seg_len, _arr(t_row), _arr(t_lo), _arr(t_hi),
            _arr(partials))


def reduce(kind, mode, layout: Layout, x, st) -> torch.Tensor:
    device = x.device
    with _on(device):
        tiles = _tiles(layout, device)
        width = FORMATS[kind].totals
        partials = torch.empty(tiles[0].numel(), width, dtype=torch.float64, device=device)
        totals = torch.empty(layout.nblocks, width, dtype=torch.float64, device=device)
        stream = _stream(device)
        _launch_reduce(kind, mode, layout, x, st, tiles, partials, stream)
        if layout.nblocks:
            _launcher(_combine_kernel, _grid(layout.nblocks, THREADS), THREADS, stream)(
                kind, _arr(tiles[3]), _arr(partials), _arr(totals))
        return totals


def reduce_to_scales(kind, mode, layout: Layout, x, st, scales: torch.Tensor,
                     ok: torch.Tensor | None = None) -> torch.Tensor:
    """``reduce`` and the scales of its totals (``Codec._scales_unchecked``) in one launch
    (``_reduce_scales_kernel``): the scales written into ``scales`` (the message's, a view into its
    packed row), and returned: ``ok``, a 0-d bool tensor on the device, False when the input was not
    finite (nothing waits for it). Written into ``ok`` (one bool element) where given, else into this
    layout's flag, valid until the next call on the layout in this thread. Its arguments are planned once
    per layout and call (:mod:`.numba_cuda_launch`); a :class:`~..source.Source`'s are its expression's."""
    device = x.device
    if ok is not None and ok.dim() != 1:
        raise ValueError("reduce_to_scales: ok must be a one-element 1-d bool tensor")
    with _on(device):
        stream = _stream(device)
        if not layout.nblocks:  # nothing to reduce: finite
            _, _, flag, flag0, _ = _scratch(kind, layout, device, _tiles(layout, device)[0].numel(), stream)
            (flag if ok is None else ok).fill_(True)
            return flag0 if ok is None else ok
        src = kernel_input(x, device) if isinstance(x, Source) else ()
        held = (x.out, x.messages.codes, x.messages.scales) if isinstance(x, RowsMean) else (() if src else (x,))
        plan = planned(layout, ("reduce_to_scales", kind, mode, id(stream), threading.get_ident(), len(src)),
                       (*held, st, scales, ok),
                       lambda: _plan_reduce_to_scales(kind, mode, layout, x, st, scales, ok, device, stream, src))
        if plan is None:  # scales the kernel cannot write in place: made for this launch, then copied
            plan = _plan_reduce_to_scales(kind, mode, layout, x, st, scales, ok, device, stream, src, keep=False)
        launch, head, tail, flag0, copy = plan
        launch(*head, *src, *tail)
        if copy is not None:
            scales.copy_(copy.view(scales.shape))
        return flag0 if ok is None else ok


def _plan_reduce_to_scales(kind, mode, layout: Layout, x, st, scales, ok, device, stream, src: tuple,
                           keep: bool = True) -> tuple | None:
    """(launcher, the arguments before the input's, after it, the layout's flag 0-d, a copy of the scales or
    None), or None where scales are copied for this launch alone (``keep=False``: made anyway). The input's
    arguments are in the first where it is not a Source's, whose arguments the caller gives. It holds no
    tensor of the caller's: kernel arrays own no memory."""
    tiles = _tiles(layout, device)
    partials, totals, flag, flag0, count = _scratch(kind, layout, device, tiles[0].numel(), stream)
    target, col0, copy = _scales_in(kind, layout.nseg, layout.seg_len, scales)
    tile_args = _layout_arrays(layout, "tiles", device, lambda: layout.reduce_tiles(REDUCE_TILE))
    (lens,) = _layout_arrays(layout, "scale_lengths_i64", device, lambda: (layout.scale_lengths.reshape(-1),))
    inp = _reduce_input(x, st, device)
    if keep and (copy is not None or getattr(x, "_copy", None) is not None):  # a RowsMean's scales, copied
        return None
    tail = (*inp[10:], layout.seg_len, *tile_args, _arr(partials), _arr(totals), lens, layout.blocks_per_seg,
            target, col0, _arr(count), _arr(flag if ok is None else ok))
    head, tail = ((kind, mode), tail) if src else ((kind, mode, *inp[:10], *tail), ())
    launch = _launcher(_reduce_scales_kernel, _grid(max(tiles[0].numel(), layout.nblocks), 1), RTHREADS, stream)
    return launch, head, tail, flag0, copy


def _scratch(kind, layout: Layout, device: torch.device, tiles: int, stream) -> tuple[torch.Tensor, ...]:
    """(partials, totals, flag, the flag 0-d, the counters) of :func:`reduce_to_scales`, made once per
    layout, device, stream and thread (the counters zeroed once: each launch zeroes what it counted).
    Each call's kernel is done with them before the next call's runs (one stream orders them); a thread
    of its own (a sender) or another stream gets its own. ``stream``: :func:`_stream`'s, kept alive
    there, so its id names it."""
    width = FORMATS[kind].totals
    cache = layout.__dict__.setdefault("_scratch", {})
    key = (width, str(device), id(stream), threading.get_ident())
    bufs = cache.get(key)
    if bufs is None:
        flag = torch.empty(1, dtype=torch.bool, device=device)
        bufs = cache[key] = (torch.empty(tiles, width, dtype=torch.float64, device=device),
                             torch.empty(layout.nblocks, width, dtype=torch.float64, device=device),
                             flag, flag.view(()), torch.zeros(layout.nblocks + 2, dtype=torch.int32, device=device))
    return bufs


def _scale_rows(kind, nrows: int, seg_len: int, scales: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``scales`` (``nrows`` rows of ``seg_len`` elements) as the kernels read and write them: (a contiguous
    fp32 [nrows, row] tensor, the column of row r's first scale). The scales alone, or, for the views into
    a packed ``[codes | pad | scales]`` buffer (:meth:`~..base.Codec.empty`), its whole rows as fp32 (the
    kernels never touch the codes' columns through it; the simulator takes only contiguous arrays), so
    nothing is copied. ``(None, 0)`` for any other layout of them."""
    if scales.is_contiguous():
        return scales.view(nrows, -1), 0
    col0 = code_bytes_padded(kind, seg_len) // 4
    stride = scales.stride(0)
    base = scales.storage_offset() - col0
    if (scales.dim() >= 2 and base >= 0 and stride >= col0 + scales[0].numel()
            and scales[0].is_contiguous() and base + nrows * stride <= scales.untyped_storage().nbytes() // 4):
        return torch.as_strided(scales, (nrows, stride), (stride, 1), base), col0
    return None, 0


_SCALE_ARGS: dict[tuple, tuple] = {}


def _scales_in(kind, nrows: int, seg_len: int, scales: torch.Tensor) -> tuple[object, int, torch.Tensor | None]:
    """The scales as the encode and decode kernels read them (:func:`_scale_rows`): (kernel array, first
    column, a copy the caller holds until the launch or None). The array is made once per memory and
    geometry, like :func:`arr`'s; a copy only for a layout of them it cannot widen."""
    key = (scales.data_ptr(), scales.shape, scales.stride(), kind, nrows, seg_len, scales.device)
    hit = _SCALE_ARGS.get(key)
    if hit is not None:
        return (*hit, None)
    rows, col0 = _scale_rows(kind, nrows, seg_len, scales)
    if rows is None:
        copy = scales.reshape(nrows, -1).contiguous()
        return _arr(copy), 0, copy
    return (*memo(_SCALE_ARGS, key, lambda: (_arr(rows), col0)), None)


def _starts(layout: Layout, device: torch.device):
    """(block starts, data ends) of the layout's rows as device arrays."""
    return _layout_arrays(layout, "starts", device, lambda: (layout.starts, layout.data_ends))


#: ``encode`` and ``decode`` take ``go`` (see :meth:`~..base.Codec.decode_predicated`)
PREDICATES = True


def encode(kind, mode, layout: Layout, x, st, scales, codes, go: torch.Tensor | None = None) -> None:
    """Planned like :func:`reduce_to_scales`."""
    device = codes.device
    if isinstance(x, RowsMean):
        x = x.out  # written by the reduction launched before this
    with _on(device):
        stream = _stream(device)
        src = kernel_input(x, device) if isinstance(x, Source) else ()
        plan = planned(layout, ("encode", kind, mode, id(stream), len(src)), (*(() if src else (x,)), st, scales, codes,
                                                                            go),
                       lambda: _plan_encode(kind, mode, layout, x, st, scales, codes, go, device, stream, src))
        if plan is None:  # scales the kernel cannot read in place: a copy for this launch
            plan = _plan_encode(kind, mode, layout, x, st, scales, codes, go, device, stream, src, keep=False)
        launch, head, tail, _copy = plan  # _copy: held until the launch
        launch(*head, *src, *tail)


def _plan_encode(kind, mode, layout: Layout, x, st, scales, codes, go, device, stream, src: tuple,
                 keep: bool = True) -> tuple | None:
    """(launcher, the arguments before the input's, after it, a copy of the scales or None), or None where the
    scales are copied for this launch (``keep=False``: made anyway)."""
    rows, col0, copy = _scales_in(kind, layout.nseg, layout.seg_len, scales)
    if copy is not None and keep:
        return None
    launch = _launcher(_encode_kernel, _grid(layout.nseg * -(-layout.seg_len // THREADS), 1), THREADS, stream)
    tail = (_state(st, device), layout.seg_len, *_starts(layout, device), rows, col0, _codes_arr(codes),
            go_array(go, device))
    head, tail = ((kind, mode), tail) if src else ((kind, mode, *kernel_input(x, device), *tail), ())
    return launch, head, tail, copy


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False, *,
           go: torch.Tensor | None = None, and_go: torch.Tensor | None = None,
           copy: torch.Tensor | None = None, flags: torch.Tensor | None = None, decay: float = 1.0,
           decay_out: torch.Tensor | None = None, sink=None) -> None:
    """``sink``: a :class:`~..source.Sink` the kernel applies where it writes (:func:`accepts_sink`), on a
    decode of a whole result (predicated by ``go`` or not). Planned like :func:`reduce_to_scales`: the
    step's numbers (``decay``, the sink's value and decay) are this call's."""
    device = codes.device
    if sink is not None and not fusable(sink, device):
        raise ValueError("decode applies a sink only to a whole result with one step size (see accepts_sink)")
    with _on(device):
        stream = _stream(device)
        held = (codes, scales, out, go, and_go, copy, flags, decay_out)
        if sink is not None:
            held = (*held, sink.denom, sink.mask, *sink.targets)
        key = ("decode", kind, accumulate, mean_rows, id(stream), sink is not None and (sink.groups, sink.valid))
        plan = planned(layout, key, held, lambda: _plan_decode(kind, layout, codes, scales, out, accumulate, mean_rows,
                                                               go, and_go, copy, flags, decay_out, sink, device,
                                                               stream))
        if plan is None:
            plan = _plan_decode(kind, layout, codes, scales, out, accumulate, mean_rows, go, and_go, copy, flags,
                                decay_out, sink, device, stream, keep=False)
        launch, head, mid, tail, _copy = plan  # _copy: held until the launch
        value, sink_decay = sink_numbers(sink)
        launch(*head, np.float64(decay), *mid, np.float32(value), np.float32(sink_decay), *tail)


def _plan_decode(kind, layout: Layout, codes, scales, out, accumulate, mean_rows, go, and_go, copy, flags, decay_out,
                 sink, device, stream, keep: bool = True) -> tuple | None:
    """(launcher, the arguments before ``decay``, between it and the sink's numbers, after them, a copy of the
    scales or None), or None where the scales are copied for this launch (``keep=False``: made anyway)."""
    rows, col0, scales_copy = _scales_in(kind, codes.shape[0], layout.seg_len, scales)
    if scales_copy is not None and keep:
        return None
    tiles = (1 if mean_rows else layout.nseg) * -(-layout.seg_len // THREADS)
    f32, i64, b1 = empty_arrays(device)
    head = (kind, _codes_arr(codes), rows, col0, layout.seg_len, *_starts(layout, device), _arr(out), accumulate,
            mean_rows, go_array(go, device), go_array(and_go, device), f32 if copy is None else _arr(copy),
            b1 if flags is None else _arr(flags))
    addr, bounds, _, _, denom, mask, valid = sink_args(sink, device)
    return (_launcher(_decode_kernel, _grid(tiles, 1), THREADS, stream), head,
            (f32 if decay_out is None else _arr(decay_out), addr, bounds), (denom, mask, valid), scales_copy)


# --- ahead-of-time checks ------------------------------------------------------------------


def kernel_signatures() -> dict[str, tuple]:
    """Argument types each kernel is launched with by the wrappers above (numba types):
    ``kind``/``mode``/lengths are Python ints, the arrays contiguous views of torch tensors."""
    from numba import types as nt

    i64, flag = nt.int64, nt.boolean
    f32v, i64v = nt.Array(nt.float32, 1, "C"), nt.Array(nt.int64, 1, "C")
    f32m, f64m = nt.Array(nt.float32, 2, "C"), nt.Array(nt.float64, 2, "C")
    i64m, u8m = nt.Array(nt.int64, 2, "C"), nt.Array(nt.uint8, 2, "C")
    # the input (_input): op, x, end, bounds, w, factors, mask, nonfinite, valid, offset
    src = (i64, f32v, f32v, i64v, nt.float32, f32v, i64v, flag, i64, i64)
    b1, i32v = nt.Array(nt.boolean, 1, "C"), nt.Array(nt.int32, 1, "C")
    rows = (u8m, f32m, i64, i64m, i64v)  # a RowsMean input's codes, scales, first column, starts, ends
    return {
        "_reduce_kernel": (i64, i64, *src, f32v, *rows, i64, i64v, i64v, i64v, f64m),
        "_combine_kernel": (i64, i64v, f64m, f64m),
        "_reduce_scales_kernel": (i64, i64, *src, f32v, *rows, i64, i64v, i64v, i64v, i64v, f64m, f64m, i64v, i64, f32m,
                                  i64, i32v, b1),
        "_encode_kernel": (i64, i64, *src, f32v, i64, i64m, i64v, f32m, i64, u8m, b1),
        "_decode_kernel": (i64, u8m, f32m, i64, i64, i64m, i64v, f32v, flag, flag, b1, b1, f32v, b1, nt.float64,
                           f32v, i64v, i64v, nt.float32, nt.float32, f32v, i64v, i64),
        "_scaled_step_kernel": (i64v, i64v, f32v, f32v, f32v, b1, i64),
        "_lamb_stats_kernel": (i64v, i64v, f32v, f32v, f32v, f32v, f32v, i64v, f32v, f32v, flag, b1, nt.float32,
                               nt.float32, nt.float32, nt.float32, flag, nt.float32, flag, flag, i64v, i64v, i64v, f64m,
                               i32v, f32m, i64),
        "_lamb_factors_kernel": (f32m, nt.Array(nt.float64, 1, "C"), nt.Array(nt.float64, 1, "C"), f32v, f32v, b1,
                                 i64v, *(nt.float64,) * 8, flag),
    }


def compile_ptx(cc: tuple[int, int] = (8, 0)) -> dict[str, str]:
    """Compile every kernel for compute capability ``cc`` with its launch signature; returns
    {kernel name: PTX}. Needs numba-cuda's NVVM (the ``cuda12``/``cuda13`` extra), not a GPU,
    so typing and NVVM errors show before the first GPU run. Not under the simulator."""
    if SIMULATED:
        raise RuntimeError("compile_ptx needs the real numba-cuda target; unset NUMBA_ENABLE_CUDASIM")
    from numba.cuda import compile_ptx as _compile

    out = {}
    for name, sig in kernel_signatures().items():
        ptx, _ = _compile(globals()[name].py_func, sig, cc=cc)
        out[name] = ptx
    return out


__all__ = ["FUSES_SOURCES", "PREDICATES", "ROWS_MEAN_MAX", "RowsMean", "accepts", "accepts_sink", "compile_ptx",
           "decode", "encode", "kernel_signatures", "lamb_factors", "lamb_stats", "reduce", "reduce_to_scales",
           "scaled_step"]

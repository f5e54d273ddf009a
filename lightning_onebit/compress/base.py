"""The codec base class: geometry, dispatch to a kernel backend, scales and the fused operations.

A codec turns an fp32/fp16/bf16 vector into an :class:`Encoded` message (packed codes + fp32
scales) and back; the concrete codecs (:mod:`.codecs`: 1-bit sign, min-max quantisation) only say
which kind of codes they write (a row of :data:`~.kernels.layout.FORMATS`). Besides plain
``encode``/``decode`` it offers the fused operations the compressed collectives are built from:

* ``encode_error_feedback(x, error)``: v = x + error; codes = C(v); error <- v - D(C(v))
* ``encode_markov(target, estimate)``: c = C(target - estimate); estimate <- estimate + D(c)
* ``server_step(messages, error)``:   y = mean of the decoded rows (+ error); re-encode y;
  error <- y - D(C(y))

Every operation is two passes over memory: a reduction that produces the block scales,
then the encode pass that writes codes and state. The reduction ends in a finiteness check
*before* any state is written, so a NaN/inf input raises ``ValueError`` and leaves error
and estimate buffers exactly as they were. (A single fused pass is possible only by
giving up that guarantee, because the scale of a block is known only after reading it.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .encoded import Encoded
from .kernels import BACKENDS, get_backend
from .kernels.layout import (
    DIFF,
    ERROR_FEEDBACK,
    MARKOV,
    PLAIN,
    SIGN_L2,
    Layout,
    code_bytes_padded,
    code_bytes_per_row,
    is_sign,
    make_layout,
    scale_shape,
    scale_width,
)
from .predicated import Predicated
from .source import Sink, Source

__all__ = ["FUSED_MEAN_ROWS", "MODES", "Codec"]

MODES = {"plain": PLAIN, "error_feedback": ERROR_FEEDBACK, "markov": MARKOV, "diff": DIFF}
#: server stages of at most this many rows decode the workers' mean inside the reduction and the
#: encode (twice) instead of into a buffer (once): cheaper for one or two rows, dearer from three
#: (benchmarks/RESULTS.md, "Codec kernels"); the same bits either way
FUSED_MEAN_ROWS = 2


def _as_fp32_vector(x: torch.Tensor | Source, what: str, keep_source: bool = False) -> torch.Tensor | Source:
    """``x`` as a contiguous flat fp32 tensor; a payload :class:`Source` stays one with ``keep_source``
    (the backend evaluates it, or materialises it: see :meth:`Codec._readable`)."""
    if isinstance(x, Source):
        return x if keep_source else x.materialize()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {x.dtype}")
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()  # scales and arithmetic are fp32 whatever the input precision
    return x.contiguous()


def _check_state(buf: torch.Tensor, numel: int, device: torch.device, what: str) -> None:
    if buf.dtype != torch.float32 or not buf.is_contiguous() or buf.numel() != numel:
        raise ValueError(
            f"{what} must be a contiguous fp32 tensor with {numel} elements, got "
            f"{buf.dtype} with {buf.numel()} elements (contiguous={buf.is_contiguous()})"
        )
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device} but the input is on {device}")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` view the same elements (a copy from one to the other would change nothing)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class Codec(Predicated):
    """Base class: geometry, dispatch and the scale computation shared by all kinds.

    Geometry: a vector of ``numel`` elements is encoded as ``nseg`` equal rows (the chunks of
    the two-stage allreduce), each cut into scale blocks. ``groups`` (offsets into the vector)
    start a new scale block: the allreduce passes the offsets of the parameter tensors in a
    bucket, so no scale ever spans two tensors. ``block_size`` cuts each group further, every
    ``block_size`` elements from the group's first element. Every op takes ``nseg``/``groups``,
    or an explicit ``layout`` (:meth:`layout`).
    """

    kind: int
    # Encoding with given scales and decoding are elementwise, so a row can be cut into column
    # pieces that are encoded, sent and decoded separately (the allreduce pipeline relies on it).
    elementwise: bool = True

    def __init__(self, block_size: int | None = None, backend: str | None = None) -> None:
        if block_size is not None:
            if not isinstance(block_size, int) or block_size <= 0 or block_size % 8:
                raise ValueError(f"block_size must be a positive multiple of 8 or None, got {block_size!r}")
        self.block_size = block_size
        self.backend = backend
        if backend not in (None, "auto", *BACKENDS):
            raise ValueError(f"unknown compression backend {backend!r}; expected 'auto' or one of {BACKENDS}")

    # -- geometry ------------------------------------------------------------------------
    def layout(self, numel: int, nseg: int = 1, groups: Sequence[int] | None = None,
               valid: int | None = None) -> Layout:
        """The rows and scale blocks of a vector of ``numel`` elements (see the class docstring);
        elements from ``valid`` on are zero padding, which does not count in a scale."""
        if nseg < 1 or numel % nseg:
            raise ValueError(f"cannot split {numel} elements into {nseg} equal segments")
        key = (numel, nseg, None if groups is None else tuple(groups), valid)
        cache = self.__dict__.setdefault("_layouts", {})
        lay = cache.get(key)
        if lay is None:  # made once per geometry: a layout also caches the kernels' tile tables
            lay = make_layout(nseg, numel // nseg, self.block_size, groups, valid)
            if len(cache) >= 64:
                cache.pop(next(iter(cache)))
            cache[key] = lay
        return lay

    def _resolve(self, numel: int, nseg: int, groups: Sequence[int] | None, layout: Layout | None) -> Layout:
        if layout is None:
            return self.layout(numel, nseg, groups)
        if layout.numel != numel:
            raise ValueError(f"layout covers {layout.numel} elements, the input has {numel}")
        return layout

    def encoded_nbytes(self, numel: int, nseg: int = 1, groups: Sequence[int] | None = None) -> int:
        """Analytic size of ``encode(x)`` for ``x.numel() == numel`` (without encoding)."""
        lay = self.layout(numel, nseg, groups)
        return nseg * code_bytes_per_row(self.kind, lay.seg_len) + lay.nblocks * scale_width(self.kind) * 4

    def row_bytes(self, layout: Layout) -> int:
        """Bytes of one packed row of ``layout``: codes padded to 4 bytes, then the fp32 scales."""
        return code_bytes_padded(self.kind, layout.seg_len) + layout.blocks_per_seg * scale_width(self.kind) * 4

    def empty(self, layout: Layout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              packed: torch.Tensor | None = None) -> Encoded:
        """Message buffers for ``layout``, e.g. to receive a collective into.

        With ``packed`` (uint8 ``[nseg, row_bytes(layout)]``) the codes and scales are views
        into it, so one collective moves both: each row is ``[codes | pad to 4 | scales]``.
        """
        nseg, nb = layout.nseg, layout.blocks_per_seg
        cb = code_bytes_per_row(self.kind, layout.seg_len)
        shape = scale_shape(self.kind, nseg, nb)
        if packed is None:
            codes = torch.empty(nseg, cb, dtype=torch.uint8, device=device)
            scales = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            rb = self.row_bytes(layout)
            if packed.dtype != torch.uint8 or tuple(packed.shape) != (nseg, rb) or not packed.is_contiguous():
                raise ValueError(f"packed buffer must be contiguous uint8 [{nseg}, {rb}], got "
                                 f"{packed.dtype} {tuple(packed.shape)}")
            cb4 = code_bytes_padded(self.kind, layout.seg_len)
            codes = packed[:, :cb]
            scales = packed[:, cb4:].view(torch.float32).view(shape)
        return Encoded(codes, scales, layout, self.kind, dtype)

    def _backend(self, device: torch.device):
        return get_backend(device, None if self.backend in (None, "auto") else self.backend)

    @staticmethod
    def _readable(x: torch.Tensor | Source, backend) -> torch.Tensor | Source:
        """``x`` as ``backend`` reads it: a :class:`Source` stays one where the backend evaluates it
        in its kernels, else it is materialised (by the torch ops that define its bits)."""
        if isinstance(x, Source) and not (getattr(backend, "FUSES_SOURCES", False) and backend.accepts(x)):
            return x.materialize()
        return x

    # -- scales --------------------------------------------------------------------------
    def _not_finite(self) -> ValueError:
        return ValueError(f"{type(self).__name__}: the input is not finite (it contains NaN or inf); "
                          "nothing was encoded and no error/estimate state was changed")

    def _scales_unchecked(self, totals: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 block scales from the per-block fp64 totals ``[nblocks, width]`` of a reduction, and
        ``ok``: a 0-d bool tensor on the totals' device (the input was finite), so no host sync here.
        An empty block gets scale 0, which decodes to zeros; padding does not count in a length."""
        # the block lengths (at least 1, fp64) and which blocks hold data: on the device once per layout
        lens, live = lay.device_arrays("scale_lengths", totals.device, lambda: (
            np.maximum(lay.scale_lengths.reshape(-1), 1).astype(np.float64), lay.scale_lengths.reshape(-1) > 0))
        if is_sign(self.kind):
            total = totals[:, 0]
            ok = torch.isfinite(total).all()
            mean = torch.where(live, total / lens, 0.0)
            scales = (mean.sqrt() if self.kind == SIGN_L2 else mean).float().view(lay.nseg, -1)
        else:
            ok = torch.isfinite(totals[:, 2]).all()
            mm = torch.where(live[:, None], totals[:, :2], 0.0)
            scales = mm.float().view(lay.nseg, -1, 2)
        return scales, ok

    # -- core ----------------------------------------------------------------------------
    def _run(self, x: torch.Tensor, state: torch.Tensor | None, mode: int, lay: Layout,
             dtype: torch.dtype = torch.float32, out: Encoded | None = None,
             scales: torch.Tensor | None = None, check: bool = True, ok: torch.Tensor | None = None,
             go: torch.Tensor | None = None) -> Encoded:
        device = x.device
        if state is not None:
            _check_state(state, lay.numel, device, "state buffer")
        if out is None:
            out = self.empty(lay, device, dtype)
        elif out.kind != self.kind or not out.layout.same_as(lay):
            raise ValueError("out= message buffers do not match this codec and input geometry")
        else:
            out.dtype = dtype
        if lay.numel == 0:
            return out
        backend = self._backend(device)
        x = self._readable(x, backend)
        if scales is None:
            if hasattr(backend, "reduce_to_scales"):  # written into the message by the kernels
                fine = backend.reduce_to_scales(self.kind, mode, lay, x, state, out.scales, ok)
            else:
                totals = backend.reduce(self.kind, mode, lay, x, state)
                scales, fine = self._scales_unchecked(totals, lay)
                if ok is not None:
                    ok.copy_(fine.reshape(1))
            if check and not bool(fine):
                raise self._not_finite()
        elif ok is not None:
            ok.fill_(True)  # the caller's scales: checked by the caller
        if scales is not None and not _same_memory(scales, out.scales):
            out.scales.copy_(scales)
        if go is None:
            backend.encode(self.kind, mode, lay, x, state, out.scales, out.codes)
        else:
            self._predicating(backend).encode(self.kind, mode, lay, x, state, out.scales, out.codes, go=go)
        return out

    # -- public ops ----------------------------------------------------------------------
    def compute_scales(self, x: torch.Tensor, state: torch.Tensor | None = None, mode: str = "plain",
                       nseg: int = 1, *, groups: Sequence[int] | None = None,
                       layout: Layout | None = None) -> torch.Tensor:
        """The block scales the matching encode op would use; raises ``ValueError`` on NaN/inf.

        Lets a caller check its input (and agree with other ranks) before any state is
        written: pass the result as ``scales=`` to the encode op to skip its reduction.
        """
        scales, ok = self.compute_scales_unchecked(x, state, mode, nseg, groups=groups, layout=layout)
        if not bool(ok):
            raise self._not_finite()
        return scales

    def compute_scales_unchecked(self, x: torch.Tensor, state: torch.Tensor | None = None, mode: str = "plain",
                                 nseg: int = 1, *, groups: Sequence[int] | None = None,
                                 layout: Layout | None = None, out: torch.Tensor | None = None,
                                 ok: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_scales` without its check: ``(scales, ok)``, ``ok`` a 0-d bool tensor on
        ``x``'s device saying whether the input was finite. Nothing waits for the device, so a
        caller can fold ``ok`` into a collective and read it once (the scales of a non-finite
        input are meaningless). ``out`` (fp32, the scales' shape) and ``ok`` (a one-element 1-d bool
        tensor, then returned as the flag): buffers a hot path keeps, written instead of allocated."""
        x = _as_fp32_vector(x, "x", keep_source=True)
        m = MODES[mode]
        lay = self._resolve(x.numel(), nseg, groups, layout)
        if m != PLAIN:
            _check_state(state, lay.numel, x.device, "state buffer")
        shape = scale_shape(self.kind, lay.nseg, lay.blocks_per_seg)
        if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != shape or out.device != x.device):
            raise ValueError(f"out must be an fp32 tensor of shape {shape} on {x.device}, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        if ok is not None and (ok.dtype != torch.bool or ok.shape != (1,) or ok.device != x.device):
            raise ValueError(f"ok must be a one-element 1-d bool tensor on {x.device}")
        if lay.numel == 0:
            scales = self.empty(lay, x.device).scales if out is None else out
            return scales, torch.ones((), dtype=torch.bool, device=x.device) if ok is None else ok.fill_(True)
        backend = self._backend(x.device)
        st = state if m != PLAIN else None
        if hasattr(backend, "reduce_to_scales"):  # the scales and the flag by the kernels
            scales = torch.empty(shape, dtype=torch.float32, device=x.device) if out is None else out
            flag = backend.reduce_to_scales(self.kind, m, lay, self._readable(x, backend), st, scales, ok)
            return scales, flag.clone() if ok is None else flag  # without ``ok`` the flag is the layout's
        totals = backend.reduce(self.kind, m, lay, self._readable(x, backend), st)
        scales, fine = self._scales_unchecked(totals, lay)
        if out is not None:
            scales = out.copy_(scales)
        if ok is not None:
            fine = ok.copy_(fine.reshape(1))
        return scales, fine

    # Every encode op takes ``out=``: message buffers to write into (e.g. views into a packed
    # send buffer of a collective, see ``empty(..., packed=...)``); by default they are allocated.
    # ``go`` (every encode op): a one-element bool tensor on the device; unless it holds, the encode
    # writes no codes and no state (the reduction still writes the scales): a step decided on the
    # device leaves the state as it was without the host reading the flag. The cuda backend only.
    def encode(self, x: torch.Tensor, nseg: int = 1, out: Encoded | None = None,
               scales: torch.Tensor | None = None, *, groups: Sequence[int] | None = None,
               layout: Layout | None = None, go: torch.Tensor | None = None) -> Encoded:
        """Encode a 1-D tensor (optionally as ``nseg`` equal rows, each with its own scales)."""
        return self._encode_op(x, "x", None, PLAIN, nseg, out, scales, groups, layout, go=go)

    def encode_error_feedback(self, x: torch.Tensor, error: torch.Tensor, nseg: int = 1,
                              out: Encoded | None = None, scales: torch.Tensor | None = None, *,
                              groups: Sequence[int] | None = None, layout: Layout | None = None,
                              go: torch.Tensor | None = None) -> Encoded:
        """v = x + error; encode v; error <- v - decode(encoded). ``error`` is fp32, updated in place."""
        return self._encode_op(x, "x", error, ERROR_FEEDBACK, nseg, out, scales, groups, layout, go=go)

    def encode_markov(self, target: torch.Tensor, estimate: torch.Tensor, nseg: int = 1,
                      out: Encoded | None = None, scales: torch.Tensor | None = None, *,
                      groups: Sequence[int] | None = None, layout: Layout | None = None,
                      go: torch.Tensor | None = None) -> Encoded:
        """c = encode(target - estimate); estimate <- estimate + decode(c) (EF21 / CD-Adam)."""
        return self._encode_op(target, "target", estimate, MARKOV, nseg, out, scales, groups, layout, go=go)

    def encode_diff(self, target: torch.Tensor, reference: torch.Tensor, nseg: int = 1,
                    out: Encoded | None = None, scales: torch.Tensor | None = None, *,
                    groups: Sequence[int] | None = None, layout: Layout | None = None,
                    check_finite: bool = True, ok: torch.Tensor | None = None,
                    go: torch.Tensor | None = None) -> Encoded:
        """encode(target - reference) without touching ``reference``. ``check_finite=False``: no
        host sync; a non-finite difference shows as non-finite scales (the caller checks them).
        ``ok`` (a one-element bool tensor): written with whether the scales are finite."""
        return self._encode_op(target, "target", reference, DIFF, nseg, out, scales, groups, layout, check_finite,
                               ok, go=go)

    def _encode_op(self, x, what: str, state: torch.Tensor | None, mode: int, nseg: int, out: Encoded | None,
                   scales: torch.Tensor | None, groups: Sequence[int] | None, layout: Layout | None,
                   check: bool = True, ok: torch.Tensor | None = None, *, go: torch.Tensor | None = None) -> Encoded:
        xf = _as_fp32_vector(x, what, keep_source=True)
        return self._run(xf, state, mode, self._resolve(xf.numel(), nseg, groups, layout), dtype=x.dtype, out=out,
                         scales=scales, check=check, ok=ok, go=go)

    def server_step(self, messages: Encoded, error: torch.Tensor | None = None,
                    out: Encoded | None = None, mean: torch.Tensor | None = None, *,
                    check_finite: bool = True, ok: torch.Tensor | None = None,
                    go: torch.Tensor | None = None) -> Encoded:
        """Average the decoded rows of ``messages`` (+ ``error`` feedback) and re-encode one row.

        The rows must be cut alike (every worker's copy of one chunk); the result is cut like
        them. The mean is decoded once into ``mean`` (fp32, ``messages.seg_len`` elements;
        allocated when not given - pass a persistent buffer on hot paths) and then encoded as
        ``encode_error_feedback(mean, error)`` (or ``encode(mean)``): the reduction and the
        encode pass both need the mean, and decoding n rows is the costly part. Up to
        ``FUSED_MEAN_ROWS`` rows (world size 1 or 2, a simulation's worker rows) the numba kernels
        decode the mean inside both passes instead, which costs less than writing and reading it;
        the CUDA kernels decode it in the reduction, which writes it into ``mean`` for the encode.
        ``check_finite=False`` skips the finiteness check (a host sync on a GPU): a mean that
        overflowed fp32 then shows as non-finite scales in the result, for the caller to check, or
        in ``ok`` (a one-element bool tensor the reduction writes, with no torch op of its own).
        """
        backend = self._backend(messages.device)
        most = getattr(backend, "ROWS_MEAN_MAX", FUSED_MEAN_ROWS)
        if hasattr(backend, "RowsMean") and messages.seg_len and (most is None or messages.nseg <= most):
            mean = backend.RowsMean(messages, out=mean)  # decoded inside the passes
        else:
            if mean is None:
                mean = torch.empty(messages.seg_len, dtype=torch.float32, device=messages.device)
            self.decode_mean(messages, out=mean)
        mode = PLAIN if error is None else ERROR_FEEDBACK
        return self._run(mean, error, mode, messages.layout.row(0), dtype=messages.dtype, out=out,
                         check=check_finite, ok=ok, go=go)

    def decode(self, enc: Encoded, out: torch.Tensor | None = None, accumulate: bool = False,
               sink: Sink | None = None) -> torch.Tensor:
        """Decoded 1-D tensor of ``enc.numel`` elements in ``enc.dtype`` (or into fp32 ``out``).

        ``sink``: a :class:`~.source.Sink` applied to the decoded values in the same pass (only where
        :meth:`fuses_sink` says so; the caller applies it otherwise)."""
        if sink is not None:
            if out is None or accumulate or not self.fuses_sink(sink):
                raise ValueError("decode applies a sink only into out=, without accumulate, on a backend that "
                                 "fuses it (see fuses_sink)")
            if out.numel():
                self._backend(enc.device).decode(self.kind, enc.layout, enc.codes, enc.scales, out, False, False,
                                                 sink=sink)
            return out
        return self._decode(enc, out, accumulate, mean_rows=False)

    def fuses_sink(self, sink: Sink) -> bool:
        """Whether :meth:`decode` applies ``sink`` while decoding (the numba CPU backend, on CPU tensors)."""
        backend = self._backend(sink.denom.device)
        return bool(getattr(backend, "FUSES_SOURCES", False)) and backend.accepts_sink(sink)

    def decode_mean(self, enc: Encoded, out: torch.Tensor | None = None,
                    accumulate: bool = False) -> torch.Tensor:
        """Mean over the rows of ``enc`` (workers 0..n-1 summed in order, then divided by n); the
        rows must be cut alike."""
        starts = enc.layout.starts
        if enc.nseg > 1 and not (starts == starts[:1]).all():
            raise ValueError("decode_mean needs rows cut into the same scale blocks")
        return self._decode(enc, out, accumulate, mean_rows=True)

    def _decode(self, enc: Encoded, out, accumulate: bool, mean_rows: bool) -> torch.Tensor:
        if enc.kind != self.kind:
            raise ValueError(f"{type(self).__name__} cannot decode a message of another codec kind")
        n_out = enc.seg_len if mean_rows else enc.numel
        cast_to = None
        if out is None:
            buf = torch.empty(n_out, dtype=torch.float32, device=enc.device)
            cast_to = enc.dtype if enc.dtype != torch.float32 else None
        else:
            _check_state(out, n_out, enc.device, "out")
            buf = out
        if n_out:
            self._backend(enc.device).decode(self.kind, enc.layout, enc.codes, enc.scales, buf,
                                             accumulate, mean_rows)
        return buf.to(cast_to) if cast_to is not None else buf

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._extra_repr()})"

    def _extra_repr(self) -> str:
        return f"block_size={self.block_size}"

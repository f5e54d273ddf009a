"""Stage 4 of the two-stage allreduce (every rank): the gathered server rows checked (their scales finite)
and decoded into the result, at once or left for later (``CompressedAllreduce.__call__``'s ``defer``: the
gathered rows kept, decoded once the caller knows the call went through, or forgotten), or decoded on the
device under a :class:`Predicate`."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..compress.source import Sink

__all__ = ["Predicate", "Stage4"]


class Predicate(NamedTuple):
    """What the deferred decode of a call decided on the device is predicated on, and what it writes."""

    go: torch.Tensor  # the step's flag (1 element): every rank's every input finite
    server_ok: torch.Tensor  # this call's gathered server scales are finite (1 element)
    flags: torch.Tensor  # written by the decode: [go and server_ok, server_ok or not go]
    decay: torch.Tensor  # written by the decode: the update's decay, 1 where it was skipped (1 element)
    decay0: torch.Tensor  # ``decay`` as 0-d, what the sink reads
    took: torch.Tensor  # ``flags[:1]``: the call's result was written (what ops after the decode are predicated on)


class Stage4:
    """Mixin of :class:`~.two_stage.TwoStageRank` (whose geometry, codec, state and buffers it uses; ``_pending``
    and ``_gathered_check`` are set by its constructor and ``bind``): stage 4, now or deferred."""

    _pending: tuple | None
    _gathered_check: tuple | None

    def result_buffer(self, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 buffer of ``padded_numel`` elements that stage 4 decodes into.

        ``out`` itself when it is fp32, contiguous and padded already (no copy), the Markov
        estimate g_tilde in ``markov`` mode, else a reused (or, for an unpadded fp32 result
        without ``out``, a fresh) buffer."""
        d, D, dev = self.numel, self.padded_numel(self.numel), self.worker_device
        if self.mode == "markov":
            return self.tilde
        if out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == D:
            return out if out.dim() == 1 else out.view(-1)  # a view is a torch call on the step's path
        if out is None and D == d and dtype == torch.float32:
            return torch.empty(d, dtype=torch.float32, device=dev)
        return self._outpad if self._outpad is not None else torch.empty(D, dtype=torch.float32, device=dev)

    def gathered_finite(self, piece0: torch.Tensor) -> torch.Tensor:
        """0-d bool device tensor: the server scales in gathered piece 0 are all finite. At world size 1
        with one piece the one gathered row is this rank's server row, whose encode wrote the flag
        already (no torch op)."""
        if self.world_size == 1 and self._srv_ok0 is not None and piece0.data_ptr() == self._srv[0].data_ptr():
            return self._srv_ok0
        if self.num_pieces > 1:
            scales = self._row_scales(piece0)
        else:
            scales = self._messages(self.layout, piece0).scales
        bufs = self._gathered_check
        if bufs is None or bufs[0] != (scales.shape, scales.dtype):  # made once: the same flag buffer every call
            bufs = self._gathered_check = ((scales.shape, scales.dtype),
                                           torch.empty((), dtype=scales.dtype, device=scales.device),
                                           torch.empty((), dtype=torch.bool, device=scales.device))
        _, top, ok = bufs
        if scales.numel() == 0:
            return ok.fill_(True)
        # the largest magnitude, NaN where one is (the inf-norm propagates NaN): finite exactly when it is < inf
        torch.linalg.vector_norm(scales, math.inf, out=top)
        return torch.lt(top, math.inf, out=ok)

    def _fuses(self, sink: Sink | None) -> bool:
        """The codec applies ``sink`` as it decodes: the whole result, or with pipeline pieces each piece's window
        of every row (one away from 0 asked for them all: a backend may take only a whole result's)."""
        return sink is not None and self.codec.fuses_sink(sink if self.num_pieces == 1 else sink[1:])

    def finish_piece(self, gathered: torch.Tensor, dst: torch.Tensor, k: int = 0, sink: Sink | None = None) -> None:
        """Stage 4 (every rank): decode piece ``k`` of the gathered server rows into ``dst``; a ``sink``
        the codec applies while decoding (:meth:`Codec.fuses_sink`) is applied here, piece by piece."""
        n, seg, acc = self.world_size, self.seg_len, self.mode == "markov"
        if not self._fuses(sink):
            sink = None  # applied by finish() after the whole result is decoded
        if self.num_pieces == 1:
            self.codec.decode(self._messages(self.layout, gathered), out=dst,
                              accumulate=acc, sink=sink)
            return
        if k == 0:
            self._gathered_scales = self._row_scales(gathered)
        p = self.plan[k]
        for r in range(n):
            enc = self._piece(gathered, k, slice(r, r + 1), self._gathered_scales, self._win_rows[k][r])
            lo, hi = r * seg + p.lo, r * seg + p.hi
            self.codec.decode(enc, out=dst[lo:hi], accumulate=acc, sink=None if sink is None else sink[lo:hi])

    def finish(self, dst: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype,
               sink: Sink | None = None) -> torch.Tensor:
        """The result from the decoded buffer: padding dropped, cast to ``dtype`` or into ``out``
        (and a ``sink`` the codec did not apply while decoding applied now)."""
        d = self.numel
        if sink is not None and not self._fuses(sink):
            sink.apply(dst[:d])
        if out is not None and dst.data_ptr() == out.data_ptr():
            return out  # decoded in place
        if (out is None and dtype == torch.float32 and dst.numel() == d
                and dst is not self.tilde and dst is not self._outpad):
            return dst  # a fresh buffer of exactly the result
        if out is None:
            return dst[:d].to(dtype=dtype, copy=True)
        out.view(-1)[:d].copy_(dst[:d])
        return out

    # -- deferred ------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """A call's result is gathered and checked, and waits for :meth:`decode_pending`."""
        return self._pending is not None

    @property
    def pending_predicate(self) -> Predicate | None:
        """What the waiting call's decode is predicated on, if the device decided it (else None)."""
        return None if self._pending is None else self._pending[4]

    def _keep_pending(self, gathered: list[torch.Tensor], dst: torch.Tensor, out: torch.Tensor | None,
                      dtype: torch.dtype, go: Predicate | None = None) -> None:
        self._pending = (gathered, dst, out, dtype, go)

    def decode_pending(self, sink: Sink | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 4 of the deferred call: decode its gathered rows into its ``out`` (or into ``out``
        given here, e.g. a state buffer the caller may only change once it knows the call went
        through), applying ``sink``."""
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}: no deferred result to decode")
        gathered, dst, kept, dtype, go = self._pending
        self._pending = None
        if out is None:
            out = kept
        elif go is None:
            dst = self.result_buffer(out, dtype)
        if go is not None:
            return self._decode_predicated(gathered[0], out, sink, go)
        for k in range(self.num_pieces):
            self.finish_piece(gathered[k], dst, k, sink)
        return self.finish(dst, out, dtype, sink)

    def _decode_predicated(self, gathered: torch.Tensor, out: torch.Tensor | None, sink: Sink | None,
                           go: Predicate) -> torch.Tensor:
        """A call decided on the device (:func:`~.inflight.check_together`): its result decoded into ``out``
        and the ``sink`` applied only where both of ``go``'s flags hold, with no host read: by the decode kernel
        where the codec fuses it (it then writes nothing where they do not), else by torch, reading a copy of the
        values that is zero where they do not, and a decay of 1, so that its update adds nothing."""
        d = self.numel
        if out is None or out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != d:
            raise ValueError(f"{type(self).__name__}: a call decided on the device decodes into a contiguous "
                             f"fp32 out= of {d} elements")
        views = self._sink_in
        if views is None or views[0] is not out:  # the padded result's buffer where there is one, else its own
            copy = self._outpad[:d] if self._outpad is not None else torch.empty(d, dtype=torch.float32,
                                                                                  device=out.device)
            views = self._sink_in = (out, out.view(-1), copy)
        fused = sink is not None and self.codec.fuses_predicated_sink(sink)  # the update in the kernel: no copy
        self.codec.decode_predicated(self._messages(self.layout, gathered), views[1], None if fused else views[2],
                                     go=go.go, and_go=go.server_ok, flags=go.flags,
                                     decay=1.0 if sink is None else sink.decay, decay_out=go.decay,
                                     sink=sink if fused else None)
        if sink is not None and not fused:
            sink.apply(views[2], decay=go.decay0)
        return out

    def discard_pending(self) -> None:
        """Forget a deferred result (its call's state updates stand; the result is never decoded)."""
        self._pending = None

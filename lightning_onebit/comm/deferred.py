"""A two-stage call's stage 4 left for later (``CompressedAllreduce.__call__``'s ``defer``): the
gathered rows kept, decoded once the caller knows the call went through, or forgotten."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..compress.source import Sink

__all__ = ["DeferredDecode", "Predicate"]


class Predicate(NamedTuple):
    """What the deferred decode of a call decided on the device is predicated on, and what it writes."""

    go: torch.Tensor  # the step's flag (1 element): every rank's every input finite
    server_ok: torch.Tensor  # this call's gathered server scales are finite (1 element)
    flags: torch.Tensor  # written by the decode: [go and server_ok, server_ok or not go]
    decay: torch.Tensor  # written by the decode: the update's decay, 1 where it was skipped (1 element)
    decay0: torch.Tensor  # ``decay`` as 0-d, what the sink reads


class DeferredDecode:
    """The deferred decode of :class:`~.two_stage.TwoStageRank` (whose ``result_buffer``,
    ``finish_piece``, ``finish`` and ``num_pieces`` it uses); ``_pending`` is set by its constructor."""

    _pending: tuple | None

    @property
    def pending(self) -> bool:
        """A call's result is gathered and checked, and waits for :meth:`decode_pending`."""
        return self._pending is not None

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
        and the ``sink`` applied only where both of ``go``'s flags hold, with no host read. The sink reads a copy
        of the values that is zero where they do not, and a decay of 1, so that its update adds nothing."""
        d = self.numel
        if out is None or out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != d:
            raise ValueError(f"{type(self).__name__}: a call decided on the device decodes into a contiguous "
                             f"fp32 out= of {d} elements")
        views = self._sink_in
        if views is None or views[0] is not out:  # the padded result's buffer where there is one, else its own
            copy = self._outpad[:d] if self._outpad is not None else torch.empty(d, dtype=torch.float32,
                                                                                  device=out.device)
            views = self._sink_in = (out, out.view(-1), copy)
        self.codec.decode_predicated(self._messages(self.layout, gathered), views[1], views[2], go=go.go,
                                     and_go=go.server_ok, flags=go.flags, decay=1.0 if sink is None else sink.decay,
                                     decay_out=go.decay)
        if sink is not None:
            sink.apply(views[2], decay=go.decay0)
        return out

    def discard_pending(self) -> None:
        """Forget a deferred result (its call's state updates stand; the result is never decoded)."""
        self._pending = None

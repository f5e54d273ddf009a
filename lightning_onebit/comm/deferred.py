"""A two-stage call's stage 4 left for later (``CompressedAllreduce.__call__``'s ``defer``): the
gathered rows kept, decoded once the caller knows the call went through, or forgotten."""

from __future__ import annotations

import torch

from ..compress.source import Sink

__all__ = ["DeferredDecode"]


class DeferredDecode:
    """The deferred decode of :class:`~.two_stage.TwoStageRank` (whose ``result_buffer``,
    ``finish_piece``, ``finish`` and ``num_pieces`` it uses); ``_pending`` is set by its constructor."""

    _pending: tuple | None

    @property
    def pending(self) -> bool:
        """A call's result is gathered and checked, and waits for :meth:`decode_pending`."""
        return self._pending is not None

    def _keep_pending(self, gathered: list[torch.Tensor], dst: torch.Tensor, out: torch.Tensor | None,
                      dtype: torch.dtype) -> None:
        self._pending = (gathered, dst, out, dtype)

    def decode_pending(self, sink: Sink | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 4 of the deferred call: decode its gathered rows into its ``out`` (or into ``out``
        given here, e.g. a state buffer the caller may only change once it knows the call went
        through), applying ``sink``."""
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}: no deferred result to decode")
        gathered, dst, kept, dtype = self._pending
        self._pending = None
        if out is None:
            out = kept
        else:
            dst = self.result_buffer(out, dtype)
        for k in range(self.num_pieces):
            self.finish_piece(gathered[k], dst, k, sink)
        return self.finish(dst, out, dtype, sink)

    def discard_pending(self) -> None:
        """Forget a deferred result (its call's state updates stand; the result is never decoded)."""
        self._pending = None

"""The Encoded views of a rank's packed buffers, made once: a two-stage call's messages without
building code and scale views on every call."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compress import Codec, Encoded
from ..compress.kernels.layout import Layout

__all__ = ["MessageViews"]


class MessageViews:
    """``codec.empty(layout, packed=buf)`` per (layout, buffer), kept for the buffers a rank allocates
    once (:meth:`keep`). Any other buffer (a caller's, fresh each call) gets views made for that call
    and never kept: they would keep its memory alive. Layouts are the rank's own, alive as long as it."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._kept: dict[tuple[int, int, tuple[int, ...]], Encoded] = {}
        self._persistent: set[tuple[int, tuple[int, ...]]] = set()

    def keep(self, buffers: Iterable[torch.Tensor | None]) -> None:
        """Mark ``buffers`` (None entries skipped) as allocated once: their views are kept."""
        self._persistent.update((b.data_ptr(), tuple(b.shape)) for b in buffers if b is not None)

    def __call__(self, layout: Layout, packed: torch.Tensor) -> Encoded:
        mem = (packed.data_ptr(), tuple(packed.shape))
        key = (id(layout), *mem)
        msg = self._kept.get(key)
        if msg is None:
            msg = self.codec.empty(layout, packed.device, packed=packed)
            if mem in self._persistent:
                self._kept[key] = msg
        return msg

    def __len__(self) -> int:
        return len(self._kept)

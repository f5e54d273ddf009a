"""A compressed message: packed codes and fp32 scales, cut into rows and scale blocks by a layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.layout import Layout

__all__ = ["Encoded"]


@dataclass
class Encoded:
    """A compressed message: ``layout.nseg`` rows of ``layout.seg_len`` elements.

    ``codes`` is uint8 ``[nseg, bytes_per_row]``; ``scales`` is fp32 ``[nseg, nb]`` (sign) or
    ``[nseg, nb, 2]`` (min, max), one entry per scale block of the layout. ``dtype`` is what
    ``decode`` returns.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    layout: Layout
    kind: int
    dtype: torch.dtype = torch.float32

    @property
    def nseg(self) -> int:
        return self.layout.nseg

    @property
    def seg_len(self) -> int:
        return self.layout.seg_len

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes this message puts on the wire: its code bytes (``[nseg, bytes_per_row]``) + fp32 scales."""
        return self.codes.shape[0] * self.codes.shape[1] + self.scales.numel() * 4

    def row(self, i: int) -> Encoded:
        return Encoded(self.codes[i : i + 1], self.scales[i : i + 1], self.layout.row(i), self.kind, self.dtype)

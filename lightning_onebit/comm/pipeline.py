"""Pipeline pieces: a row of the two-stage allreduce cut into column pieces that go on the wire in turn.

A driver puts piece k on the wire while piece k+1 is encoded (see
:mod:`~lightning_onebit.comm.two_stage`); everything that is split is elementwise, so the result is
the same for every piece count. Automatic: one piece per ``MIN_PIECE`` elements of a row, at most
``MAX_PIECES``; piece boundaries fall on 4-byte code boundaries, and piece 0 carries the row's
scales, so the bytes on the wire do not change.
"""

from __future__ import annotations

from typing import NamedTuple

from ..compress import Codec
from ..compress.kernels.layout import Layout, code_bytes_padded, code_bytes_per_row

__all__ = ["MAX_PIECES", "MIN_PIECE", "Piece", "plan_pieces"]

# Pieces shorter than this gain less from the overlap than a collective's latency costs.
MIN_PIECE = 1 << 20
MAX_PIECES = 4


class Piece(NamedTuple):
    """Columns [lo, hi) of every row and where they sit in the piece's packed buffer."""

    lo: int
    hi: int
    cb: int  # code bytes
    cb4: int  # code bytes padded to 4: piece 0 puts the row's scales there
    rb: int  # packed bytes of one row of this piece


def plan_pieces(codec: Codec, layout: Layout, seg: int, pieces: int | None) -> list[Piece]:
    """Cut a row of ``seg`` elements of ``layout`` into ``pieces`` pieces (``None``: automatic)."""
    rb = codec.row_bytes(layout)
    cb = code_bytes_per_row(codec.kind, seg)
    whole = [Piece(0, seg, cb, code_bytes_padded(codec.kind, seg), rb)]  # one piece: the codec's own packing
    if not codec.elementwise or seg == 0:
        return whole
    # boundaries on 4-byte code boundaries (packing); scale blocks may be cut anywhere, since
    # every piece carries (piece 0) or uses the whole row's scales
    unit = 32
    k = min(MAX_PIECES, seg // MIN_PIECE) if pieces is None else pieces
    k = max(1, min(k, seg // unit))
    bounds = sorted({round(i * seg / k / unit) * unit for i in range(k)} | {seg})
    if len(bounds) <= 2:
        return whole
    scale_bytes = rb - whole[0].cb4  # the row's scales, after its codes
    plan = []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        cb, cb4 = code_bytes_per_row(codec.kind, hi - lo), code_bytes_padded(codec.kind, hi - lo)
        plan.append(Piece(lo, hi, cb, cb4, cb4 + (scale_bytes if i == 0 else 0)))
    assert sum(p.rb for p in plan) == rb
    return plan

"""Geometry shared by every kernel backend.

A message is a 2-D array of ``nseg`` rows ("segments": the chunks of the two-stage
allreduce, or one row for a plain vector) of ``seg_len`` elements. Each row is cut into
blocks of ``block`` elements that share one scale; the last block of a row may be short.
Codes are packed per row, so rows never share a byte and a row can be sent on its own.

Kinds and modes are small integers so that the numba kernels compile once per op, not
once per combination.
"""

from __future__ import annotations

from dataclasses import dataclass

# Codec kinds.
SIGN_L2 = 0  # 1-bit sign, scale = ||v||_2 / sqrt(len)        (1-bit Adam)
SIGN_L1 = 1  # 1-bit sign, scale = ||v||_1 / len              (scaled sign, CD-Adam / EF21)
MINMAX_U8 = 2  # 8-bit min-max quantisation per block           (QAdam / Bagua MinMaxUInt8)

# How the value v that gets encoded is formed from the source s and a state buffer b.
PLAIN = 0  # v = s
ERROR_FEEDBACK = 1  # v = s + b;  b <- v - decode(encode(v))
MARKOV = 2  # v = s - b;  b <- b + decode(encode(v))
DIFF = 3  # v = s - b;  b untouched (server side of a Markov sequence)

MODE_NAMES = {"plain": PLAIN, "error_feedback": ERROR_FEEDBACK, "markov": MARKOV, "diff": DIFF}


def is_sign(kind: int) -> bool:
    return kind in (SIGN_L2, SIGN_L1)


def partial_width(kind: int) -> int:
    """Columns of the per-tile partial reductions: sum, or (min, max, finiteness probe)."""
    return 1 if is_sign(kind) else 3


def code_bytes_per_row(kind: int, seg_len: int) -> int:
    return (seg_len + 7) // 8 if is_sign(kind) else seg_len


@dataclass(frozen=True)
class Layout:
    nseg: int
    seg_len: int
    block: int

    @property
    def blocks_per_seg(self) -> int:
        return max(1, -(-self.seg_len // self.block)) if self.seg_len else 0

    @property
    def nblocks(self) -> int:
        return self.nseg * self.blocks_per_seg

    @property
    def numel(self) -> int:
        return self.nseg * self.seg_len

    def tiles_per_block(self, tile: int) -> int:
        return max(1, -(-self.block // tile))


def make_layout(nseg: int, seg_len: int, block_size: int | None) -> Layout:
    if block_size is None or block_size >= seg_len:
        block = max(seg_len, 1)
    else:
        block = block_size
    return Layout(nseg, seg_len, block)

"""Geometry shared by every kernel backend.

A message is a 2-D array of ``nseg`` rows ("segments": the chunks of the two-stage
allreduce, or one row for a plain vector) of ``seg_len`` elements. Each row is cut into
**scale blocks**, each with its own scale, at explicit boundaries: ``starts[r]`` holds the
first element of every block of row r, then ``seg_len``. Rows may be cut differently (the
chunks of a multi-tensor bucket cross different tensors), but every row has the same number
of blocks ``nb`` (short rows are padded with empty blocks), so every row carries ``nb``
scales and rows of a message have one size on the wire.

Where the cuts come from (:func:`make_layout`): the start of every row, the start of every
*group* (a parameter tensor inside a bucket: a scale never spans two tensors), and, with
``block_size``, every ``block_size`` elements from the start of each group. Codes are packed
per row, so rows never share a byte; blocks may start anywhere, and the kernels handle a
block that starts in the middle of a code byte.

Kinds and modes are small integers so that the numba kernels compile once per op, not
once per combination.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# Codec kinds: small integers, the kernels' index into the per-kind tuples below.
SIGN_L2 = 0  # 1-bit sign, scale = ||v||_2 / sqrt(len)        (1-bit Adam)
SIGN_L1 = 1  # 1-bit sign, scale = ||v||_1 / len              (scaled sign, CD-Adam / EF21)
MINMAX_U8 = 2  # 8-bit min-max quantisation per block           (QAdam / Bagua MinMaxUInt8)
MINMAX_U4 = 3  # 4-bit min-max, two codes per byte                (Streaming DiLoCo's outer gradients)
MINMAX_U2 = 4  # 2-bit min-max, four codes per byte               (MuLoCo / SparseLoCo)
# every kind from MINMAX_U8 on is min-max: the kernels test ``kind >= MINMAX_U8``


@dataclass(frozen=True)
class CodeFormat:
    """How a kind of codec puts a scale block on the wire: ``bits``-bit codes, packed little-endian
    within a byte (element i of a row in byte ``i * bits // 8`` at bit ``(i * bits) % 8``; ``bits``
    divides 8, so no code spans two bytes), and ``scale_words`` fp32 scales per block. A min-max code
    q decodes to ``min + q * (max - min) / top``; a sign code to ``+scale`` (1) or ``-scale`` (0)."""

    bits: int  # bits per element
    top: int  # the largest code: 1 (sign), 2**bits - 1 (min-max)
    scale_words: int  # fp32 words per scale block: 1 (the scale) or 2 (min, max)
    totals: int  # fp64 values per block a scale reduction returns: 1 (the sum) or 3 (min, max, finiteness probe)

    def __post_init__(self) -> None:
        if 8 % self.bits or self.top != (1 << self.bits) - 1 or self.scale_words not in (1, 2):
            raise ValueError(f"inconsistent code format {self}")

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits


#: Every fact about a kind's codes that the kernels, codecs and byte counts need: one row per kind
#: (a new bit width is a row here plus the kernels that pack it, see ``MinMaxCodec``).
FORMATS: dict[int, CodeFormat] = {
    #          bits  top  scale words  totals
    SIGN_L2: CodeFormat(1, 1, 1, 1),
    SIGN_L1: CodeFormat(1, 1, 1, 1),
    MINMAX_U8: CodeFormat(8, 255, 2, 3),
    MINMAX_U4: CodeFormat(4, 15, 2, 3),
    MINMAX_U2: CodeFormat(2, 3, 2, 3),
}
#: The min-max kinds by code width (what ``MinMaxCodec(bits=...)`` accepts).
MINMAX_KINDS: dict[int, int] = {f.bits: k for k, f in FORMATS.items() if f.scale_words == 2}

# The table as tuples indexed by kind, for the numba kernels: numba compiles a global tuple in as a
# constant, so ``KIND_TOP[kind]`` costs a lookup that LLVM hoists out of the loops.
assert sorted(FORMATS) == list(range(len(FORMATS))), "kinds index the tuples below"
KIND_BITS = tuple(FORMATS[k].bits for k in range(len(FORMATS)))
KIND_PER_BYTE = tuple(FORMATS[k].codes_per_byte for k in range(len(FORMATS)))
KIND_TOP = tuple(FORMATS[k].top for k in range(len(FORMATS)))

# How the value v that gets encoded is formed from the source s and a state buffer b.
PLAIN = 0  # v = s
ERROR_FEEDBACK = 1  # v = s + b;  b <- v - decode(encode(v))
MARKOV = 2  # v = s - b;  b <- b + decode(encode(v))
DIFF = 3  # v = s - b;  b untouched (server side of a Markov sequence)

# The summation order of a block's scale, shared by the numba and CUDA backends so that they give
# the same bits on any machine and any thread or GPU-block count: the block is cut into tiles of
# REDUCE_TILE elements from its first element; in a tile, lane j (of REDUCE_LANES) sums elements
# j, j + LANES, j + 2 LANES, ... in order (fp64), the lanes are combined by a halving tree
# (lane j += lane j + h for h = LANES/2, ..., 1), and the tiles' sums are added in tile order.
REDUCE_TILE = 8192
REDUCE_LANES = 32  # one warp on a GPU; on a CPU the 32 fp64 accumulators vectorise


def is_sign(kind: int) -> bool:
    return FORMATS[kind].scale_words == 1


def code_bits(kind: int) -> int:
    """Bits per element: 1 (sign), 8, 4 or 2 (min-max); see :class:`CodeFormat` for the packing."""
    return FORMATS[kind].bits


def levels(kind: int) -> float:
    """The largest min-max code (255, 15, 3): decode = min + q * (max - min) / levels."""
    return float(FORMATS[kind].top)


def scale_width(kind: int) -> int:
    """fp32 values per scale block: one scale (sign), or (min, max)."""
    return FORMATS[kind].scale_words


def scale_shape(kind: int, nseg: int, nb: int) -> tuple[int, ...]:
    """The shape of a message's scales: ``[nseg, nb]`` (one word per block) or ``[nseg, nb, words]``."""
    words = FORMATS[kind].scale_words
    return (nseg, nb) if words == 1 else (nseg, nb, words)


def code_bytes_per_row(kind: int, seg_len: int) -> int:
    return (seg_len * FORMATS[kind].bits + 7) // 8


def code_bytes_padded(kind: int, seg_len: int) -> int:
    """Code bytes of a packed row padded to 4, where the row's fp32 scales start."""
    return -(-code_bytes_per_row(kind, seg_len) // 4) * 4


@dataclass(frozen=True, eq=False)
class Layout:
    """``nseg`` rows of ``seg_len`` elements; block j of row r is ``[starts[r, j], starts[r, j + 1])``.

    ``starts`` is int64 ``[nseg, nb + 1]``, non-decreasing per row, ``starts[r, 0] == 0`` and
    ``starts[r, nb] == seg_len``; a block may be empty (padding, or cut away by :meth:`window`).
    """

    nseg: int
    seg_len: int
    starts: np.ndarray = field(repr=False)
    #: per row, where its zero padding starts (int64 [nseg]); padding does not count in a block's
    #: length for its scale, decodes to 0 and keeps a zero state. None: no padding
    pad_from: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.starts.setflags(write=False)

    @property
    def blocks_per_seg(self) -> int:
        return self.starts.shape[1] - 1

    @property
    def nblocks(self) -> int:
        return self.nseg * self.blocks_per_seg

    @property
    def numel(self) -> int:
        return self.nseg * self.seg_len

    @cached_property
    def lengths(self) -> np.ndarray:
        """Elements per block, int64 ``[nseg, nb]``."""
        return np.diff(self.starts, axis=1)

    @cached_property
    def data_ends(self) -> np.ndarray:
        """Per row, where its data ends (int64 [nseg]): elements from there on are padding, which
        decodes to exactly 0 and whose state stays 0."""
        if self.pad_from is None:
            return np.full(self.nseg, self.seg_len, np.int64)
        return np.ascontiguousarray(self.pad_from, dtype=np.int64)

    @cached_property
    def scale_lengths(self) -> np.ndarray:
        """Elements per block that count in its scale: :attr:`lengths` without the padding."""
        if self.pad_from is None:
            return self.lengths
        return np.clip(np.minimum(self.starts[:, 1:], self.pad_from[:, None]) - self.starts[:, :-1], 0, None)

    @cached_property
    def key(self) -> tuple:
        """Hashable identity: two layouts with equal keys cut rows identically."""
        pad = None if self.pad_from is None else self.pad_from.tobytes()
        return self.nseg, self.seg_len, self.starts.tobytes(), pad

    def same_as(self, other: Layout) -> bool:
        return self.key == other.key

    def _pad(self, rows) -> np.ndarray | None:
        return None if self.pad_from is None else self.pad_from[rows]

    def _derived(self, key: tuple, make) -> Layout:
        """A layout cut from this one, made once: its own caches (the device copies of its tables
        among them) then survive from one step to the next."""
        cache = self.__dict__.setdefault("_derived_layouts", {})
        lay = cache.get(key)
        if lay is None:
            lay = cache[key] = make()
        return lay

    def row(self, r: int) -> Layout:
        return self._derived(("row", r), lambda: Layout(1, self.seg_len, self.starts[r : r + 1],
                                                        self._pad(slice(r, r + 1))))

    def repeat_row(self, r: int, n: int) -> Layout:
        """``n`` rows cut like row ``r`` (what a server receives: every worker's chunk r)."""
        def make() -> Layout:
            pad = None if self.pad_from is None else np.repeat(self.pad_from[r : r + 1], n)
            return Layout(n, self.seg_len, np.repeat(self.starts[r : r + 1], n, axis=0), pad)
        return self._derived(("repeat_row", r, n), make)

    def device_arrays(self, what: str, device, make) -> tuple:
        """Tables of this layout (``make()``: numpy arrays) as tensors on ``device``, copied there once
        per layout and device: a copy from the host blocks, so none may happen per step."""
        import torch  # the layout itself is numpy-only

        cache = self.__dict__.setdefault("_device_arrays", {})
        key = (what, str(device))
        if key not in cache:
            cache[key] = tuple(torch.from_numpy(np.array(a, copy=True)).to(device) for a in make())
        return cache[key]

    def window(self, lo: int, hi: int) -> Layout:
        """Columns ``[lo, hi)`` of every row as a layout of its own: blocks clipped to the window
        (blocks outside it become empty), so block j keeps its index and its scale."""
        if not 0 <= lo <= hi <= self.seg_len:
            raise ValueError(f"window [{lo}, {hi}) outside a row of {self.seg_len}")

        def make() -> Layout:
            pad = None if self.pad_from is None else np.clip(self.pad_from - lo, 0, hi - lo)
            return Layout(self.nseg, hi - lo, np.clip(self.starts - lo, 0, hi - lo), pad)
        return self._derived(("window", lo, hi), make)

    def reduce_tiles(self, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Work items of a reduction: every non-empty block cut into tiles of ``tile`` elements from
        its first element. Returns (row, lo, hi) per tile and ``ptr`` ([nblocks + 1]): the tiles of
        block b (flat index r * nb + j) are ``ptr[b]:ptr[b + 1]``, in element order."""
        cache = self.__dict__.setdefault("_tiles", {})
        if tile not in cache:
            lens = self.lengths.reshape(-1)
            ntile = -(-lens // tile)
            ptr = np.zeros(lens.size + 1, np.int64)
            np.cumsum(ntile, out=ptr[1:])
            block = np.repeat(np.arange(lens.size, dtype=np.int64), ntile)
            k = np.arange(ptr[-1], dtype=np.int64) - ptr[block]
            nb = max(self.blocks_per_seg, 1)
            row = block // nb
            first = self.starts[:, :-1].reshape(-1)[block]
            lo = first + k * tile
            hi = np.minimum(lo + tile, self.starts[:, 1:].reshape(-1)[block])
            cache[tile] = (row, lo, hi, ptr)
        return cache[tile]


def make_layout(nseg: int, seg_len: int, block_size: int | None, groups: Sequence[int] | None = None,
                valid: int | None = None) -> Layout:
    """Rows of ``seg_len`` cut at row starts, at ``groups`` (offsets into the flat ``nseg * seg_len``
    vector where a new scale group begins) and every ``block_size`` elements from each group's
    start (so that, e.g., blocks of an embedding's row width fall on its rows in every chunk).
    ``groups=None``: every row is a group of its own (independent rows). ``valid``: the first
    ``valid`` elements are data, the rest zero padding that scales do not count."""
    lay = _cut(nseg, seg_len, block_size, groups)
    if valid is None or valid >= nseg * seg_len:
        return lay
    pad = np.clip(valid - np.arange(nseg, dtype=np.int64) * seg_len, 0, seg_len)
    return Layout(lay.nseg, lay.seg_len, lay.starts, pad)


def _cut(nseg: int, seg_len: int, block_size: int | None, groups: Sequence[int] | None) -> Layout:
    total = nseg * seg_len
    if seg_len == 0:
        return Layout(nseg, 0, np.zeros((nseg, 1), np.int64))
    row_starts = np.arange(0, total, seg_len, dtype=np.int64)
    if groups is None:
        if block_size is None:  # one block per row: the common fast path
            return Layout(nseg, seg_len, np.tile(np.array([[0, seg_len]], np.int64), (nseg, 1)))
        gstart = row_starts
    else:
        bounds = np.unique(np.asarray(groups, dtype=np.int64))
        if bounds.size and (bounds[0] < 0 or bounds[-1] > total):
            raise ValueError(f"group offsets must lie in [0, {total}], got {bounds[0]}..{bounds[-1]}")
        gstart = np.union1d(bounds[bounds < total], [0])
    cuts = [row_starts, gstart]
    if block_size is not None:
        gend = np.append(gstart[1:], total)
        for a, b in zip(gstart.tolist(), gend.tolist(), strict=True):
            if b - a > block_size:
                cuts.append(np.arange(a + block_size, b, block_size, dtype=np.int64))
    cuts = np.unique(np.concatenate(cuts))
    row = cuts // seg_len
    per_row = np.bincount(row, minlength=nseg)
    nb = int(per_row.max())
    starts = np.full((nseg, nb + 1), seg_len, np.int64)
    first = np.zeros(nseg + 1, np.int64)
    np.cumsum(per_row, out=first[1:])
    col = np.arange(cuts.size, dtype=np.int64) - first[row]
    starts[row, col] = cuts - row * seg_len
    return Layout(nseg, seg_len, starts)

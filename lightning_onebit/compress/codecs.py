"""Compression codecs: 1-bit sign (l2 or l1 scale) and 8-, 4- and 2-bit min-max quantisation.

Each is a :class:`~.base.Codec` that names its kind of codes; the operations (``encode``,
``encode_error_feedback``, ``encode_markov``, ``server_step``, ``decode``, ...) and their trade-offs
are the base class's, and what a kind's codes are (bits, top code, scale words) is one row of
:data:`~.kernels.layout.FORMATS`.
"""

from __future__ import annotations

# the base class and its module's names, importable from here as they were before it moved
from .base import FUSED_MEAN_ROWS as FUSED_MEAN_ROWS
from .base import MODES as MODES
from .base import Codec
from .base import _as_fp32_vector as _as_fp32_vector
from .base import _check_state as _check_state
from .encoded import Encoded
from .kernels.layout import MINMAX_KINDS, SIGN_L1, SIGN_L2

__all__ = ["Codec", "Encoded", "MinMaxCodec", "MinMaxUInt8Codec", "SignCodec"]


class SignCodec(Codec):
    """1-bit sign codec: decode = scale * (+1 where v >= 0 else -1), one scale per block.

    ``scale="l2"``: scale = ||v||_2 / sqrt(numel) (1-bit Adam; preserves the block's l2 norm).
    ``scale="l1"``: scale = ||v||_1 / numel (the scaled sign of CD-Adam / EF21; minimises
    ||v - scale * sign(v)||_2). ``block_size=None`` uses one scale per vector (per row).
    Zero and -0.0 code as +1; an all-zero block has scale 0 and decodes to zeros.
    """

    def __init__(self, scale: str = "l2", block_size: int | None = None, backend: str | None = None) -> None:
        if scale not in ("l2", "l1"):
            raise ValueError(f"SignCodec scale must be 'l2' or 'l1', got {scale!r}")
        super().__init__(block_size, backend)
        self.scale = scale
        self.kind = SIGN_L2 if scale == "l2" else SIGN_L1

    def _extra_repr(self) -> str:
        return f"scale={self.scale!r}, block_size={self.block_size}"


class MinMaxCodec(Codec):
    """``bits``-bit min-max quantisation per block (8: Bagua's MinMaxUInt8; 4 and 2: the outer
    gradients of Streaming DiLoCo and MuLoCo), codes packed ``8 // bits`` to a byte.

    With L = 2**bits - 1: q = round((v - min) * L / (max - min)) in [0, L] (ties to even);
    decode = min + q * (max - min) / L, so |v - decode| <= (max - min) / (2 L). A constant block
    decodes exactly to its value. Each block also sends its (min, max): 8 bytes, so at 2 bits a
    block of ``n`` elements costs n / 4 + 8 bytes.
    """

    _KINDS = MINMAX_KINDS  # bits -> kind, from the format table

    def __init__(self, bits: int = 8, block_size: int | None = None, backend: str | None = None) -> None:
        if bits not in self._KINDS:
            raise ValueError(f"MinMaxCodec bits must be one of {sorted(self._KINDS)}, got {bits!r}")
        super().__init__(block_size, backend)
        self.bits = bits
        self.kind = self._KINDS[bits]

    def _extra_repr(self) -> str:
        return f"bits={self.bits}, block_size={self.block_size}"


class MinMaxUInt8Codec(MinMaxCodec):
    """8-bit min-max quantisation per block (Bagua's MinMaxUInt8): ``MinMaxCodec(bits=8)``.

    q = round((v - min) * 255 / (max - min)) in [0, 255]; decode = min + q * (max - min) / 255,
    so |v - decode| <= (max - min) / 510. A constant block decodes exactly to its value.
    """

    def __init__(self, block_size: int | None = None, backend: str | None = None) -> None:
        super().__init__(8, block_size, backend)

    def _extra_repr(self) -> str:
        return f"block_size={self.block_size}"

"""What a mean puts on the wire, parsed and checked in one place for both families.

A :class:`Wire` is either a dense dtype (fp32, bf16, fp16: a full-precision mean sent in that dtype, as
DDP and PyTorch's ``bf16_compress_hook`` send it) or a codec's codes (1-bit signs with an l2 or l1
scale, 2-, 4- or 8-bit min-max codes, top-k). The optimizers name theirs (1-bit Adam's momentum, QAdam's,
a warm-up's ``warmup_comm_dtype``, DiLoCo's ``compression``) and :func:`~lightning_onebit.comm.make_mean`
builds the mean that sends it. A new codec is one more kind here and its kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..compress import Codec, MinMaxCodec, SignCodec, TopKCodec

__all__ = ["DENSE_DTYPES", "Wire"]

#: the dense wires by name
DENSE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: the min-max code widths by name ("uint8": the warm-up's historical name of 8-bit codes)
_MINMAX = {"8bit": 8, "4bit": 4, "2bit": 2, "uint8": 8}


@dataclass(frozen=True)
class Wire:
    """What a mean sends: ``kind`` is ``"dense"`` (``dtype``), ``"sign"`` (1 bit, ``scale`` ``"l2"`` or
    ``"l1"``), ``"minmax"`` (``bits`` 8, 4 or 2) or ``"topk"`` (``ratio`` of the elements)."""

    kind: str
    dtype: torch.dtype | None = None
    bits: int = 32
    scale: str = "l2"
    ratio: float | None = None

    # -- the values -----------------------------------------------------------------------------
    @classmethod
    def dense(cls, dtype: torch.dtype = torch.float32) -> Wire:
        if dtype not in DENSE_DTYPES.values():
            raise ValueError(f"a dense wire is fp32, bf16 or fp16, got {dtype}")
        return cls("dense", dtype=dtype, bits=8 * torch.empty((), dtype=dtype).element_size())

    @classmethod
    def sign(cls, scale: str = "l2") -> Wire:
        if scale not in ("l2", "l1"):
            raise ValueError(f"a sign wire's scale is 'l2' or 'l1', got {scale!r}")
        return cls("sign", bits=1, scale=scale)

    @classmethod
    def minmax(cls, bits: int) -> Wire:
        MinMaxCodec(bits)  # the codec validates its widths
        return cls("minmax", bits=bits)

    @classmethod
    def topk(cls, ratio: float) -> Wire:
        TopKCodec(ratio)  # validates the ratio
        return cls("topk", ratio=float(ratio))

    @classmethod
    def parse(cls, value: Wire | str | torch.dtype | None, *, option: str = "wire",
              allowed: Iterable[str] = ("fp32", "bf16", "fp16", "8bit", "4bit", "2bit", "1bit")) -> Wire:
        """``value`` as a wire: a :class:`Wire`, one of the ``allowed`` names (``"fp32"``, ``"bf16"``,
        ``"fp16"``, ``"8bit"``, ``"4bit"``, ``"2bit"``, ``"1bit"``, ``"uint8"``), a torch dtype among them
        (``torch.uint8``: 8-bit codes), or ``None`` (fp32). Anything else is a ``ValueError`` that names
        ``option`` and what it may be."""
        names = tuple(allowed)
        wires = {name: cls._named(name) for name in names}
        if value is None and "fp32" in wires:
            return wires["fp32"]
        if isinstance(value, Wire) and value in wires.values():
            return value
        if isinstance(value, str) and value in wires:
            return wires[value]
        if isinstance(value, torch.dtype):
            for wire in wires.values():
                if wire.dtype == value or (value == torch.uint8 and wire == cls.minmax(8)):
                    return wire
        dtypes = [str(w.dtype if w.kind == "dense" else torch.uint8) for n, w in wires.items()
                  if w.kind == "dense" or n == "uint8"]
        also = f" (or the torch dtypes {', '.join(dtypes)})" if dtypes else ""
        raise ValueError(f"{option} must be one of {sorted(names)}{also}, got {value!r}")

    @classmethod
    def _named(cls, name: str) -> Wire:
        if name in DENSE_DTYPES:
            return cls.dense(DENSE_DTYPES[name])
        if name in _MINMAX:
            return cls.minmax(_MINMAX[name])
        if name == "1bit":
            return cls.sign()
        raise ValueError(f"no wire is called {name!r}")

    # -- what it means --------------------------------------------------------------------------
    @property
    def is_dense(self) -> bool:
        """A full-precision mean in ``dtype`` (no codec, no error state of its own)."""
        return self.kind == "dense"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of what goes on the wire: the dense dtype, else ``torch.uint8`` (packed codes)."""
        return self.dtype if self.is_dense else torch.uint8

    def codec(self, block_size: int | None = None) -> Codec:
        """The codec of a coded wire (every tensor of a flat input gets its own scales; ``block_size``
        cuts them further); a dense wire has none."""
        if self.kind == "sign":
            return SignCodec(self.scale, block_size=block_size)
        if self.kind == "minmax":
            return MinMaxCodec(self.bits, block_size=block_size)
        if self.kind == "topk":
            return TopKCodec(self.ratio)
        raise ValueError(f"the {self} wire has no codec: it is a dense mean")

    def __str__(self) -> str:
        if self.is_dense:
            return {v: k for k, v in DENSE_DTYPES.items()}[self.dtype]
        if self.kind == "sign":
            return "1bit" if self.scale == "l2" else "1bit (l1 scale)"
        if self.kind == "minmax":
            return f"{self.bits}bit"
        return f"top-{self.ratio:g}"

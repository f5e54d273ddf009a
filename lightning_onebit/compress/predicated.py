"""A codec's operations for a step decided on the device (the cuda backend): every write predicated on a flag.

A compression step of 1-bit Adam or QAdam on a GPU decides on the device whether it goes through, as fused
AdamW's ``found_inf`` does: the encodes take ``go=`` (:meth:`~.base.Codec.encode` and its fused variants),
and the decode here writes the result, and applies the update (a :class:`~.source.Sink`), only where the
flags hold, so the host never waits for them (see the data flow's non-finite values).
"""

from __future__ import annotations

import torch

from .encoded import Encoded
from .source import Sink

__all__ = ["Predicated"]


class Predicated:
    """The predicated half of :class:`~.base.Codec` (which sets ``kind`` and ``_backend``)."""

    kind: int

    def _predicating(self, backend):
        if not getattr(backend, "PREDICATES", False):
            raise ValueError(f"{type(self).__name__}: go= needs a backend that predicates its kernels (cuda), "
                             f"not {backend.__name__.rsplit('.', 1)[-1]}")
        return backend

    def decode_predicated(self, enc: Encoded, out: torch.Tensor, copy: torch.Tensor | None, *, go: torch.Tensor,
                          and_go: torch.Tensor | None = None, flags: torch.Tensor | None = None,
                          decay: float = 1.0, decay_out: torch.Tensor | None = None, sink: Sink | None = None) -> None:
        """Decode ``enc`` into ``out`` if ``go[0]`` (and ``and_go[0]``) hold (one-element 1-d bool tensors on
        the device), else leave it as it is, and into ``copy`` either way: the values, or zeros where not.
        ``out`` (1-d) may be the result without its padding (fewer elements than ``enc.numel``), e.g. a
        state buffer; ``copy`` (1-d fp32, at least ``out``'s elements; the kernel writes no more than the
        message holds) is what an update reads, so that a step the device decided to skip adds nothing
        there, with no host read. ``flags`` (2 bools): written ``[go and and_go, and_go or not go]`` for
        the ops after it; ``decay_out`` (one fp32): ``decay`` where both hold, else 1, for an update that
        multiplies by it. ``sink``: applied by the kernel where it writes ``out`` (:meth:`fuses_predicated_sink`),
        so that the update needs no ``copy`` (None: none written). The cuda backend only."""
        for name, t in (("out", out), ("copy", copy)):
            if t is not None and (t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous()
                                  or t.device != enc.device):
                raise ValueError(f"decode_predicated: {name} must be a contiguous 1-d fp32 tensor on {enc.device}")
        if out.numel() > enc.numel or (copy is not None and copy.numel() < out.numel()):
            raise ValueError(f"decode_predicated: out has {out.numel()} elements and copy "
                             f"{None if copy is None else copy.numel()}, the message {enc.numel}")
        if enc.numel:
            self._predicating(self._backend(enc.device)).decode(
                self.kind, enc.layout, enc.codes, enc.scales, out, False, False, go=go, and_go=and_go, copy=copy,
                flags=flags, decay=decay, decay_out=decay_out, sink=sink)

    def fuses_predicated_sink(self, sink: Sink) -> bool:
        """Whether :meth:`decode_predicated` applies ``sink`` in its kernel (the cuda backend, see
        :mod:`.kernels.numba_cuda_sink`)."""
        backend = self._backend(sink.denom.device)
        return bool(getattr(backend, "PREDICATES", False)) and backend.accepts_sink(sink)

    def gathers_ends(self, device: torch.device) -> bool:
        """Whether a :class:`~.source.Source`'s per-tensor ends are copied into one flat buffer before this codec's
        kernels on ``device`` read them (every backend but the CPU's numba kernels, which read each where it is):
        a caller that holds them in one buffer already spares each call that copy."""
        return not getattr(self._backend(device), "READS_ENDS_IN_PLACE", False)

    def predicates(self, device: torch.device) -> bool:
        """Whether this codec's kernels on ``device`` take ``go=`` (the cuda backend)."""
        return bool(getattr(self._backend(device), "PREDICATES", False))

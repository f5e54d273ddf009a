"""Top-k sparsification as a codec (a baseline compressor of the CD-Adam paper).

Each row keeps its k largest-magnitude entries: fp32 values + int32 indices, k = ceil(ratio *
row length). It offers the same operations as the other codecs, so the two-stage allreduce,
error feedback and Markov sequences work unchanged; it is plain torch (a baseline, not a hot
path), so it has no numba kernels. Every kept entry carries its own value, so there are no
scales to align with tensor boundaries: ``groups`` do not change its layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import MODES, Codec, _as_fp32_vector, _check_state
from .encoded import Encoded
from .kernels.layout import DIFF, ERROR_FEEDBACK, MARKOV, PLAIN, Layout, make_layout

__all__ = ["TopKCodec"]

TOPK = 3


class TopKCodec(Codec):
    """Keep the ``ratio`` fraction (at least one) largest-magnitude entries of each row."""

    kind = TOPK
    elementwise = False  # the k kept entries are chosen per whole row

    def __init__(self, ratio: float = 0.01) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"TopKCodec ratio must be in (0, 1], got {ratio!r}")
        super().__init__(block_size=None, backend="torch")
        self.ratio = ratio

    def _extra_repr(self) -> str:
        return f"ratio={self.ratio}"

    def k(self, seg_len: int) -> int:
        return min(seg_len, max(1, math.ceil(self.ratio * seg_len)))

    def layout(self, numel: int, nseg: int = 1, groups: Sequence[int] | None = None,
               valid: int | None = None) -> Layout:
        if nseg < 1 or numel % nseg:
            raise ValueError(f"cannot split {numel} elements into {nseg} equal segments")
        return make_layout(nseg, numel // nseg, None)  # no scales: groups do not matter

    def row_bytes(self, layout: Layout) -> int:
        return 8 * self.k(layout.seg_len)

    def encoded_nbytes(self, numel: int, nseg: int = 1, groups: Sequence[int] | None = None) -> int:
        return nseg * 8 * self.k(numel // nseg)

    def empty(self, layout: Layout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              packed: torch.Tensor | None = None) -> Encoded:
        """``codes``: int32 indices as bytes ``[nseg, 4k]``; ``scales``: fp32 values ``[nseg, k]``."""
        nseg, k = layout.nseg, self.k(layout.seg_len)
        if packed is None:
            packed = torch.empty(nseg, 8 * k, dtype=torch.uint8, device=device)
        elif packed.dtype != torch.uint8 or tuple(packed.shape) != (nseg, 8 * k):
            raise ValueError(f"packed buffer must be uint8 [{nseg}, {8 * k}], got {packed.dtype} {tuple(packed.shape)}")
        return Encoded(packed[:, : 4 * k], packed[:, 4 * k :].view(torch.float32), layout, self.kind, dtype)

    @staticmethod
    def _indices(enc: Encoded) -> torch.Tensor:
        return enc.codes.contiguous().view(torch.int32).long()

    def _value(self, x, state, mode: int, nseg: int) -> torch.Tensor:
        rows = x.view(nseg, -1)
        if mode == PLAIN:
            return rows
        b = state.view(nseg, -1)
        return rows + b if mode == ERROR_FEEDBACK else rows - b

    def compute_scales(self, x: torch.Tensor, state: torch.Tensor | None = None, mode: str = "plain",
                       nseg: int = 1, *, groups: Sequence[int] | None = None,
                       layout: Layout | None = None) -> torch.Tensor:
        x = _as_fp32_vector(x, "x")
        self._check_finite(x, state, MODES[mode], layout.nseg if layout is not None else nseg)
        return torch.empty(0)  # nothing to precompute; the check is what callers need

    def _check_finite(self, x: torch.Tensor, state: torch.Tensor | None, mode: int, nseg: int) -> None:
        if mode != PLAIN:
            _check_state(state, x.numel(), x.device, "state buffer")
        if x.numel() and not bool(torch.isfinite(self._value(x, state, mode, nseg)).all()):
            raise ValueError("TopKCodec: the input is not finite (it contains NaN or inf); "
                             "nothing was encoded and no error/estimate state was changed")

    def _run(self, x, state, mode, lay, dtype=torch.float32, out=None, scales=None, check=True,
             ok=None, go=None) -> Encoded:
        if go is not None:
            raise ValueError("TopKCodec: go= is not supported (its torch ops are not predicated)")
        nseg = lay.nseg
        if state is not None:
            _check_state(state, x.numel(), x.device, "state buffer")
        if scales is None and check:  # unchecked: a non-finite value travels as one of the "scales"
            self._check_finite(x, state, mode, nseg)
        v = self._value(x, state, mode, nseg)
        device = x.device
        seg = v.shape[1]
        out = out if out is not None else self.empty(lay, device, dtype)
        out.dtype = dtype
        if v.numel() == 0:
            if ok is not None:
                ok.fill_(True)
            return out
        k = self.k(seg)
        idx = v.abs().topk(k, dim=1, sorted=True).indices.sort(dim=1).values  # ascending: deterministic order
        vals = v.gather(1, idx)
        out.scales.copy_(vals)
        if ok is not None:  # the values travel as its "scales"
            ok.copy_(torch.isfinite(vals).all().reshape(1))
        out.codes.copy_(idx.to(torch.int32).view(torch.uint8).view(nseg, -1))
        if mode in (ERROR_FEEDBACK, MARKOV):
            dec = torch.zeros_like(v).scatter_(1, idx, vals)
            st = state.view(nseg, -1)
            if mode == ERROR_FEEDBACK:
                st.copy_(v - dec)
            else:
                st.add_(dec)
        else:
            assert mode in (PLAIN, DIFF)
        return out

    def _decode(self, enc: Encoded, out, accumulate: bool, mean_rows: bool) -> torch.Tensor:
        if enc.kind != self.kind:
            raise ValueError("TopKCodec cannot decode a message of another codec kind")
        n_out = enc.seg_len if mean_rows else enc.numel
        buf = out if out is not None else torch.zeros(n_out, dtype=torch.float32, device=enc.device)
        if out is not None:
            _check_state(out, n_out, enc.device, "out")
        if n_out == 0:
            return buf
        rows = torch.zeros(enc.nseg, enc.seg_len, dtype=torch.float64 if mean_rows else torch.float32,
                           device=enc.device)
        rows.scatter_(1, self._indices(enc), enc.scales.to(rows.dtype))
        if mean_rows:  # workers summed in order 0..n-1 in fp64, then / n, like the other codecs
            acc = rows[0].clone()
            for w in range(1, enc.nseg):
                acc += rows[w]
            dec = (acc / enc.nseg).float()
        else:
            dec = rows.view(-1)
        if accumulate:
            buf.add_(dec)
        else:
            buf.copy_(dec)
        if out is None and enc.dtype != torch.float32:
            return buf.to(enc.dtype)
        return buf

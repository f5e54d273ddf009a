"""Plain-torch reference backend.

Every other backend must produce the same codes bit for bit and the same decoded values
to float tolerance (only the order of the fp64 scale sums may differ). It is written for
clarity and runs on any device torch supports; it is not fused.
"""

from __future__ import annotations

import torch

from .layout import DIFF, ERROR_FEEDBACK, MARKOV, MINMAX_U8, PLAIN, SIGN_L1, SIGN_L2, Layout, is_sign

name = "torch"


def _unpack_bits(codes: torch.Tensor, seg_len: int) -> torch.Tensor:
    shifts = torch.arange(8, device=codes.device, dtype=torch.uint8)
    bits = (codes.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(codes.shape[0], -1)[:, :seg_len].bool()


def _per_element(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Expand per-block values [nseg, bps, ...] to per-element [nseg, seg_len, ...]."""
    return values.repeat_interleave(layout.block, dim=1)[:, : layout.seg_len]


def _decode_rows(kind: int, layout: Layout, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decoded values as fp32 [nseg, seg_len]."""
    if is_sign(kind):
        s = _per_element(scales.reshape(layout.nseg, -1), layout)
        bits = _unpack_bits(codes, layout.seg_len)
        return torch.where(bits, s, -s)
    lo = _per_element(scales[..., 0].reshape(layout.nseg, -1), layout).double()
    hi = _per_element(scales[..., 1].reshape(layout.nseg, -1), layout).double()
    step = (hi - lo) / 255.0
    return (lo + codes[:, : layout.seg_len].double() * step).float()


def _mean_of_rows(kind: int, layout: Layout, codes, scales) -> torch.Tensor:
    """The mean over message rows as fp32 [1, seg_len]."""
    nw = codes.shape[0]
    rows = _decode_rows(kind, Layout(nw, layout.seg_len, layout.block), codes, scales)
    acc = rows[0].double()
    for w in range(1, nw):  # fixed order, in fp64: every backend sums workers 0..n-1 like this
        acc += rows[w].double()
    return (acc / nw).float().view(1, layout.seg_len)


def _value(mode: int, src: torch.Tensor, st: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    if mode == PLAIN:
        return src
    b = st.view(layout.nseg, layout.seg_len)
    return src + b if mode == ERROR_FEEDBACK else src - b


def _blocks(v: torch.Tensor, layout: Layout, fill: float) -> torch.Tensor:
    padded = v.new_full((layout.nseg, layout.blocks_per_seg * layout.block), fill)
    padded[:, : layout.seg_len] = v
    return padded.view(layout.nblocks, layout.block)


def reduce(kind: int, mode: int, layout: Layout, x, st) -> torch.Tensor:
    """Per-block partial reductions, fp64 [nblocks, 1, width]."""
    v = _value(mode, x.view(layout.nseg, layout.seg_len), st, layout).double()
    if kind == SIGN_L2:
        out = _blocks(v * v, layout, 0.0).sum(1, keepdim=True)
    elif kind == SIGN_L1:
        out = _blocks(v.abs(), layout, 0.0).sum(1, keepdim=True)
    else:
        mn = _blocks(v, layout, float("inf")).amin(1)
        mx = _blocks(v, layout, float("-inf")).amax(1)
        probe = _blocks(v * 0.0, layout, 0.0).sum(1)
        out = torch.stack([mn, mx, probe], dim=1)
    return out.view(layout.nblocks, 1, -1)


def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    """Write codes for the given scales; update the state buffer for EF / Markov modes."""
    v = _value(mode, x.view(layout.nseg, layout.seg_len), st, layout)
    if is_sign(kind):
        bits = v >= 0  # -0.0 >= 0 holds: zero and negative zero both code as +1
        cb = codes.shape[1]
        padded = torch.zeros(layout.nseg, cb * 8, dtype=torch.uint8, device=v.device)
        padded[:, : layout.seg_len] = bits
        shifts = torch.arange(8, device=v.device, dtype=torch.uint8)
        codes.copy_((padded.view(layout.nseg, cb, 8) << shifts).sum(-1).to(torch.uint8))
        s = _per_element(scales.reshape(layout.nseg, -1), layout)
        dec = torch.where(bits, s, -s)
    else:
        lo = _per_element(scales[..., 0].reshape(layout.nseg, -1), layout).double()
        hi = _per_element(scales[..., 1].reshape(layout.nseg, -1), layout).double()
        rng = hi - lo
        # torch's scalar / tensor multiplies by a reciprocal; a tensor / tensor division
        # rounds like the kernels' 255.0 / rng.
        inv = torch.where(rng > 0, torch.full_like(rng, 255.0) / rng, torch.zeros_like(rng))
        q = torch.round((v.double() - lo) * inv).clamp_(0, 255)
        codes[:, : layout.seg_len] = q.to(torch.uint8)
        dec = (lo + q * (rng / 255.0)).float()
    if mode == ERROR_FEEDBACK:
        st.view(layout.nseg, layout.seg_len).copy_(v - dec)
    elif mode == MARKOV:
        st.view(layout.nseg, layout.seg_len).add_(dec)
    else:
        assert mode in (PLAIN, DIFF)


def decode(kind, layout: Layout, codes, scales, out, accumulate: bool, mean_rows: bool = False) -> None:
    """out = decode(codes) (or +=). With mean_rows, out is one row: the mean over the rows."""
    if mean_rows:
        dec = _mean_of_rows(kind, layout, codes, scales)
        target = out.view(1, layout.seg_len)
    else:
        dec = _decode_rows(kind, layout, codes, scales)
        target = out.view(layout.nseg, layout.seg_len)
    if accumulate:
        target.add_(dec)
    else:
        target.copy_(dec)


__all__ = ["reduce", "encode", "decode", "SIGN_L1", "SIGN_L2", "MINMAX_U8", "MARKOV", "DIFF"]

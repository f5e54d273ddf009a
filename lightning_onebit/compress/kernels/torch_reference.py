"""Plain-torch reference backend.

Every other backend must produce the same codes bit for bit and the same decoded values
to float tolerance (only the order of the fp64 scale sums may differ). It is written for
clarity and runs on any device torch supports; it is not fused.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import DIFF, ERROR_FEEDBACK, FORMATS, MARKOV, PLAIN, SIGN_L2, Layout, code_bytes_per_row, is_sign, levels


def _unpack_codes(kind: int, codes: torch.Tensor, seg_len: int) -> torch.Tensor:
    """The codes as one uint8 per element [nseg, seg_len] (unpacked from the kind's width)."""
    fmt = FORMATS[kind]
    if fmt.codes_per_byte == 1:
        return codes[:, :seg_len]
    shifts = torch.arange(0, 8, fmt.bits, device=codes.device, dtype=torch.uint8)
    q = (codes.unsqueeze(-1) >> shifts) & fmt.top
    return q.reshape(codes.shape[0], -1)[:, :seg_len]


def _pack_codes(kind: int, q: torch.Tensor, codes: torch.Tensor) -> None:
    """Write one uint8 code per element [nseg, seg_len] into ``codes``, packed to the kind's width."""
    fmt = FORMATS[kind]
    nseg, seg_len = q.shape
    per = fmt.codes_per_byte
    if per == 1:
        codes[:, :seg_len] = q
        return
    cb = code_bytes_per_row(kind, seg_len)
    padded = torch.zeros(nseg, cb * per, dtype=torch.uint8, device=q.device)
    padded[:, :seg_len] = q
    shifts = torch.arange(0, 8, fmt.bits, device=q.device, dtype=torch.uint8)
    codes[:, :cb] = (padded.view(nseg, cb, per) << shifts).sum(-1).to(torch.uint8)


def _block_index(layout: Layout, device: torch.device) -> torch.Tensor:
    """For every element, the flat index (r * nb + j) of its scale block: int64 [nseg, seg_len]."""
    nb = layout.blocks_per_seg
    idx = [np.repeat(np.arange(nb) + r * nb, layout.lengths[r]) for r in range(layout.nseg)]
    return torch.from_numpy(np.stack(idx) if idx else np.zeros((0, 0), np.int64)).to(device)


def _per_element(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Per-block values [nseg, nb, ...] as per-element [nseg, seg_len, ...]."""
    flat = values.reshape(layout.nblocks, *values.shape[2:])
    return flat[_block_index(layout, values.device)]


def _data(layout: Layout, device: torch.device) -> torch.Tensor:
    """Which elements are data, not padding: bool [nseg, seg_len]."""
    ends = torch.from_numpy(layout.data_ends).to(device)
    return torch.arange(layout.seg_len, device=device) < ends[:, None]


def _decode_rows(kind: int, layout: Layout, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decoded values as fp32 [nseg, seg_len] (padding: 0)."""
    if is_sign(kind):
        s = _per_element(scales.reshape(layout.nseg, -1), layout)
        dec = torch.where(_unpack_codes(kind, codes, layout.seg_len).bool(), s, -s)
    else:
        mm = _per_element(scales.reshape(layout.nseg, -1, 2), layout).double()
        lo, hi = mm[..., 0], mm[..., 1]
        step = (hi - lo) / levels(kind)
        dec = (lo + _unpack_codes(kind, codes, layout.seg_len).double() * step).float()
    return dec.masked_fill_(~_data(layout, dec.device), 0.0)


def _mean_of_rows(kind: int, layout: Layout, codes, scales) -> torch.Tensor:
    """The mean over message rows as fp32 [1, seg_len]."""
    nw = codes.shape[0]
    rows = _decode_rows(kind, layout, codes, scales)
    acc = rows[0].double()
    for w in range(1, nw):  # fixed order, in fp64: every backend sums workers 0..n-1 like this
        acc += rows[w].double()
    return (acc / nw).float().view(1, layout.seg_len)


def _value(mode: int, src: torch.Tensor, st: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    if mode == PLAIN:
        return src
    b = st.view(layout.nseg, layout.seg_len)
    return src + b if mode == ERROR_FEEDBACK else src - b


def reduce(kind: int, mode: int, layout: Layout, x, st) -> torch.Tensor:
    """Per-block totals, fp64 [nblocks, width]: sum of v^2 / |v|, or (min, max, finiteness probe)."""
    v = _value(mode, x.view(layout.nseg, layout.seg_len), st, layout).double().reshape(-1)
    idx = _block_index(layout, v.device).reshape(-1)
    nb = layout.nblocks
    if is_sign(kind):
        terms = v * v if kind == SIGN_L2 else v.abs()
        return torch.zeros(nb, dtype=torch.float64, device=v.device).index_add_(0, idx, terms).view(nb, 1)
    mn = torch.full((nb,), float("inf"), dtype=torch.float64, device=v.device).scatter_reduce_(0, idx, v, "amin")
    mx = torch.full((nb,), float("-inf"), dtype=torch.float64, device=v.device).scatter_reduce_(0, idx, v, "amax")
    probe = torch.zeros(nb, dtype=torch.float64, device=v.device).index_add_(0, idx, v * 0.0)
    return torch.stack([mn, mx, probe], dim=1)


def encode(kind, mode, layout: Layout, x, st, scales, codes) -> None:
    """Write codes for the given scales; update the state buffer for EF / Markov modes."""
    v = _value(mode, x.view(layout.nseg, layout.seg_len), st, layout)
    if is_sign(kind):
        bits = v >= 0  # -0.0 >= 0 holds: zero and negative zero both code as +1
        _pack_codes(kind, bits.to(torch.uint8), codes)
        s = _per_element(scales.reshape(layout.nseg, -1), layout)
        dec = torch.where(bits, s, -s)
    else:
        mm = _per_element(scales.reshape(layout.nseg, -1, 2), layout).double()
        lo, hi = mm[..., 0], mm[..., 1]
        rng = hi - lo
        top = levels(kind)
        # torch's scalar / tensor multiplies by a reciprocal; a tensor / tensor division
        # rounds like the kernels' levels / rng.
        inv = torch.where(rng > 0, torch.full_like(rng, top) / rng, torch.zeros_like(rng))
        q = torch.round((v.double() - lo) * inv).clamp_(0, top)
        _pack_codes(kind, q.to(torch.uint8).masked_fill_(~_data(layout, v.device), 0), codes)
        dec = (lo + q * (rng / top)).float()
    # padding keeps its state: EF's v - dec is then the state itself, Markov adds nothing
    src = x.view(layout.nseg, layout.seg_len)
    dec = torch.where(~_data(layout, v.device), src if mode == ERROR_FEEDBACK else torch.zeros_like(v), dec)
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


__all__ = ["reduce", "encode", "decode"]

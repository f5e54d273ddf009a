"""The mean over ranks of a few scattered fp32 values, each rank's sent as runs of indices.

1-bit Adam's masked coordinates (an embedding's rows that no batch of the warm-up reached) start
to train when a gradient reaches them: a step touches a few rows among millions of masked
coordinates. Telling the ranks which ones with a bit per masked coordinate (1.27 MB a step for a
BERT embedding) and then all-reducing the union's values costs a megabyte and two or three round
trips. Here each rank sends only what it holds, in one gather: which indices of the domain (the
masked coordinates) it has values at, as runs (an embedding row is one) or, where the runs would
take more, as a bit per index of the domain, and the values. Every rank already knows each row's
length from the collective's agreement round (:func:`sparse_row` gives the length to announce
there). Each rank then sums the rows in rank order, dividing each by n first as DDP does, so the
mean is the same to the bit on every rank and equals the simulation's ``g_0 / n + g_1 / n + ...``
on any number of ranks (an fp32 all-reduce sums in the backend's order).

Row layout, bytes: ``[R: int64][R x (start, length): int64][values: fp32]``, or ``[-1: int64][a bit
per index of the domain, padded to 4 bytes][values: fp32]``; no values: an empty row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .accounting import ByteCounter
from .dense import all_gather_rows, collective_device, group_size, pack_bits, unpack_bits
from .duplex import duplex_twin

__all__ = ["gather_sizes", "sparse_mean", "sparse_mean_bytes", "sparse_row"]

_BITS = -1  # the header of a row whose indices go as a bit each


def _runs(index: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` int64 (start, length) of the runs of consecutive values in sorted ``index``."""
    brk = torch.ones(index.numel(), dtype=torch.bool, device=index.device)
    brk[1:] = index[1:] - index[:-1] != 1
    first = brk.nonzero().view(-1)
    ends = torch.cat([first[1:], first.new_tensor([index.numel()])])
    return torch.stack([index[first], ends - first], 1)


def _bitmask_bytes(domain: int) -> int:
    return -(-((domain + 7) // 8) // 4) * 4  # the values after it stay 4-byte aligned


def sparse_row(index: torch.Tensor, values: torch.Tensor, domain: int) -> torch.Tensor:
    """A rank's row for :func:`sparse_mean`: its values (fp32) at the sorted int64 ``index`` into a
    domain of ``domain`` positions (uint8; empty when there are none). Its ``numel()`` is what the
    agreement announces."""
    if index.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=index.device)
    runs = _runs(index)
    vals = values.to(torch.float32).contiguous().view(torch.uint8)
    if 16 * runs.shape[0] <= _bitmask_bytes(domain):
        head = torch.cat([runs.new_tensor([runs.shape[0]]), runs.view(-1)])
        return torch.cat([head.view(torch.uint8), vals])
    flags = torch.zeros(domain, dtype=torch.bool, device=index.device)
    flags[index] = True
    bits = torch.zeros(_bitmask_bytes(domain), dtype=torch.uint8, device=index.device)
    packed = pack_bits(flags)
    bits[:packed.numel()] = packed.to(index.device)
    return torch.cat([index.new_tensor([_BITS]).view(torch.uint8), bits, vals])


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8  # rows start 8-byte aligned, so their int64 header can be viewed in place


def sparse_mean_bytes(sizes: Sequence[int], n: int) -> int:
    """Bytes one rank sends in :func:`sparse_mean` when the ranks' rows are ``sizes`` bytes long."""
    return (n - 1) * _padded(max(sizes, default=0))


def _parse(row: torch.Tensor, domain: int) -> tuple[torch.Tensor, torch.Tensor]:
    head = int(row[:8].view(torch.int64))
    if head == _BITS:
        at = 8 + _bitmask_bytes(domain)
        index = unpack_bits(row[8:at], domain).nonzero().view(-1)
    else:
        runs = row[8:8 + 16 * head].view(torch.int64).view(head, 2)
        starts, lengths = runs[:, 0], runs[:, 1]
        base = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
        index = base + torch.arange(int(lengths.sum()), device=row.device)
        at = 8 + 16 * head
    return index, row[at:at + 4 * index.numel()].view(torch.float32)


def gather_sizes(size: int, group=None, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's ``size`` (an int, e.g. its :func:`sparse_row`'s length) in rank order, in one small
    gather: what :func:`sparse_mean` needs where no collective's agreement round carried the sizes."""
    n = group_size(group)
    if n == 1:
        return [int(size)]
    dev = collective_device(group, torch.device(device))
    sizes = torch.empty(n, 1, dtype=torch.int64, device=dev)
    all_gather_rows(sizes, torch.tensor([int(size)], dtype=torch.int64, device=dev), group)
    return sizes.view(-1).tolist()


def sparse_mean(row: torch.Tensor, sizes: Sequence[int], domain: int, group=None,
                counter: ByteCounter | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, mean): the sorted union of every rank's indices and the mean over the group of the
    values there (a rank without a value at an index counts 0). ``row``: this rank's
    :func:`sparse_row` over ``domain``; ``sizes``: every rank's row length in rank order (as the
    collective's agreement gathered them). One gather of rows padded to the longest; gloo with CPU
    rows sends them to every rank in one round trip (each direction of a pair on its own connection
    where the group has a duplex twin)."""
    n, device = group_size(group), row.device
    if n == 1:
        if row.numel():
            return _parse(row, domain)
        return row.new_zeros(0, dtype=torch.int64), row.new_zeros(0, dtype=torch.float32)
    width = _padded(max(sizes))
    dev = collective_device(group, device)
    mine = torch.zeros(width, dtype=torch.uint8, device=dev)
    mine[:row.numel()] = row
    rows = torch.empty(n, width, dtype=torch.uint8, device=dev)
    all_gather_rows(rows, mine, group, twin=duplex_twin(group))  # the twin serves only a fan-out
    parts = [_parse(rows[r].to(device), domain) for r in range(n) if sizes[r]]
    index = torch.unique(torch.cat([i for i, _ in parts]))  # sorted
    mean = torch.zeros(index.numel(), dtype=torch.float32, device=device)
    for i, v in parts:  # rank order; within one rank each index once, so index_add_ is exact
        mean.index_add_(0, torch.searchsorted(index, i), v / n)
    if counter is not None:
        counter.add(sparse_mean_bytes(sizes, n), index.numel(), n)
    return index, mean

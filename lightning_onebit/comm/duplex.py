"""Exchanges that carry each direction of a rank pair on a TCP connection of its own (gloo).

gloo joins two ranks of a process group by one TCP connection, and bytes sent both ways on it at once
move at about one direction's rate, about twice what the link needs, and at the link's rate with each
direction on a connection of its own (``benchmarks/collectives.py --methods wire1bit wire1bit_duplex
pair_bothways pair_duplex``; measured in benchmarks/TIME_TO_ACCURACY.md, "Why the exchanges go duplex"),
while plain sockets carry both directions of one connection at the link's rate
(``benchmarks/netns_cluster.py --selftest 100mbit --both-ways``). The two exchanges of
the compressed allreduce send both ways at once by design, so on gloo they go as point-to-point messages:
from the lower rank of a pair to the higher on the group itself, back on a *twin* group over the same
ranks.

The twin is a second gloo group, made by :func:`enable_duplex` (a collective call, like
``new_group``, that Lightning strategies of this package make in their setup). Without one the
exchanges are the plain collectives, with the same bytes and results. The messages carry exactly the
rows the collectives would, so a result does not depend on the path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["duplex_twin", "enable_duplex", "exchange_rows", "group_timeout"]

_TWINS: dict[int, tuple[object, object]] = {}  # id(group) -> (group, twin); the group held so that ids stay unique


def _resolve(group):
    return dist.group.WORLD if group is None else group


def duplex_twin(group=None):
    """The twin :func:`enable_duplex` made for ``group`` (``None``: the default group), or ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    g = _resolve(group)
    hit = _TWINS.get(id(g))
    return hit[1] if hit is not None and hit[0] is g else None  # a destroyed group's entry is stale


def group_timeout(group=None):
    """``group``'s own timeout (``None``: the default group), for a group made beside it (``new_group``'s
    default is 30 minutes); ``None`` where torch does not expose it."""
    try:
        return _resolve(group)._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def enable_duplex(group=None) -> bool:
    """Give ``group`` (``None``: the default group) a twin gloo group over the same ranks, through which
    its exchanges send the higher-to-lower direction of each pair (see the module docstring).

    Collective, as ``torch.distributed.new_group`` is: every rank of the default group calls it, in the
    same order relative to its other ``new_group`` calls, on the main thread (not in a comm hook).
    Returns whether exchanges on ``group`` now go duplex: ``False`` without torch.distributed, on one
    rank, or where ``group`` does not run on gloo. Calling it again for the same group does nothing."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    g = _resolve(group)
    if dist.get_world_size(g) < 2 or str(dist.get_backend(g)).lower() != "gloo":
        return False
    if duplex_twin(g) is not None:
        return True
    ranks = None if g is dist.group.WORLD else dist.get_process_group_ranks(g)
    twin = dist.new_group(ranks, timeout=group_timeout(g), backend="gloo", group_desc="lightning_onebit duplex twin")
    _TWINS[id(g)] = (g, twin)
    return True


class _Exchange:
    """The messages of one :func:`exchange_rows`, waited for together (what an async collective returns)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        while self.works:
            self.works.pop(0).wait()  # a failed message raises here; the rest are dropped with this object
        return True


def exchange_rows(out: torch.Tensor, rows: Sequence[torch.Tensor], group=None, *, twin, tag: int = 0,
                  async_op: bool = False) -> _Exchange | None:
    """``out[j]`` <- rank j's ``rows[rank]``, as ``all_to_all_single`` of equal rows, with the pair
    (i < j) sending i -> j on ``group`` and j -> i on ``twin`` (see the module docstring).

    ``out``: ``[n, len]``; ``rows``: n tensors of ``len`` elements (the same tensor n times to send one
    row to every rank). Every rank posts its messages in the order of its calls, so calls must come in
    the same order on every rank, as collectives must. ``tag`` keeps different kinds of exchange apart."""
    n = out.shape[0]
    me = dist.get_rank(group)
    out[me].copy_(rows[me].reshape(-1))
    works = []
    for s in range(1, n):  # staggered as gloo's all-to-all: step s sends to me + s, receives from me - s
        dst, src = (me + s) % n, (me - s) % n
        works.append(dist.isend(rows[dst].reshape(-1), group=group if me < dst else twin, tag=tag, group_dst=dst))
        works.append(dist.irecv(out[src], group=group if src < me else twin, tag=tag, group_src=src))
    exchange = _Exchange(works)
    if async_op:
        return exchange
    exchange.wait()
    return None

"""Two-level compressed allreduce: full precision inside a node, compressed between nodes.

A cluster has ``N`` nodes of ``L`` ranks; ranks of one node share a fast link (NVLink, PCIe, a
host's loopback), nodes a slow one. A flat compressed allreduce over all ``N L`` ranks compresses
traffic between two ranks of the same node (error for no gain), and each node pushes ``L`` ranks'
rows over its slow link. The two-level call instead:

1. **reduce-scatter inside the node** (fp32): the padded input is cut into ``L`` shards;
   ``all_to_all_single`` hands local rank ``j`` every node-mate's shard ``j``, which it sums in
   local-rank order (fp64, then / L, then fp32: a fixed order, so a simulation reproduces it, and a
   mean of finite fp32 values cannot overflow);
2. **compressed allreduce between nodes**: the two-stage :class:`~.allreduce.CompressedAllreduce`
   of that shard among the ``N`` ranks with local rank ``j`` (one per node), with its own
   error/Markov state, which covers one shard: ``L`` times less than the flat call's;
3. **all_gather inside the node** (fp32) of the ``L`` reduced shards.

Every rank ends with the same bits. A node sends the ``2 L (N-1)`` rows of its ``L`` shard
collectives between nodes (:meth:`HierarchicalAllreduce.inter_node_bytes_per_call`), for one fp32
reduce-scatter + all_gather on the fast link. The flat call's all_to_all sends ``L`` times as many
rows off the node; its all_gather, a ring in gloo and NCCL, crosses a node boundary once per row, so
in all the two-level call sends ``(L (n-L) + n-1) / (2 L (N-1))`` times fewer: 1.75x at 2 x 2.

Ranks are laid out as launchers lay them out: global rank ``node * L + local_rank``
(:func:`node_groups` builds the two kinds of groups). A call starts with one agreement round over
the whole group (size, dtype, codec, mode, ranks per node, finiteness, the caller's flag), so
ranks that disagree - also on the layout - raise together instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..compress import Codec
from ..compress.kernels import get_backend
from ..compress.source import Source
from .accounting import ByteCounter
from .allreduce import CompressedAllreduce, _group_rank_size
from .dense import _all_gather_single, all_finite, fans_out
from .simulated import SimulatedCluster, record_flags
from .two_stage import TwoStageRank

__all__ = ["HierarchicalAllreduce", "SimulatedHierarchicalCluster", "node_groups", "shard_groups"]


def node_groups(ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, this rank's cross-node group) of the default group, for ranks laid
    out ``node * ranks_per_node + local_rank``. Every rank must call it (group creation is
    collective); raises if the world size is not a multiple of ``ranks_per_node``."""
    world = dist.get_world_size()
    # agree first: ranks that enumerate different groups would wait in group creation forever
    mine = torch.tensor([ranks_per_node], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    seen = [int(t) for t in every]
    if len(set(seen)) > 1:
        raise ValueError(f"ranks disagree on ranks_per_node: {seen} (by rank)")
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the world size {world}")
    nodes = world // ranks_per_node
    local, _ = dist.new_subgroups_by_enumeration(
        [[k * ranks_per_node + j for j in range(ranks_per_node)] for k in range(nodes)])
    cross, _ = dist.new_subgroups_by_enumeration(
        [[k * ranks_per_node + j for k in range(nodes)] for j in range(ranks_per_node)])
    return local, cross


def _shard_len(numel: int, ranks_per_node: int) -> int:
    return -(-numel // ranks_per_node)


def shard_groups(numel: int, ranks_per_node: int, local_rank: int, groups: Sequence[int],
                 block_size: int | None = None) -> list[int]:
    """The tensor starts (``groups`` offsets of the flat input) that fall inside shard
    ``local_rank``, relative to the shard: its collective keeps one scale per piece of a tensor.
    With the codec's ``block_size``, the tensor the shard starts inside keeps the phase of its blocks
    (a cut where its next block begins), so blocks fall where the flat collective puts them: an
    embedding row stays one block."""
    s = _shard_len(numel, ranks_per_node)
    lo = local_rank * s
    cuts = {0} | {g - lo for g in groups if lo < g < lo + s}
    if block_size:
        first = max((g for g in groups if g <= lo), default=0)
        nxt = block_size - (lo - first) % block_size
        if nxt < min(block_size, s) and not any(0 < c <= nxt for c in cuts):
            cuts.add(nxt)
    return sorted(cuts)


def _node_mean(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 mean of one shard over a node's ranks (``rows``: L x s): summed in local-rank order in
    fp64, then / L. The real call and the simulation both use it, so their node means are the same bits.

    On the CPU a numba kernel does it in one pass into ``out``; the torch formulation (same arithmetic)
    makes three fp64 temporaries and was the slowest part of the call (benchmarks/RESULTS.md, "Measurements
    behind design choices")."""
    if out is None:
        out = torch.empty(rows.shape[1], dtype=torch.float32, device=rows.device)
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.is_contiguous():
        get_backend(rows.device, "numba").mean_rows(rows, out)
        return out
    acc = rows[0].double()
    for row in rows[1:]:
        acc += row
    return out.copy_(acc / rows.shape[0])


def _intra_node_bytes(ranks_per_node: int, shard_len: int) -> int:
    """fp32 bytes a rank sends inside its node per call: reduce-scatter + all_gather of its shards."""
    return 2 * (ranks_per_node - 1) * shard_len * 4


class _Shards:
    """What both two-level collectives know of their shards: ``numel`` once bound, cut into ``ranks_per_node``."""

    numel: int | None
    ranks_per_node: int

    @property
    def shard_len(self) -> int:
        return _shard_len(self.numel, self.ranks_per_node)

    def _bound(self, numel: int) -> bool:
        """True if bound to ``numel`` already (another size is an error); else ``numel`` is bound now."""
        if self.numel is not None:
            if numel != self.numel:
                raise ValueError(f"{type(self).__name__} is bound to {self.numel} elements, got {numel}")
            return True
        self.numel = numel
        return False


class HierarchicalAllreduce(_Shards):
    """Compressed estimate of the mean of a 1-D tensor over ``N`` nodes of ``L`` ranks.

    Args:
        codec, mode, verify, pieces, groups: as :class:`~.allreduce.CompressedAllreduce` (``groups``
            are the flat input's tensor offsets; each shard keeps those inside it).
        local_group: this rank's node (its ``L`` ranks), e.g. from :func:`node_groups`.
        cross_group: the ranks with this rank's local rank, one per node.
        group: the whole group, for the agreement round (``None``: the default group).
        counter: gets the inter-node bytes (the compressed collective's); ``intra_counter`` the
            fp32 bytes inside the node.
    """

    def __init__(self, codec: Codec, mode: str = "error_feedback", *, local_group, cross_group, group=None,
                 counter: ByteCounter | None = None, intra_counter: ByteCounter | None = None,
                 verify: str = "always", pieces: int | None = None, groups: Sequence[int] | None = None) -> None:
        self.local_rank, self.ranks_per_node = _group_rank_size(local_group)
        self.node, self.nodes = _group_rank_size(cross_group)
        self.local_group, self.cross_group = local_group, cross_group
        self.codec, self.mode, self.pieces = codec, mode, pieces
        self.groups = tuple(sorted({int(g) for g in groups})) if groups is not None else ()
        self.counter = counter if counter is not None else ByteCounter()
        self.intra_counter = intra_counter if intra_counter is not None else ByteCounter()
        # the agreement round over the whole group; no data goes through this collective
        self._agreement = CompressedAllreduce(codec, mode, group=group, verify=verify, groups=self.groups)
        if self._agreement.world_size != self.nodes * self.ranks_per_node:
            raise ValueError(f"the group has {self._agreement.world_size} ranks, the node groups describe "
                             f"{self.nodes} nodes x {self.ranks_per_node} ranks")
        self.cross: CompressedAllreduce | None = None  # the shard's collective, made by bind()
        self.numel: int | None = None
        self._send: torch.Tensor | None = None
        self._recv: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    @property
    def any_flag(self) -> bool:
        return self._agreement.any_flag

    @property
    def flag_values(self) -> list[int]:
        return self._agreement.flag_values

    def bind(self, numel: int, device: torch.device | str) -> None:
        """Allocate the shard's collective (its error state) and the fp32 buffers for ``numel`` elements."""
        if self._bound(numel):
            return
        L, s = self.ranks_per_node, self.shard_len
        sg = shard_groups(numel, L, self.local_rank, self.groups, self.codec.block_size)
        # one rank per node by construction: fan out wherever gloo would otherwise ring (see CompressedAllreduce)
        gather = "fanout" if fans_out(self.cross_group, torch.device(device)) else "ring"
        self.cross = CompressedAllreduce(self.codec, self.mode, group=self.cross_group, counter=self.counter,
                                         verify="first", pieces=self.pieces, groups=sg, gather=gather)
        self.cross.bind(s, device)
        f32 = dict(dtype=torch.float32, device=device)
        self._send = torch.zeros(L * s, **f32)
        self._recv = torch.zeros(L, s, **f32)
        self._mean = torch.zeros(s, **f32)
        self._gathered = torch.zeros(L * s, **f32)
        # gloo's all_gather of large fp32 buffers is slower than an all_to_all of the same bytes (benchmarks/
        # RESULTS.md, "Measurements behind design choices"); there the shard goes out through all_to_all_single
        # from L copies of it in the (by then free) send buffer
        self._gather_by_all_to_all = L > 1 and dist.get_backend(self.local_group) == "gloo"

    def inter_node_bytes_per_call(self, numel: int) -> int:
        """Bytes this rank sends between nodes per call (its shard's compressed collective)."""
        sg = shard_groups(numel, self.ranks_per_node, self.local_rank, self.groups, self.codec.block_size)
        probe = TwoStageRank(self.codec, self.mode, self.node, self.nodes, pieces=self.pieces, groups=sg)
        return probe.bytes_per_call(_shard_len(numel, self.ranks_per_node))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, flag: int | torch.Tensor | None = None,
                 finite: bool | torch.Tensor | None = None) -> torch.Tensor:
        """The compressed mean of ``x`` over every rank of every node (bit-identical on all ranks);
        ``flag`` and ``finite`` ride in the agreement round as in :class:`~.allreduce.CompressedAllreduce`."""
        if isinstance(x, Source):  # the node's fp32 mean needs it in memory: in the send buffer, once bound
            x = x.materialize(out=self._send if self.numel == x.numel() else None)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError("HierarchicalAllreduce expects a floating-point tensor")
        self._agreement._agree(x, all_finite(x), flag, finite)  # every rank raises together on a mismatch or NaN
        self.bind(x.numel(), x.device)
        d, L, s = self.numel, self.ranks_per_node, self.shard_len
        if d == 0:
            return x.detach().clone() if out is None else out
        if x.data_ptr() != self._send.data_ptr() or x.numel() != d:
            self._send[:d].copy_(x.reshape(-1))
        if self._gather_by_all_to_all:
            self._send[d:].zero_()  # the padding held the last call's result
        if L > 1:
            dist.all_to_all_single(self._recv.view(-1), self._send, group=self.local_group)
            recv = self._recv
            self.intra_counter.add(_intra_node_bytes(L, s), d, L)
        else:
            recv = self._send.view(1, s)
        mean = _node_mean(recv, self._mean)
        if self._gather_by_all_to_all:
            blocks = self._send.view(L, s)
            reduced = self.cross(mean, out=blocks[self.local_rank])
            for j in range(L):
                if j != self.local_rank:
                    blocks[j].copy_(reduced)
            dist.all_to_all_single(self._gathered, self._send, group=self.local_group)
            full = self._gathered
        elif L > 1:
            reduced = self.cross(mean)
            _all_gather_single(self._gathered, reduced, group=self.local_group)
            full = self._gathered
        else:
            full = self.cross(mean)
        if out is None:
            return full[:d].to(x.dtype, copy=True).view_as(x)
        out.view(-1).copy_(full[:d])
        return out

    # -- state ------------------------------------------------------------------------------
    def state_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """The shard collective's state where it covers input elements ``[lo, hi)``."""
        if self.cross is None:
            return []
        s0 = self.local_rank * self.shard_len
        a, b = max(lo, s0), min(hi, s0 + self.shard_len)
        return self.cross.state_views(a - s0, b - s0) if a < b else []

    def reset_state(self) -> None:
        if self.cross is not None:
            self.cross.reset_state()

    def zero_state_at(self, idx: torch.Tensor) -> None:
        """Zero the shard collective's state at input positions ``idx`` that fall in this rank's shard."""
        if self.cross is None:
            return
        s0, s = self.local_rank * self.shard_len, self.shard_len
        self.cross.zero_state_at(idx[(idx >= s0) & (idx < s0 + s)] - s0)

    def state_dict(self) -> dict:
        return {"hierarchical": True, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "numel": self.numel, "cross": None if self.cross is None else self.cross.state_dict()}

    def load_state_dict(self, sd: dict, device: torch.device | str | None = None) -> None:
        if not sd.get("hierarchical"):
            raise ValueError("state was saved by a flat collective; this one is hierarchical")
        mine = (self.nodes, self.ranks_per_node)
        if (sd["nodes"], sd["ranks_per_node"]) != mine:
            raise ValueError(f"state was saved on {sd['nodes']} nodes x {sd['ranks_per_node']} ranks, this "
                             f"collective runs on {mine[0]} x {mine[1]}")
        if sd["numel"] is not None:
            self.bind(sd["numel"], device or "cpu")
            self.cross.load_state_dict(sd["cross"], device)


class SimulatedHierarchicalCluster(_Shards):
    """``nodes`` x ``ranks_per_node`` simulated ranks with exactly the arithmetic of
    :class:`HierarchicalAllreduce` (worker ``node * ranks_per_node + local_rank``): the node means
    are formed as the real call forms them, and local rank ``j``'s shard goes through a
    :class:`~.simulated.SimulatedCluster` of the ``nodes`` ranks with that local rank."""

    def __init__(self, codec: Codec, mode: str, nodes: int, ranks_per_node: int,
                 counter: ByteCounter | None = None, intra_counter: ByteCounter | None = None,
                 pieces: int | None = None, groups: Sequence[int] | None = None) -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"need nodes >= 1 and ranks_per_node >= 1, got {nodes} x {ranks_per_node}")
        self.codec, self.mode, self.pieces = codec, mode, pieces
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.groups = tuple(sorted({int(g) for g in groups})) if groups is not None else ()
        self.counter = counter if counter is not None else ByteCounter()  # rank 0's inter-node bytes
        self.intra_counter = intra_counter if intra_counter is not None else ByteCounter()
        self.clusters: list[SimulatedCluster] | None = None  # one per local rank (its shard)
        self.numel: int | None = None
        self.any_flag = False
        self.flag_values: list[int] = [0]  # every worker's flag in the last call, as in the distributed call

    def bind(self, numel: int, device: torch.device | str) -> None:
        if self._bound(numel):
            return
        L = self.ranks_per_node
        self.clusters = [SimulatedCluster(self.codec, self.mode, self.nodes, pieces=self.pieces,
                                          counter=self.counter if j == 0 else None,
                                          groups=shard_groups(numel, L, j, self.groups, self.codec.block_size))
                         for j in range(L)]
        for c in self.clusters:
            c.bind(self.shard_len, device)

    def allreduce(self, xs: Sequence[torch.Tensor], flags: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """The two-level compressed mean of ``xs`` (one per rank); ``flags``: ``flag_values`` and ``any_flag``."""
        xs = [x.materialize() if isinstance(x, Source) else x for x in xs]
        record_flags(self, xs, flags, "rank")
        bad = [r for r, x in enumerate(xs) if not bool(all_finite(x))]
        if bad:
            raise ValueError(f"SimulatedHierarchicalCluster: the input of rank(s) {bad} is not finite (NaN or "
                             "inf); every rank skipped this call and no state was changed")
        self.bind(xs[0].numel(), xs[0].device)
        d, L, N, s = self.numel, self.ranks_per_node, self.nodes, self.shard_len
        if d == 0:
            return [x.detach().clone() for x in xs]
        padded = []
        for x in xs:
            p = torch.zeros(L * s, dtype=torch.float32, device=x.device)
            p[:d].copy_(x.reshape(-1))
            padded.append(p.view(L, s))
        if L > 1:
            self.intra_counter.add(_intra_node_bytes(L, s), d, L)
        full = []
        for j in range(L):
            shards = [_node_mean(torch.stack([padded[k * L + i][j] for i in range(L)])) for k in range(N)]
            full.append(self.clusters[j].allreduce(shards)[0])
        result = torch.cat(full)[:d]
        return [result.to(x.dtype, copy=True).view_as(x) for x in xs]

    def allreduce_into(self, xs: Sequence[torch.Tensor], out: torch.Tensor,
                       flags: Sequence[bool] | None = None) -> torch.Tensor:
        """:meth:`allreduce` with the (common) result written into ``out`` and returned."""
        return out.copy_(self.allreduce(xs, flags)[0].view_as(out))

    # -- state: cluster j holds the state of shard j of every node ----------------------------
    def _shard_range(self, j: int, lo: int, hi: int) -> tuple[int, int]:
        s0 = j * self.shard_len
        return max(lo, s0) - s0, min(hi, s0 + self.shard_len) - s0

    def state_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        if self.clusters is None:
            return []
        out = []
        for j, c in enumerate(self.clusters):
            a, b = self._shard_range(j, lo, hi)
            if a < b:
                out += c.state_views(a, b)
        return out

    def zero_state_at(self, idx: torch.Tensor) -> None:
        if self.clusters is None:
            return
        s = self.shard_len
        for j, c in enumerate(self.clusters):
            c.zero_state_at(idx[(idx >= j * s) & (idx < (j + 1) * s)] - j * s)

    def reset_state(self) -> None:
        for c in self.clusters or ():
            for w in c.workers:
                w.reset_state()

    def state_dict(self) -> dict:
        return {"hierarchical": True, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "numel": self.numel, "clusters": [c.state_dict() for c in self.clusters or ()]}

    def load_state_dict(self, sd: dict, device: torch.device | str | None = None) -> None:
        if (sd["nodes"], sd["ranks_per_node"]) != (self.nodes, self.ranks_per_node):
            raise ValueError(f"state is for {sd['nodes']} x {sd['ranks_per_node']} ranks, this cluster has "
                             f"{self.nodes} x {self.ranks_per_node}")
        if sd["numel"] is not None:
            self.bind(sd["numel"], device or "cpu")
            for c, csd in zip(self.clusters, sd["clusters"], strict=True):
                c.load_state_dict(csd, device)

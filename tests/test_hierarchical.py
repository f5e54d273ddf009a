"""The two-level compressed allreduce on 2 nodes x 2 gloo ranks, against its simulation."""

import time

import pytest
import torch

from lightning_onebit.comm import (
    CompressedAllreduce,
    HierarchicalAllreduce,
    SimulatedCluster,
    SimulatedHierarchicalCluster,
    node_groups,
)
from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec

from dist_utils import run_ranks, values

NUMEL = 10_003
GROUPS = (0, 7, 4000, 5001, 5002, 9000)  # tensors inside and across the shard boundary (5002)
CODECS = {"sign": SignCodec, "minmax": MinMaxUInt8Codec}
CASES = [("sign", "error_feedback", 1), ("sign", "error_feedback", 3), ("sign", "markov", 1),
         ("minmax", "plain", 1)]


def _input(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step)
    return torch.randn(NUMEL, generator=g) * (1 + step)


def _hier(rank, world_size, ranks_per_node):
    local, cross = node_groups(ranks_per_node)
    out = {}
    for cname, mode, pieces in CASES:
        h = HierarchicalAllreduce(CODECS[cname](), mode, local_group=local, cross_group=cross, pieces=pieces,
                                  groups=GROUPS)
        results = [h(_input(rank, s)) for s in range(3)]
        state = h.cross.worker.numel() if h.cross.worker is not None else 0
        out[(cname, mode, pieces)] = (results, state, h.counter.bytes_sent, h.inter_node_bytes_per_call(NUMEL))
    flat = CompressedAllreduce(SignCodec(), "error_feedback", groups=GROUPS)
    flat(_input(rank, 0))
    return out, flat.worker.numel(), flat.row_bytes


def test_two_level_equals_its_simulation_bit_for_bit():
    ranks = values(run_ranks(_hier, 4, 2))
    for case in CASES:
        cname, mode, pieces = case
        sim = SimulatedHierarchicalCluster(CODECS[cname](), mode, nodes=2, ranks_per_node=2, pieces=pieces,
                                           groups=GROUPS)
        for s in range(3):
            expected = sim.allreduce([_input(r, s) for r in range(4)])
            for r in range(4):
                assert torch.equal(ranks[r][0][case][0][s], expected[r]), (case, r, s)
        exact = torch.stack([_input(r, 2) for r in range(4)]).mean(0)
        rel = (ranks[0][0][case][0][2] - exact).norm() / exact.norm()
        assert rel < 1.2, (case, float(rel))  # a compressed estimate of the mean, not noise


def test_error_state_and_inter_node_bytes_shrink_with_ranks_per_node():
    ranks = values(run_ranks(_hier, 4, 2))
    out, flat_state, flat_row = ranks[0]
    _, hier_state, sent, per_call = out[("sign", "error_feedback", 1)]
    assert sent == 3 * per_call  # the counter holds the inter-node (compressed) bytes only
    assert hier_state <= flat_state // 2 + 8  # the shard's error state: 1/L of the flat call's
    # flat: each rank sends a row to, and gathers its row to, the (N-1) L ranks on the other node
    flat_inter = 2 * (2 - 1) * 2 * flat_row
    assert flat_inter / per_call >= 1.8, (flat_inter, per_call)


def test_simulation_with_one_rank_per_node_is_the_flat_simulation():
    flat = SimulatedCluster(SignCodec(), "error_feedback", 3, groups=GROUPS)
    hier = SimulatedHierarchicalCluster(SignCodec(), "error_feedback", nodes=3, ranks_per_node=1, groups=GROUPS)
    for s in range(2):
        xs = [_input(r, s) for r in range(3)]
        assert torch.equal(flat.allreduce(xs)[0], hier.allreduce(xs)[0])


def _mismatch(rank, world_size, what):
    L = 2 if what != "layout" or rank else 1
    t0 = time.monotonic()
    try:
        local, cross = node_groups(L)
        h = HierarchicalAllreduce(SignCodec(), "error_feedback", local_group=local, cross_group=cross)
        x = _input(rank, 0)[: NUMEL - (rank == 3 and what == "numel")]
        if what == "nan" and rank == 2:
            x[5] = float("nan")
        h(x)
    except ValueError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("what,needle", [("numel", "disagree on numel"), ("nan", "not finite"),
                                         ("layout", "disagree on ranks_per_node")])
def test_mismatch_fails_fast_on_every_rank(what, needle):
    for msg, elapsed in values(run_ranks(_mismatch, 4, what, timeout_s=30)):
        assert msg is not None and needle in msg, msg
        assert elapsed < 10

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
from lightning_onebit.comm.hierarchical import shard_groups
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
    """Every codec and mode on 2 nodes x 2 ranks, against the simulation; then the state and bytes."""
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


def test_a_shard_keeps_the_block_phase_of_the_tensor_it_starts_inside():
    """Shard 1 of 1000 elements on 2 ranks per node starts at 500, inside the tensor at 300, whose blocks
    of 128 start at 428 and 556: the shard's first block ends at 556 (56 in the shard), as in the flat
    collective, so that an embedding row stays one block on either side of the shard boundary."""
    assert shard_groups(1000, 2, 1, [0, 300]) == [0]
    assert shard_groups(1000, 2, 1, [0, 300], block_size=128) == [0, 56]
    assert shard_groups(1000, 2, 1, [0, 300, 540], block_size=128) == [0, 40]  # the next tensor comes first
    assert shard_groups(1000, 2, 1, [0, 372], block_size=128) == [0]  # 500 is a block start already
    assert shard_groups(1000, 2, 0, [0, 300], block_size=128) == [0, 300]


def _mismatch(rank, world_size, what):
    L = 2 if what != "layout" or rank else 1
    t0 = time.monotonic()
    try:
        local, cross = node_groups(L)
        h = HierarchicalAllreduce(SignCodec(), "error_feedback", local_group=local, cross_group=cross)
        x = _input(rank, 0)[: NUMEL - (rank == 3 and what == "numel")]
        if what == "nan" and rank == 2:
            x[5] = float("nan")
        h(x, **({"finite": rank != 2} if what == "vouched" else {}))  # rank 2 vouches for a NaN elsewhere
    except ValueError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("what,needle", [("numel", "disagree on numel"), ("nan", "not finite"),
                                         ("vouched", "rank(s) [2] is not finite"),
                                         ("layout", "disagree on ranks_per_node")])
def test_mismatch_fails_fast_on_every_rank(what, needle):
    for msg, elapsed in values(run_ranks(_mismatch, 4, what, timeout_s=30)):
        assert msg is not None and needle in msg, msg
        assert elapsed < 10


# -- the optimizers on the two-level collective ---------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 4, 8))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 50, (8, 4), generator=g), torch.randint(0, 8, (8,), generator=g)


def _train(rank, world_size, hierarchical, via_ddp):
    import warnings

    from lightning_onebit import OnebitAdam

    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, warmup_steps=2)
    opt.set_topology(hierarchical=hierarchical, ranks_per_node=2)
    opt.set_nonfinite_policy("skip")
    net = torch.nn.parallel.DistributedDataParallel(model) if via_ddp else model
    if via_ddp:
        opt.attach(net)
    compressed_bytes = []
    for step in range(5):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        if step == 3 and rank == 3:  # compression phase, one rank of the second node
            model[3].weight.grad[0, 0] = float("nan")
        opt.step()
        compressed_bytes.append(opt.comm_counter.last.bytes_sent)
    kinds = {type(b.sync.comm).__name__ for b in opt._buckets}
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # a checkpoint of this layout, loaded into an optimizer of the other layout
    other = OnebitAdam(_model().parameters(), lr=1e-2, warmup_steps=2)
    other.set_topology(hierarchical=hierarchical is False, ranks_per_node=2)  # the other layout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(opt.state_dict())
    reset = [str(w.message) for w in caught if "error state was reset" in str(w.message)]
    return params, kinds, compressed_bytes[-1], opt.intra_node_counter.total.bytes_sent, reset, opt.skipped_steps


@pytest.mark.slow
@pytest.mark.parametrize("via_ddp", [True, False])
def test_optimizer_on_two_levels(via_ddp):
    """2 nodes x 2 ranks: the replicas stay identical (through a step one rank's NaN makes every rank
    skip), the buckets use the two-level collective, a compressed step sends >= 1.8x fewer bytes between
    nodes than the flat one, and a checkpoint of one layout resumes on the other with the error state
    reset (and a warning)."""
    hier = values(run_ranks(_train, 4, None, via_ddp))
    flat = values(run_ranks(_train, 4, False, via_ddp))
    for r in range(1, 4):
        assert torch.equal(hier[r][0], hier[0][0]) and torch.equal(flat[r][0], flat[0][0])
    assert {r[5] for r in hier + flat} == {1}
    assert hier[0][1] == {"HierarchicalAllreduce"} and flat[0][1] == {"CompressedAllreduce"}
    assert hier[0][3] > 0 and flat[0][3] == 0  # fp32 bytes inside the node only on two levels
    # flat: of a rank's 2 (n - 1) rows, those to the L ranks of the other node cross the slow link
    flat_inter = flat[0][2] * 2 / 3
    assert flat_inter / hier[0][2] >= 1.8, (flat[0][2], hier[0][2])
    assert not torch.equal(hier[0][0], flat[0][0])  # another collective, another compression error
    assert torch.isfinite(hier[0][0]).all()  # the arithmetic itself is checked bit for bit above
    for run in (hier, flat):
        assert run[0][4] and "two-level" in run[0][4][0] and "flat" in run[0][4][0]


def _dense_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 8))


def _dense_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 12, generator=g), torch.randint(0, 8, (8,), generator=g)


def _train_plain(rank, world_size):
    from lightning_onebit import OnebitAdam

    model = _dense_model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, warmup_steps=2)
    opt.set_topology(ranks_per_node=2)
    for step in range(5):
        x, y = _dense_batch(_who(rank, step), step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _who(rank: int, step: int) -> int:
    # gloo's fp32 allreduce of 4 ranks sums in its own order, which only equal inputs make exact: the
    # warm-up runs on one batch everywhere, the compressed steps (the two-level arithmetic) on each
    # rank's own. A dense model: an embedding's unseen rows would start to train through such an
    # fp32 allreduce too (the masked coordinates of OnebitAdam).
    return rank if step >= 2 else 0


def test_simulated_optimizer_equals_two_levels_of_real_ranks():
    """simulate_workers=4 with 2 ranks per node: the same parameters, bit for bit, as 4 gloo ranks."""
    from lightning_onebit import OnebitAdam

    real = values(run_ranks(_train_plain, 4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: the gradients' matmuls round alike
    try:
        model = _dense_model()
        opt = OnebitAdam(model.parameters(), lr=1e-2, warmup_steps=2, simulate_workers=4)
        opt.set_topology(ranks_per_node=2)
        for step in range(5):
            grads = []
            for r in range(4):
                model.zero_grad()
                x, y = _dense_batch(_who(r, step), step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                grads.append([None if p.grad is None else p.grad.clone() for p in opt.params_in_order()])
            opt.step_workers(grads)
    finally:
        torch.set_num_threads(threads)
    assert {type(b.sync.comm).__name__ for b in opt._buckets} == {"SimulatedHierarchicalCluster"}
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), real[0])


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_node_mean_kernel_is_the_fp64_formula(rows):
    """The numba node mean is the fp64 sum in local-rank order, / L, rounded once (any magnitudes)."""
    from lightning_onebit.comm.hierarchical import _node_mean

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 20_011, generator=g) * torch.logspace(-30, 30, 20_011)
    x[:, :5] = torch.tensor([3.4e38, -3.4e38, 1e-45, 0.0, -0.0])
    acc = x[0].double()
    for r in x[1:]:
        acc += r
    assert torch.equal(_node_mean(x), (acc / rows).float())


def test_all_finite_sees_every_nan_and_infinity():
    from lightning_onebit.comm import all_finite as _all_finite

    x = torch.randn(1001)
    assert bool(_all_finite(x)) and bool(_all_finite(torch.empty(0)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            y = x.clone()
            y[777] = bad
            assert not bool(_all_finite(y.to(dtype)))


def test_all_finite_many_sees_every_nan_and_infinity_and_leaves_every_bit():
    from lightning_onebit.comm.dense import all_finite_many

    # several dtypes at once, -0.0 and a subnormal among them: the check rewrites each value as itself
    xs = [torch.randn(1001), torch.randn(7, 3).to(torch.bfloat16), torch.randn(5).double(),
          torch.tensor([-0.0, 1e-42, 3.0]), torch.arange(4)]
    before = [x.clone() for x in xs]
    assert bool(all_finite_many(xs)) and bool(all_finite_many([]))
    def raw(t):
        return t.reshape(-1).view(torch.uint8)

    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(xs, before, strict=True))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for k in range(4):
            ys = [x.clone() for x in xs]
            ys[k].view(-1)[-1] = bad
            assert not bool(all_finite_many(ys)), (bad, k)


@pytest.mark.parametrize("hierarchical,ranks_per_node,world,chosen,logged", [
    (None, 2, 4, 2, None),  # several nodes of several ranks: two levels
    (None, 4, 4, None, None),  # one node: flat, nothing to say
    (None, 1, 4, None, None),  # one rank per node: flat
    (None, 3, 4, None, None),  # uneven: flat (automatic choice, no complaint)
    (True, 3, 4, None, "do not divide the world size 4"),  # asked for, impossible: flat, logged
    (True, None, 4, None, "ranks per node are unknown"),
    (False, 2, 4, None, None),
    (True, 2, 8, 2, None),
])
def test_automatic_choice_of_the_layout(caplog, hierarchical, ranks_per_node, world, chosen, logged):
    from lightning_onebit import OnebitAdam

    opt = OnebitAdam(_dense_model().parameters(), lr=1e-3, warmup_steps=1, simulate_workers=world)
    opt.set_topology(hierarchical=hierarchical, ranks_per_node=ranks_per_node)
    with caplog.at_level("WARNING", logger="lightning_onebit.comm.topology"):
        assert opt.topology.two_level(world_size=opt.simulate_workers) == chosen
    msgs = [r.getMessage() for r in caplog.records]
    if logged is None:
        assert not msgs
    else:
        assert any(logged in m and "falls back to flat" in m for m in msgs), msgs

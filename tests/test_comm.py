import time

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import (
    ByteCounter,
    CompressedAllreduce,
    NonFiniteInputError,
    SimulatedCluster,
    TwoStageRank,
    Verdict,
    check_together,
    duplex_twin,
    enable_duplex,
    ring_allreduce_bytes,
)
from lightning_onebit.comm.duplex import exchange_rows
from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec, TopKCodec

from dist_utils import run_ranks, values

CODECS = {
    "sign-l2": lambda: SignCodec("l2"),
    "sign-l1-blocked": lambda: SignCodec("l1", block_size=16),
    "minmax": lambda: MinMaxUInt8Codec(),
    "topk": lambda: TopKCodec(0.1),
}
MODES = ["plain", "error_feedback", "markov"]
SIZES = [1, 2, 37, 1000, 4099]
STEPS = 3


def _input(rank: int, step: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + numel)
    return (torch.randn(numel, generator=g) * (1 + step)).to(dtype)


# tensors of a bucket: boundaries inside code bytes, a 1-element tensor, one spanning chunks
GROUPS = (0, 3, 17, 18, 400, 777)


def _cases():
    for cname in CODECS:
        for mode in MODES:
            for numel in SIZES:
                yield cname, mode, numel, torch.float32, None
            yield cname, mode, 1000, torch.float32, GROUPS
    yield "sign-l2", "error_feedback", 333, torch.bfloat16, None
    yield "minmax", "plain", 333, torch.bfloat16, GROUPS[:4]


def _all_cases_on_rank(rank, world_size):
    assert enable_duplex()  # the default on gloo (the strategies call it); the piped test covers both paths
    out = {}
    for cname, mode, numel, dtype, groups in _cases():
        car = CompressedAllreduce(CODECS[cname](), mode, groups=groups)
        res = [car(_input(rank, s, numel, dtype)) for s in range(STEPS)]
        out[(cname, mode, numel, str(dtype), groups)] = (res, car.bytes_sent, car.row_bytes)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_equals_simulation_bit_for_bit(world_size):
    ranks = values(run_ranks(_all_cases_on_rank, world_size))
    for cname, mode, numel, dtype, groups in _cases():
        key = (cname, mode, numel, str(dtype), groups)
        sim = SimulatedCluster(CODECS[cname](), mode, world_size, groups=groups)
        for s in range(STEPS):
            expected = sim.allreduce([_input(r, s, numel, dtype) for r in range(world_size)])
            for r in range(world_size):
                got = ranks[r][key][0][s]
                assert got.dtype == dtype and got.shape == (numel,)
                assert torch.equal(got, ranks[0][key][0][s]), f"rank {r} differs from rank 0 {key}"
                assert torch.equal(got, expected[r]), f"rank {r} differs from the simulation {key} step {s}"
        res, bytes_sent, row_bytes = ranks[0][key]
        assert bytes_sent == STEPS * 2 * (world_size - 1) * row_bytes


def _subgroup(rank, world_size):
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    car = CompressedAllreduce(SignCodec(), "error_feedback", group=group)
    return [car(_input(rank, s, 100)) for s in range(2)]


def test_non_world_group():
    ranks = values(run_ranks(_subgroup, 3))
    sim = SimulatedCluster(SignCodec(), "error_feedback", 2)
    for s in range(2):
        expected = sim.allreduce([_input(1, s, 100), _input(2, s, 100)])
        assert torch.equal(ranks[1][s], expected[0]) and torch.equal(ranks[2][s], expected[1])


def test_message_views_of_a_callers_buffers_are_not_kept():
    """A rank keeps its persistent buffers' message views between calls, but not those of buffers a
    caller hands it fresh each call (the simulation's gathered rows): they would keep that memory alive."""
    sim = SimulatedCluster(MinMaxUInt8Codec(), "error_feedback", 2)
    kept = []
    for s in range(4):
        sim.allreduce([_input(1, s, 300), _input(2, s, 300)])
        kept.append([len(w._messages) for w in sim.workers])
    assert kept[1] == kept[3], kept


def _mismatch(rank, world_size, what):
    codec = SignCodec() if (what != "codec" or rank == 0) else MinMaxUInt8Codec()
    groups = [0, 10 + rank] if what == "groups" else None
    car = CompressedAllreduce(codec, "error_feedback", groups=groups)
    numel = 100 + (rank if what == "numel" else 0)
    x = torch.randn(numel)
    if what == "nan" and rank == 1:
        x[3] = float("nan")
    err_before = None
    if what in ("nan", "vouched"):
        car(torch.randn(numel))  # a good call first, so there is error state to protect
        err_before = car.worker.clone()
    # "vouched": a finite input, but rank 1 says its other data is not (the policy "skip")
    kw = {"finite": torch.tensor(rank != 1)} if what == "vouched" else {}
    t0 = time.monotonic()
    try:
        car(x, **kw)
    except ValueError as exc:
        unchanged = err_before is None or torch.equal(car.worker, err_before)
        if what in ("nan", "vouched"):
            assert isinstance(exc, NonFiniteInputError), type(exc)
        return str(exc), time.monotonic() - t0, unchanged
    return None, time.monotonic() - t0, True


@pytest.mark.parametrize("what,needle", [("numel", "disagree on numel"), ("codec", "disagree on codec kind"),
                                         ("groups", "disagree on groups"), ("nan", "not finite"),
                                         ("vouched", "rank(s) [1] is not finite")])
def test_mismatch_fails_fast_on_every_rank(what, needle):
    ranks = values(run_ranks(_mismatch, 2, what, timeout_s=30))
    for msg, elapsed, unchanged in ranks:
        assert msg is not None and needle in msg, msg
        assert elapsed < 5.0
        assert unchanged


def _begun_together(rank, world_size, bad):
    """Three calls begun, their agreements read together, then completed in order; with ``bad`` the
    last call's sizes differ between the ranks."""
    g = torch.Generator().manual_seed(rank)
    sizes = [300, 4000, 77 + (rank if bad else 0)]
    calls = [CompressedAllreduce(SignCodec(), "error_feedback") for _ in sizes]
    xs = [torch.randn(n, generator=g) for n in sizes]
    for c, x in zip(calls, xs, strict=True):
        c.begin(x)
    check_together(calls)
    read = all(c.in_flight.agreement.host is not None for c in calls)
    outs, msg = [], None
    try:
        for c in calls:
            c.send()
        for c in calls:
            c.relay()
        outs = [c.complete() for c in calls]
    except ValueError as exc:
        msg = str(exc)
        for c in calls:
            c.abandon()
    one_by_one = [] if bad else [CompressedAllreduce(SignCodec(), "error_feedback")(x) for x in xs]
    return read, msg, outs, one_by_one


@pytest.mark.parametrize("bad", [False, True])
def test_agreements_of_begun_calls_read_together(bad):
    """Several ranks: the calls' gathered signatures come to the host in one read, and each call still
    compares its ranks' fields (a disagreement in the last call raises on every rank)."""
    ranks = values(run_ranks(_begun_together, 2, bad, timeout_s=30))
    assert all(read for read, *_ in ranks)
    if bad:
        assert all(msg is not None and "disagree on numel" in msg for _, msg, *_ in ranks), ranks
        return
    for _, msg, outs, one_by_one in ranks:  # the calls' results, as each call alone gives them
        assert msg is None and all(torch.equal(a, b) for a, b in zip(outs, one_by_one, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][2], ranks[1][2], strict=True))


def _server_overflow(rank, world_size, mode, pieces):
    car = CompressedAllreduce(SignCodec(), mode, pieces=pieces)
    car(torch.ones(4000))
    car.server.fill_(3e38)  # the server's mean + state now overflow fp32 in the next call
    out = torch.full((4000,), 7.0)
    try:
        car(torch.full((4000,), 3e38), out=out)
        msg = None
    except ValueError as exc:
        msg = str(exc)
    zeroed = all(not t.any() for t in (car.worker, car.server, car.tilde) if t is not None)
    after = car(torch.randn(4000, generator=torch.Generator().manual_seed(rank)))
    return msg, bool((out == 7.0).all()), zeroed, after


@pytest.mark.parametrize("mode,pieces", [("error_feedback", 1), ("error_feedback", 3), ("markov", 1)])
def test_server_overflow_raises_on_every_rank(mode, pieces):
    """A server whose mean overflows fp32 (inputs near its limit): every rank raises before
    decoding (the result buffer untouched), resets its state alike and keeps working."""
    ranks = values(run_ranks(_server_overflow, 2, mode, pieces, timeout_s=30))
    for msg, untouched, zeroed, _ in ranks:
        assert msg is not None and "overflowed fp32" in msg, msg
        assert untouched and zeroed
    assert torch.equal(ranks[0][3], ranks[1][3]) and torch.isfinite(ranks[0][3]).all()
    sim = SimulatedCluster(SignCodec(), mode, 2, pieces=pieces)
    sim.allreduce([torch.ones(4000)] * 2)
    for w in sim.workers:
        w.server.fill_(3e38)
    with pytest.raises(ValueError, match="overflowed fp32"):
        sim.allreduce([torch.full((4000,), 3e38)] * 2)
    assert all(not w.worker.any() and not w.server.any() for w in sim.workers)


def test_bytes_match_formula():
    for n in (1, 2, 4, 8):
        for numel in (1, 1000, 2**20 + 5):
            counter = ByteCounter()
            sim = SimulatedCluster(SignCodec(), "error_feedback", n, counter=counter)
            sim.allreduce([torch.randn(numel) for _ in range(n)])
            seg = ((numel + n - 1) // n + 7) // 8 * 8
            nb = 1  # one tensor: one scale per chunk (the padding needs none)
            row = -(-(seg // 8) // 4) * 4 + 4 * nb  # codes padded to 4 bytes + fp32 scales
            assert counter.bytes_sent == 2 * (n - 1) * row
            if n > 1 and numel > 1000:
                ratio = ring_allreduce_bytes(numel, n) / counter.bytes_sent
                assert 31.5 < ratio <= 32.0, ratio
                assert counter.total.ratio_vs_fp32 == pytest.approx(ratio)
            q = SimulatedCluster(MinMaxUInt8Codec(), "plain", n)
            q.allreduce([torch.randn(numel) for _ in range(n)])
            assert q.counter.bytes_sent == 2 * (n - 1) * (-(-seg // 4) * 4 + 8 * nb)


@pytest.mark.parametrize("mode", ["error_feedback", "markov"])
def test_feedback_gap_stays_bounded(mode):
    """Sum of outputs tracks the sum of true means; without feedback the gap grows."""
    n, numel = 4, 2000
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(numel, generator=g) * torch.logspace(-2, 0, numel) for _ in range(n)]
    gaps = {}
    for m in (mode, "plain"):
        sim = SimulatedCluster(SignCodec(), m, n)
        acc_true, acc_out = torch.zeros(numel), torch.zeros(numel)
        g2 = torch.Generator().manual_seed(1)
        hist = []
        for _ in range(400):
            xs = [b + 0.3 * torch.randn(numel, generator=g2) * b.abs() for b in base]
            acc_true += torch.stack(xs).mean(0)
            acc_out += sim.allreduce(xs)[0]
            hist.append((acc_out - acc_true).norm().item())
        gaps[m] = hist
    fb, plain = gaps[mode], gaps["plain"]
    assert max(fb[200:]) < 2.0 * max(fb[50:200]), "feedback gap keeps growing"
    assert plain[-1] > 3 * plain[99], "without feedback the gap should grow ~linearly (4x here)"
    assert fb[-1] < plain[-1] / 10


def test_single_process_runs_both_stages():
    x = torch.randn(1000)
    car = CompressedAllreduce(SignCodec(), "error_feedback")
    y = car(x)
    assert car.world_size == 1 and car.bytes_sent == 0
    assert not torch.equal(x, y)  # compression error exists in one process too
    torch.testing.assert_close(car.worker, x - y)  # one-rank EF: worker error holds what was lost
    assert torch.equal(SimulatedCluster(SignCodec(), "error_feedback", 1).allreduce([x])[0], y)


def test_local_checks_of_begun_calls_in_one_read():
    """At world size 1 the begun calls' flags (input finite, previous server scales finite) are read
    together: when all hold no call reads its own; when one does not, each call raises as it would."""
    def begun(values, prev=None):
        calls = []
        for v in values:
            car = CompressedAllreduce(SignCodec(), "error_feedback")
            car._gathered_ok = prev  # what a GPU's previous call leaves (a device flag)
            car.begin(v)
            calls.append(car)
        return calls

    x, y = torch.randn(100), torch.randn(300)
    calls = begun([x, y], prev=torch.tensor(True))
    check_together(calls)
    assert all(c.in_flight.agreement[:2] == (None, True) for c in calls)  # nothing left to read
    outs = [(c.send(), c.relay(), c.complete())[-1] for c in calls]
    ref = [CompressedAllreduce(SignCodec(), "error_feedback")(v) for v in (x, y)]
    assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))

    calls = begun([x, torch.full((300,), float("nan"))])
    check_together(calls)
    calls[0].send()
    with pytest.raises(NonFiniteInputError, match="not finite"):
        calls[1].send()
    assert not calls[1].worker.any()  # no state written

    calls = begun([x, y], prev=torch.tensor(False))
    check_together(calls)
    with pytest.raises(ValueError, match="overflowed"):
        calls[0].send()


def test_state_dict_round_trip_continues_exactly():
    xs = [[torch.randn(300) for _ in range(3)] for _ in range(6)]
    a = SimulatedCluster(SignCodec(), "markov", 3)
    for s in range(3):
        a.allreduce(xs[s])
    b = SimulatedCluster(SignCodec(), "markov", 3)
    b.load_state_dict(a.state_dict())
    for s in range(3, 6):
        ya, yb = a.allreduce(xs[s]), b.allreduce(xs[s])
        assert all(torch.equal(u, v) for u, v in zip(ya, yb, strict=True))
    with pytest.raises(ValueError, match="mode"):
        SimulatedCluster(SignCodec(), "error_feedback", 3).load_state_dict(a.state_dict())


def test_a_verdict_of_gathered_signatures_ands_each_call_over_the_ranks():
    """With several ranks the host is sent the gathered signatures (one call's ``[ranks, len]``, or the last
    two fields of several calls', ``[calls, ranks, 2]``) and ANDs each call's (server, input) fields over the
    ranks when it reads them; what the device held is copied when the verdict is made."""
    a, b = object(), object()
    sig = torch.ones(3, 10, dtype=torch.int64)
    sig[1, -1] = 0  # rank 1's input was not finite
    verdict = Verdict(sig, [(a, "server"), (a, "input")], Verdict.buffers(sig), gathered=True)
    sig[1, -1] = 1  # the next call's gather reuses the buffer
    assert verdict.ready() and verdict.read() == (False, [])
    sigs = torch.ones(2, 3, 2, dtype=torch.int64)
    sigs[1, 2, 0] = 0  # call b: rank 2's previous server scales were not finite
    what = [(a, "server"), (a, "input"), (b, "server"), (b, "input")]
    finite, overflowed = Verdict(sigs, what, Verdict.buffers(sigs), gathered=True).read()
    assert finite and overflowed == [b]



def test_verdicts_sent_together_read_each_its_own_row():
    """DDP's hook's verdicts, one a bucket, made unsent and sent by ``step()`` in one copy: each reads its own
    bucket's flags as they were when sent (the collectives' buffers are rewritten by their next calls), the
    buffers are made once for a count and shape, and an unsent verdict cannot be read."""
    owners = [object() for _ in range(3)]
    sigs = [torch.ones(2, 10, dtype=torch.int64) for _ in owners]
    keep: dict = {}
    for step in range(3):
        sigs[step][0, -1] = 0  # this step, bucket `step` had a NaN on rank 0
        verdicts = [Verdict(s, [(o, "server"), (o, "input")], None, gathered=True)
                    for o, s in zip(owners, sigs, strict=True)]
        with pytest.raises(RuntimeError, match="never sent"):
            verdicts[0].ready()
        Verdict.send_together(verdicts, keep)
        sigs[step][0, -1] = 1  # the next calls' gathers reuse the buffers
        assert [v.read()[0] for v in verdicts] == [i != step for i in range(3)]
        assert len(keep) == 1
    lone = Verdict(torch.ones(1, dtype=torch.bool), [(owners[0], "input")], None)  # one rank's flags
    Verdict.send_together([lone], keep)
    assert lone.read() == (True, []) and len(keep) == 2

def test_object_is_bound_to_one_size():
    car = CompressedAllreduce(SignCodec(), "plain")
    car(torch.randn(10))
    with pytest.raises(ValueError, match="one object per tensor"):
        car(torch.randn(11))
    with pytest.raises(ValueError, match="mode"):
        CompressedAllreduce(SignCodec(), "nope")


# -- pipeline (column pieces) ---------------------------------------------------------------
PIPE_CODECS = {
    "sign-l2": lambda: SignCodec("l2"),
    "sign-l1-blocked": lambda: SignCodec("l1", block_size=16),
    "sign-l2-b4096": lambda: SignCodec("l2", block_size=4096),
    "minmax-b64": lambda: MinMaxUInt8Codec(block_size=64),
    "minmax-torch": lambda: MinMaxUInt8Codec(backend="torch"),
}


@pytest.mark.parametrize("cname", list(PIPE_CODECS))
def test_pieces_do_not_change_the_result(cname):
    """Everything a piece splits is elementwise: any piece count gives the same bits and state."""
    for mode in MODES:
        for n, numel, groups in ((1, 9000, None), (2, 100_003, None), (3, 40_000, None),
                                 (2, 100_003, (5, 33, 16_000, 49_999, 50_001, 70_000))):
            base = SimulatedCluster(PIPE_CODECS[cname](), mode, n, pieces=1, groups=groups)
            piped = SimulatedCluster(PIPE_CODECS[cname](), mode, n, pieces=5, groups=groups)
            for s in range(3):
                xs = [_input(r, s, numel) for r in range(n)]
                for a, b in zip(base.allreduce(xs), piped.allreduce(xs), strict=True):
                    assert torch.equal(a, b), (cname, mode, n, numel, s)
            assert base.workers[0].num_pieces == 1 and piped.workers[0].num_pieces > 1
            for wa, wb in zip(base.state_dict()["workers"], piped.state_dict()["workers"], strict=True):
                for key in ("worker", "server", "tilde"):
                    assert (wa[key] is None and wb[key] is None) or torch.equal(wa[key], wb[key]), key
            assert base.counter.bytes_sent == piped.counter.bytes_sent


def test_pipeline_plan():
    car = TwoStageRank(SignCodec(), "error_feedback", 0, 2)
    car.bind(25_000_000, "cpu")
    plan = car.plan
    assert len(plan) == 4  # automatic: MAX_PIECES pieces of >= MIN_PIECE elements
    assert plan[0].lo == 0 and plan[-1].hi == car.seg_len
    assert all(p.hi == q.lo and p.lo % 32 == 0 for p, q in zip(plan, plan[1:], strict=False))
    assert sum(p.rb for p in plan) == car.row_bytes
    small = TwoStageRank(SignCodec(), "error_feedback", 0, 2)
    small.bind(100_000, "cpu")
    assert small.num_pieces == 1  # pieces shorter than MIN_PIECE would cost more latency than they hide
    blocked = TwoStageRank(SignCodec(block_size=1000), "plain", 0, 1, pieces=8)
    blocked.bind(10_000, "cpu")
    # pieces may cut scale blocks (every piece uses the whole row's scales): only 4-byte packing counts
    assert blocked.num_pieces == 8 and all(p.lo % 32 == 0 for p in blocked.plan)
    assert any(p.lo % 1000 for p in blocked.plan)
    car.worker_device = torch.device("cuda")  # the plan's rule only: no GPU needed
    assert len(car._plan(car.seg_len)) == 1  # on CUDA automatic is one piece (launch count)
    car.pieces = 3
    assert len(car._plan(car.seg_len)) == 3  # an explicit count is kept
    topk = CompressedAllreduce(TopKCodec(0.1), "plain", pieces=4)
    topk(torch.randn(10_000))
    assert topk.num_pieces == 1  # top-k chooses entries per whole row
    with pytest.raises(ValueError, match="pieces"):
        CompressedAllreduce(SignCodec(), pieces=0)


PIPE_GROUPS = {"sign-l2": (7, 5000, 5001, 13_333), "sign-l1-blocked": None, "minmax-b64": (100, 9_999)}


def _piped_on_rank(rank, world_size):
    plain = CompressedAllreduce(SignCodec(), pieces=3)
    plain.bind(10, "cpu")
    out = {"no twin": plain._twin}
    assert enable_duplex()
    twin = duplex_twin()
    assert twin is not None and enable_duplex() and duplex_twin() is twin  # made once
    for cname, groups in PIPE_GROUPS.items():
        for mode in MODES:
            for gather, duplex in (("auto", True), ("ring", True), ("auto", False)):
                car = CompressedAllreduce(PIPE_CODECS[cname](), mode, pieces=3, groups=groups, gather=gather,
                                          duplex=duplex)
                res = [car(_input(rank, s, 20_011)) for s in range(2)]
                out[(cname, mode, gather, duplex)] = (res, car.num_pieces, car.bytes_sent, car.fanout,
                                                      car._twin is twin)
    # the exchange alone: rows of different lengths per call, several in flight, the same tag
    rows = [torch.arange(7) + 100 * rank + 10 * j for j in range(world_size)]
    got = [torch.empty(world_size, 7, dtype=torch.int64) for _ in range(3)]
    works = [exchange_rows(got[k], rows, twin=twin, async_op=True) for k in range(3)]
    for w in works:
        w.wait()
    out["exchange"] = got
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_pipelined_distributed_equals_unpipelined_simulation(world_size):
    """Pipelined, with the server rows fanned out (``auto`` on gloo, one host) or gathered by gloo's ring,
    each direction of a pair on its own connection (the duplex twin) or both on gloo's one (``duplex=False``):
    every way gives the unpipelined simulation's bits."""
    ranks = values(run_ranks(_piped_on_rank, world_size))
    assert ranks[0].pop("no twin") is None  # without enable_duplex the collectives are gloo's
    for r in range(world_size):
        exchanged = ranks[r].pop("exchange")
        expected = torch.stack([torch.arange(7) + 100 * j + 10 * r for j in range(world_size)])
        assert all(torch.equal(e, expected) for e in exchanged), (r, exchanged)
    for (cname, mode, gather, duplex), (_, pieces, sent, fanout, twinned) in ranks[0].items():
        assert pieces == 3 and fanout == (gather == "auto") and twinned == duplex
        sim = SimulatedCluster(PIPE_CODECS[cname](), mode, world_size, pieces=1, groups=PIPE_GROUPS[cname])
        key = (cname, mode, gather, duplex)
        for s in range(2):
            expected = sim.allreduce([_input(r, s, 20_011) for r in range(world_size)])
            for r in range(world_size):
                assert torch.equal(ranks[r][key][0][s], expected[r]), (key, r, s)
        assert sent == sim.counter.bytes_sent


def test_enable_duplex_needs_several_gloo_ranks():
    """Without torch.distributed (or on one rank) there is nothing to twin: no group is made."""
    assert not dist.is_initialized() and enable_duplex() is False and duplex_twin() is None


def _gather_choice(rank, world_size):
    import os
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it: 2 nodes of 2 ranks
    cars = [CompressedAllreduce(SignCodec(), gather=g) for g in ("auto", "fanout")]
    for c in cars:
        c.bind(10, "cpu")
    return [c.fanout for c in cars]


def test_auto_gather_keeps_the_ring_on_nodes_of_several_ranks():
    """A flat fan-out on nodes of 2 ranks would send each row to both ranks of the other node: ``auto`` keeps
    gloo's ring there, an explicit ``fanout`` is honoured; a bad value names itself."""
    for auto, fanout in values(run_ranks(_gather_choice, 4)):
        assert (auto, fanout) == (False, True)
    with pytest.raises(ValueError, match="gather must be"):
        CompressedAllreduce(SignCodec(), gather="tree")


def _straggler(rank, world_size):
    assert enable_duplex()  # the exchanges as point-to-point messages: their waits time out too
    # verify="first": after the first call no agreement round guards the data collectives
    car = CompressedAllreduce(SignCodec(), "error_feedback", verify="first", pieces=3)
    x = torch.randn(200_000)
    car(x)
    if rank == 1:
        time.sleep(12)  # alive, but never joins the second call
        return None
    t0 = time.monotonic()
    try:
        car(x)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.budget(40)  # waits for a timeout by design
def test_pipelined_call_honours_the_group_timeout():
    """The async piece collectives are waited on with the process group's timeout, not forever."""
    msg, elapsed = values(run_ranks(_straggler, 2, timeout_s=4))[0]
    # gloo words it by where the wait expired: "Timed out ..." or "Application timeout caused pair closure"
    assert msg is not None and ("Timed out" in msg or "timeout" in msg), msg
    assert elapsed < 10


def test_padding_does_not_count_in_a_scale():
    """9 elements on 2 ranks: chunk 1 holds one element and 7 of padding. Its scale is that element's
    own size, so a single element passes both 1-bit stages exactly (a diluted scale would shrink it
    by sqrt(8)), and no padding state builds up."""
    sim = SimulatedCluster(SignCodec(), "error_feedback", 2)
    xs = [torch.arange(9.0) - 3, torch.arange(9.0) * 2]
    out = sim.allreduce(xs)[0]
    assert out[8] == (xs[0][8] + xs[1][8]) / 2
    for w in sim.workers:
        assert not w.worker[9:].any() and (w.rank == 0 or not w.server[1:].any())


def _or_flags(rank, world_size):
    from lightning_onebit.comm import any_across
    from lightning_onebit.comm.dense import FANOUT_MAX_BYTES
    got = []
    # 13 flags (the last byte part padding) go fanned out; past FANOUT_MAX_BYTES as a BOR allreduce
    for numel in (13, 8 * (FANOUT_MAX_BYTES // (world_size - 1) + 1) + 5):
        counter = ByteCounter()
        flags = torch.zeros(numel, dtype=torch.bool)
        flags[[rank, numel - 1 - rank]] = True
        got.append((any_across(flags, None, counter), counter.total.bytes_sent))
    return got


# rank 0's indices go as 2 runs; rank 1's, scattered (18 runs), as a bit each of the domain; rank 2 has none
_SPARSE, _DOMAIN = {0: [range(5, 10), range(100, 102)], 1: [range(7, 60, 3)], 2: []}, 1003


def _sparse_case(rank):
    index = torch.tensor([i for r in _SPARSE[rank] for i in r], dtype=torch.int64)
    return index, torch.randn(index.numel(), generator=torch.Generator().manual_seed(rank))


def _sparse_rank(rank, world_size):
    from lightning_onebit.comm import enable_duplex, sparse_mean, sparse_row
    rows = [sparse_row(*_sparse_case(r), _DOMAIN) for r in range(world_size)]
    sizes = [row.numel() for row in rows]  # what the agreement round gathers
    got = []
    for duplex in (False, True):
        if duplex:
            assert enable_duplex()
        counter = ByteCounter()
        got.append((*sparse_mean(rows[rank], sizes, _DOMAIN, None, counter), counter.total.bytes_sent))
    return sizes, got


def test_sparse_mean_gathers_runs_and_averages_in_rank_order():
    """Each rank's indices go as runs, or as a bit each of the domain where that is shorter, with their
    values in one gather (rows padded to the longest; a rank with none sends an empty row): every rank
    gets the sorted union and the mean there, summed in rank order as the simulation sums (the first
    two ranks overlap at 7, so the order shows), with or without the duplex twin."""
    from lightning_onebit.comm import simulated_mean as _simulated_mean
    from lightning_onebit.comm import sparse_mean, sparse_mean_bytes, sparse_row
    dense = [torch.zeros(_DOMAIN).index_put_((i,), v) for i, v in map(_sparse_case, range(3))]
    want_index = torch.tensor(sorted({i for r in range(3) for run in _SPARSE[r] for i in run}))
    want = _simulated_mean(dense)[want_index]
    bitmask = -(-((_DOMAIN + 7) // 8) // 4) * 4
    for sizes, got in values(run_ranks(_sparse_rank, 3)):
        assert sizes == [8 + 16 * 2 + 4 * 7, 8 + bitmask + 4 * 18, 0]
        for index, mean, sent in got:
            assert torch.equal(index, want_index) and torch.equal(mean, want)
            assert sent == sparse_mean_bytes(sizes, 3) == 2 * 208
    index, vals = _sparse_case(0)  # one rank: its own values
    one_index, one_mean = sparse_mean(sparse_row(index, vals, _DOMAIN), [0], _DOMAIN, None)
    assert torch.equal(one_index, index) and torch.equal(one_mean, vals)


def test_any_across_ors_packed_bits():
    """gloo ORs the flags as bits, exactly: a few flags as one round of (n - 1) copies of their bytes (one round
    trip), many as a BOR allreduce of 1 bit each, whose bytes do not grow with n."""
    from lightning_onebit.comm import any_across_bytes
    from lightning_onebit.comm.dense import pack_bits, unpack_bits
    for (small, small_bytes), (big, big_bytes) in values(run_ranks(_or_flags, 3)):
        for got in (small, big):
            expected = torch.zeros(got.numel(), dtype=torch.bool)
            expected[[0, 1, 2, -3, -2, -1]] = True
            assert torch.equal(got, expected)
        assert small_bytes == any_across_bytes(13, 3) == 2 * 2
        assert big_bytes == any_across_bytes(big.numel(), 3) == ring_allreduce_bytes((big.numel() + 7) // 8, 3, 1)
    for n in (1, 7, 8, 9, 100):
        f = torch.rand(n) < 0.5
        assert torch.equal(unpack_bits(pack_bits(f), n), f)
    # the layout every rank and device agrees on: the first flag in the lowest bit, the tail padded
    f = torch.tensor([True, False, False, False, False, False, False, False, False, True, True])
    assert pack_bits(f).tolist() == [1, 6]
    assert unpack_bits(torch.tensor([1, 6], dtype=torch.uint8), 11).tolist() == f.tolist()


def _three_calls(duplex: bool) -> list:
    return [CompressedAllreduce(SignCodec(), group=None, duplex=duplex, pieces=1),
            CompressedAllreduce(MinMaxUInt8Codec(block_size=64), group=None, duplex=duplex, pieces=3, groups=[0, 900]),
            CompressedAllreduce(TopKCodec(0.1), mode="markov", group=None, duplex=duplex)]


def _phased_rank(rank, world_size):
    """Three collectives (one piece, three pieces, a top-k codec) run in phases interleaved, beside the
    same three run one call after another; then a NaN on rank 1 in the second call's agreement."""
    from lightning_onebit.comm import NonFiniteInputError
    assert enable_duplex()
    got = {}
    for duplex in (False, True):
        serial, phased = _three_calls(duplex), _three_calls(duplex)
        sizes = [1000, 4097, 777]
        for step in range(2):
            xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * step + 10 * rank + i))
                  for i, n in enumerate(sizes)]
            want = [c(x, flag=rank + i) for i, (c, x) in enumerate(zip(serial, xs, strict=True))]
            for i, (c, x) in enumerate(zip(phased, xs, strict=True)):
                c.begin(x, flag=rank + i)
            for phase in ("send", "relay"):
                for c in phased:
                    getattr(c, phase)()
            out = [c.complete() for c in phased]
            for i, (a, b, cs, cp) in enumerate(zip(want, out, serial, phased, strict=True)):
                assert torch.equal(a, b), (duplex, step, i)
                assert cp.flag_values == [r + i for r in range(world_size)] == cs.flag_values
                for name in ("worker", "server", "tilde"):
                    sa, sb = getattr(cs, name, None), getattr(cp, name, None)
                    assert (sa is None and sb is None) or torch.equal(sa, sb), (duplex, step, i, name)
        # a NaN on rank 1 fails the second call's agreement on every rank; the calls in flight are given up
        xs = [torch.ones(n) for n in sizes]
        if rank == 1:
            xs[1][5] = float("nan")
        for c, x in zip(phased, xs, strict=True):
            c.begin(x)
        phased[0].send()
        try:
            phased[1].send()
        except NonFiniteInputError as exc:
            got[duplex] = str(exc)
        for c in phased:
            c.abandon()
        # the group and the objects go on: a next call of each, interleaved, agrees on every rank
        for c in phased:
            c.begin(torch.full((c.numel,), float(rank)))
        for c in phased:
            c.send()
        got[(duplex, "after")] = [c.complete() for c in phased]
    return got


def test_phases_interleaved_equal_calls_one_after_another():
    """Several calls with their phases interleaved (every begin, then every send, relay and complete) give
    each call's result, state and flags bit for bit as calls one after another, on gloo's collectives and
    duplex; a failed agreement in the middle raises on every rank, and the calls given up leave nothing on
    the wire: the next calls run and agree."""
    ranks = values(run_ranks(_phased_rank, 3))
    for duplex in (False, True):
        for got in ranks:
            assert "rank(s) [1] is not finite" in got[duplex]
        for a, b in zip(ranks[0][(duplex, "after")], ranks[2][(duplex, "after")], strict=True):
            assert torch.equal(a, b) and bool(torch.isfinite(a).all())

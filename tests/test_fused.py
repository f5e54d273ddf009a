"""The fused step: payload sources read where they are, the server's mean read from its codes, the
decode that updates the parameters in its pass. Each is held to the unfused path's bits: the torch
reference backend, which materialises a Source with the torch ops that define it and applies a Sink
after decoding."""

import math

import pytest
import torch
from torch import nn

from lightning_onebit import OnebitAdam, OnebitLamb, QAdam, ZeroOneAdam
from lightning_onebit.comm import SimulatedCluster, TwoStageRank
from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec, Source
from lightning_onebit.compress.kernels import ENV_VAR, threads
from lightning_onebit.compress.source import Sink
from lightning_onebit.optim.functional import decoupled_update_


@pytest.fixture(params=["serial", "parallel"])
def numba_path(request, monkeypatch):
    if request.param == "parallel":
        monkeypatch.setattr(threads, "SERIAL_BELOW", 0)
    return request.param


def _sources(n=3000, groups=(0, 700, 710, 2000)):
    """Sources of every op and option over n elements in len(groups) tensors."""
    g = torch.Generator().manual_seed(0)
    start = torch.randn(n, generator=g)
    bounds = (*groups, n)
    ends = [torch.randn(b - a, generator=g) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    ends[1] = None  # a parameter without gradient: zeros
    flat = torch.cat([torch.zeros(b - a) if e is None else e for e, a, b in
                      zip(ends, bounds[:-1], bounds[1:], strict=True)])
    mask = torch.tensor([3, 4, 701, 1500, n - 1])
    factors = [0.5, 3.0, 1.25, 7.0]
    return {
        "lerp": Source.lerp(start, ends, 0.1, groups=groups),
        "lerp_big_weight": Source.lerp(start, flat, 0.9, groups=groups),
        "lerp_factors_mask": Source.lerp(start, ends, 0.1, groups=groups, factors=factors, mask=mask),
        "gradient_mask": Source.gradient(ends, numel=n, groups=groups, mask=mask),
        "quotient": Source.quotient(start, factors, groups=groups, mask=mask),
    }


@pytest.mark.parametrize("name", list(_sources()))
@pytest.mark.parametrize("codec", [SignCodec, MinMaxUInt8Codec])
def test_kernels_read_a_source_as_its_materialized_tensor(name, codec, numba_path):
    """Scales, codes and error state of a Source equal those of the tensor it stands for, whole, as
    a window (a pipeline piece: its base is not 0) and padded past its data."""
    src = _sources()[name]
    n = src.numel()
    fast, ref = codec(), codec(backend="torch")
    for x in (src, src[500:2500], src.padded(n + 40)):
        lay = fast.layout(x.numel(), 2 if x.numel() % 2 == 0 else 1, (0, 300))
        dense = x.materialize().clone()
        e1, e2 = torch.randn(x.numel()) * 0.1, None
        e2 = e1.clone()
        sc1 = fast.compute_scales(x, e1, "error_feedback", layout=lay)
        sc2 = ref.compute_scales(dense, e2, "error_feedback", layout=lay)
        assert torch.equal(sc1, sc2)
        a = fast.encode_error_feedback(x, e1, layout=lay)
        b = ref.encode_error_feedback(dense, e2, layout=lay)
        assert torch.equal(a.codes, b.codes) and torch.equal(e1, e2)
        assert torch.equal(fast.encode(x, layout=lay).codes, ref.encode(dense, layout=lay).codes)


def test_materialize_writes_into_the_buffer_it_is_given():
    """``materialize(out=)`` (the two-level call's send buffer) gives the same bits in that buffer; a
    masked position holds 0, or NaN where its gradient is not finite."""
    for name in _sources():
        ref = _sources()[name].materialize().clone()
        src = _sources()[name]
        buf = torch.full((src.numel() + 8,), 7.0)
        got = src.materialize(out=buf)
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, ref), name
        assert src[100:200].materialize().data_ptr() == buf[100:].data_ptr()  # windows share it
        win, buf = _sources()[name][100:200], torch.full((100,), 7.0)
        assert torch.equal(win.materialize(out=buf), ref[100:200]) and bool((buf == 7.0).all()), name
    src = _sources()["lerp_factors_mask"]
    src.end_tensors()[2][1500 - 710] = float("inf")
    x = src.materialize()
    assert torch.isnan(x[1500]) and bool((x[[3, 4, 701, 2999]] == 0).all())


def test_a_non_finite_gradient_at_a_masked_position_shows_in_the_scales():
    src = _sources()["lerp_factors_mask"]
    src.end_tensors()[2][1500 - 710] = float("nan")  # position 1500 (group 2 starts at 710) is masked
    _, ok = SignCodec().compute_scales_unchecked(src)
    assert not bool(ok)
    assert SignCodec().encode(Source.gradient(src.end, numel=src.valid, groups=src.groups, mask=src.mask,
                                              masked="zero")).scales.isfinite().all()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_server_stage_reads_the_mean_from_the_codes(world, numba_path):
    """The fused server stage (the workers' mean decoded inside its reduction and encode) against
    the torch backend's, through a whole simulated call."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5000, generator=g) for _ in range(world)]
    out = []
    for backend in (None, "torch"):
        cluster = SimulatedCluster(SignCodec(backend=backend), "error_feedback", world, groups=(0, 1234))
        for _ in range(3):
            res = cluster.allreduce([x.clone() for x in xs])
        out.append((res[0], [w.server.clone() for w in cluster.workers]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))


def test_a_source_rejects_bad_groups_every_time_and_a_sinks_geometry_does_not_vouch_for_one():
    # the offsets are checked once per geometry (a bucket's Source is made every step): bad ones raise on every
    # call, and a Sink's (which need no order) are not taken as a Source's check
    m, g = torch.zeros(8), torch.ones(8)
    for _ in range(2):
        with pytest.raises(ValueError, match="sorted offsets"):
            Source.lerp(m, g, 0.1, groups=[0, 6, 3])
    Sink(numel=8, groups=[0, 6, 3], targets=[None] * 3, denom=torch.ones(8), values=[0.0] * 3, decay=1.0)
    with pytest.raises(ValueError, match="sorted offsets"):
        Source.lerp(m, g, 0.1, groups=[0, 6, 3])
    assert Source.lerp(m, g, 0.5, groups=[0, 3]).materialize().tolist() == [0.5] * 8


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_deferred_decode_with_a_sink_is_the_decode_then_adamws_update(pieces, numba_path):
    """decode_pending(sink): the result as the call would have returned it, the masked coordinates
    zero, and the parameters moved by AdamW's last line (decoupled_update_'s bits)."""
    n, groups = 9000, (0, 4000, 4100)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, generator=g)
    params = [torch.randn(4000, generator=g), torch.randn(100, generator=g), torch.randn(n - 4100, generator=g)]
    denom = torch.rand(n, generator=g) + 0.1
    mask = torch.tensor([5, 4050, 8999])
    sizes, lr, wd = [1e-2, 2e-3, 5e-3], 1e-3, 0.1
    plain = TwoStageRank(SignCodec(), "error_feedback", 0, 1, pieces=pieces, groups=groups)
    deferred = TwoStageRank(SignCodec(), "error_feedback", 0, 1, pieces=pieces, groups=groups)
    for rank in (plain, deferred):
        xp, sc, _ = rank.prepare(x)
        for k in range(rank.num_pieces):
            rank.encode_stage(xp, sc, k)
            rank.server_receive(rank._send[k], k)
        for k in range(rank.num_pieces):
            rank.server_send(k)
    expect = torch.empty(n)
    dst = plain.result_buffer(expect, torch.float32)
    for k in range(plain.num_pieces):
        plain.finish_piece(plain._srv[k], dst, k)
    plain.finish(dst, expect, torch.float32)
    expect[mask] = 0.0
    ref_params = [p.clone() for p in params]
    decoupled_update_(ref_params[:1] + ref_params[2:], [expect[:4000], expect[4100:]],
                      [denom[:4000], denom[4100:]], [sizes[0], sizes[2]], lr=lr, weight_decay=wd)
    got = torch.empty(n)
    deferred._keep_pending(deferred._srv, deferred.result_buffer(got, torch.float32), got, torch.float32)
    views = [params[0], None, params[2]]  # the second has no gradient: untouched
    deferred.decode_pending(Sink(numel=n, groups=groups, targets=views, denom=denom, values=[-s for s in sizes],
                                 decay=1 - lr * wd, mask=mask))
    assert torch.equal(got, expect)
    assert all(torch.equal(p, r) for p, r in zip(params, ref_params, strict=True))


class _Block(nn.Module):
    """Where compression breaks: an embedding with unused rows, LayerNorm, attention, biases next to
    a wide layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.ln = nn.LayerNorm(32)
        self.att = nn.MultiheadAttention(32, 4, batch_first=True)
        self.wide = nn.Linear(32, 512)
        self.out = nn.Linear(512, 5)
        self.unused = nn.Linear(3, 3)  # never gets a gradient

    def forward(self, idx):
        h = self.ln(self.emb(idx))
        h = h + self.att(h, h, h, need_weights=False)[0]
        return self.out(torch.relu(self.wide(h))).mean(1)


def _fit(make, workers, steps, seed=0):
    torch.manual_seed(seed)
    model = _Block()
    params = list(model.parameters())
    opt = make(params, {"simulate_workers": workers} if workers > 1 else {})
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        grads = []
        for _w in range(workers):
            model.zero_grad()
            idx = torch.randint(0, 20, (4, 6), generator=g)  # rows 20.. never used: masked at the switch
            nn.functional.cross_entropy(model(idx), torch.randint(0, 5, (4,), generator=g)).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
        if workers > 1:
            opt.step_workers(grads)
        else:
            opt.step()
    state = [v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in params], state


OPTIMIZERS = {
    "onebit_adam": lambda ps, kw: OnebitAdam(ps, lr=1e-2, weight_decay=0.01, warmup_steps=3, **kw),
    "onebit_adam_blocks": lambda ps, kw: OnebitAdam(ps, lr=1e-2, warmup_steps=3, block_size=64,
                                                    bucket_cap_mb=0.02, **kw),
    "qadam": lambda ps, kw: QAdam(ps, lr=1e-2, warmup_steps=3, **kw),
    "onebit_lamb": lambda ps, kw: OnebitLamb(ps, lr=1e-2, warmup_steps=3, weight_decay=0.01, **kw),
    "zero_one_adam": lambda ps, kw: ZeroOneAdam(ps, lr=1e-2, var_freeze_step=4, var_update_scaler=1,
                                                local_step_scaler=1, local_step_clipper=2, **kw),
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_fused_step_has_the_bits_of_the_reference_path(name, workers, monkeypatch):
    """Every optimizer on the numba backend (sources, in-place gradients, fused server and decode)
    against the same run on the torch reference backend, bit for bit."""
    fused = _fit(OPTIMIZERS[name], workers, 8)
    monkeypatch.setenv(ENV_VAR, "torch")
    ref = _fit(OPTIMIZERS[name], workers, 8)
    for a, b in zip(fused[0] + fused[1], ref[0] + ref[1], strict=True):
        assert torch.equal(a, b)


def test_state_dict_between_a_deferred_sync_and_the_update(fresh_process_group):
    """With DDP the compressed sync runs in backward and its decode waits for step(): a state_dict
    taken in between holds the synchronised momentum, and the step then updates as it would have."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def run(peek):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2)))
        opt = OnebitAdam(ddp.parameters(), lr=1e-2, warmup_steps=2)
        opt.attach(ddp)
        g = torch.Generator().manual_seed(3)
        seen = None
        for step in range(5):
            opt.zero_grad()
            ddp(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
            if peek and step == 4:
                assert any(b.sync.deferred for b in opt._buckets)
                seen = [v["exp_avg"].clone() for v in opt.state_dict()["state"].values()]
            opt.step()
        return [p.detach().clone() for p in ddp.parameters()], opt, seen

    params, opt, seen = run(True)
    ref_params, ref_opt, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    ref_m = [v["exp_avg"] for v in ref_opt.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(seen, ref_m, strict=True))


def _pairs(shapes, seed):
    """The same values twice: contiguous (the numba kernels) and as transposed views (the torch ops)."""
    g = torch.Generator().manual_seed(seed)
    fast = [torch.randn(s, generator=g) for s in shapes]
    slow = [t.t().contiguous().t() for t in fast]  # equal values, not contiguous
    assert not any(t.is_contiguous() for t in slow)
    return fast, slow


@pytest.mark.parametrize("fn", ["local_adam_step_", "lamb_moments_", "scaled_step_", "shift_in_"])
def test_functional_kernels_have_the_bits_of_their_torch_ops(fn, numba_path):
    from lightning_onebit.optim import functional as F
    from lightning_onebit.optim import functional_lamb as FL

    shapes = [(300, 70), (40, 3), (2, 17000)]
    sets = [_pairs(shapes, k) for k in range(6)]
    fast, slow = [s[0] for s in sets], [s[1] for s in sets]
    for ts in (fast[3], slow[3]):  # denominators: positive
        for t in ts:
            t.abs_().add_(0.1)
    sizes = [1e-2, 3e-3, 5e-4]
    outs, maxima = [], []
    for p, g, m, d, u, f in (fast, slow):
        if fn == "local_adam_step_":
            mask = [None, torch.arange(120).reshape(40, 3) % 7 == 0, None]
            F.local_adam_step_(p, [g[0], None, g[2]], m, u, d, mask, sizes, beta1=0.9, lr=1e-3, weight_decay=0.1)
            outs.append(p + m + u)
        elif fn == "lamb_moments_":
            f = [t.abs() for t in f]
            mx = FL.lamb_moments_(m, g, f, d, u, [0.5, 0.25, 0.125], beta1=0.9, beta2=0.999, eps=1e-8,
                                 eps_inside_sqrt=True)
            outs.append(f + u)
            maxima.append(mx)
        elif fn == "scaled_step_":
            FL.scaled_step_(p, u, sizes, [0.99, 1.0, 0.5])
            outs.append(p)
        else:
            FL.shift_in_(p, m, u, [0.5, 3.0, 1.7])
            outs.append(p + m)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    if fn == "lamb_moments_":  # IEEE's square root against torch's vectorised one: an ulp apart at most
        torch.testing.assert_close(maxima[0], maxima[1], rtol=2.4e-7, atol=0)


def test_lamb_moments_and_shift_on_whole_buffers_have_the_bits_of_the_per_tensor_ops(monkeypatch):
    """Where the torch ops run (a GPU), 1-bit LAMB's moments and its shift of the momentum run once on a bucket's
    buffers: the bits of the ops run per tensor (an empty tensor's maximum -inf), the maxima an ulp apart at most
    on a CPU, whose vectorised square root rounds a tensor's tail apart from its SIMD lanes."""
    from lightning_onebit.optim import functional as F
    from lightning_onebit.optim import functional_lamb as FL

    monkeypatch.setattr(F, "_fusable", lambda *tensors: False)
    sizes = [300, 0, 7, 4099]
    g = torch.Generator().manual_seed(5)
    runs = []
    for whole in (True, False):
        g.manual_seed(5)
        m, prev, f, d, u, new = (torch.randn(sum(sizes), generator=g) for _ in range(6))
        f.abs_()
        d.abs_().add_(0.1)
        views = [list(t.split(sizes)) for t in (m, prev, f, d, u, new)]
        flat = FL.Flat(m, prev, f, d, u, torch.tensor(sizes), torch.empty(sum(sizes))) if whole else None
        mx = FL.lamb_moments_(*views[:5], [0.25] * 4, beta1=0.9, beta2=0.999, eps=1e-8, eps_inside_sqrt=True,
                             flat=flat)
        FL.shift_in_(views[1], views[0], views[5], [0.5, 1.0, 3.0, 1.7], flat=(prev, m) if whole else None)
        runs.append((mx, m, prev, f, u))
    (mx, *ts), (ref_mx, *ref) = runs
    assert all(torch.equal(a, b) for a, b in zip(ts, ref, strict=True))
    assert mx[1] == ref_mx[1] == -math.inf
    torch.testing.assert_close(mx, ref_mx, rtol=2.4e-7, atol=0)


def test_lamb_moments_of_an_empty_tensor_is_minus_inf(numba_path):
    """A rank's shard of a small tensor can be empty (FSDP2): its maximum is -inf, the identity of the max the
    shards' maxima are reduced with, on the fused path and on torch's."""
    from lightning_onebit.optim import functional_lamb as FL

    for make in (torch.ones, lambda n: torch.ones(n, 2).t()[0]):  # contiguous, then strided (torch's ops)
        ts = [[make(0), make(3)] for _ in range(5)]
        mx = FL.lamb_moments_(*ts, [0.5, 0.5], beta1=0.9, beta2=0.999, eps=1e-8, eps_inside_sqrt=True)
        assert mx[0] == -math.inf and math.isfinite(float(mx[1]))

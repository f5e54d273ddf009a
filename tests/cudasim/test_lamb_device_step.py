"""1-bit LAMB's compressed step as a GPU takes it: the synced momentum decoded by the update and shifted in by the
statistics kernel, its layer statistics and its scaled step by the cuda backend's kernels, one launch each a
bucket, and its layer factors computed on the device, with no host read, against the same step with the result
shifted in by torch's ops as the sync finishes, the factors read and the scaled step run by torch's ops; and a
checkpoint of the device's factors written and reloaded. The statistics kernel against its summation order and
torch's ratios.

Runs under numba's CUDA simulator (tests/test_cuda_simulator.py starts it), where CPU tensors stand in for
device memory; ``optim.functional``'s CPU kernels are switched off, as on a GPU, where torch's ops run.
"""

import io
import math

import numpy as np
import pytest
import torch
from torch import nn

import lightning_onebit.optim.functional as functional
import lightning_onebit.optim.functional_lamb as functional_lamb
from lightning_onebit.compress.kernels import numba_cuda as kc
from lightning_onebit.compress.kernels.layout import REDUCE_LANES, REDUCE_TILE
from lightning_onebit.optim import OnebitLamb, local_steps


def test_the_scaled_step_kernel_has_the_bits_of_the_cpu_step():
    g = torch.Generator().manual_seed(0)
    sizes, offsets = [7, 633, 800], [0, 7, 640]
    u = torch.randn(1440, generator=g)
    steps = torch.rand(3, generator=g) * 0.5  # large steps: a rounding of s * u of its own would show
    decays = (1 - steps * 0.3).float()
    decays[0] = 1.0  # torch's step skips the multiply at 1
    params = [torch.randn(n, generator=g) for n in sizes]
    views = [u[o:o + n] for o, n in zip(offsets, sizes, strict=True)]
    numba_ref = [p.clone() for p in params]
    functional_lamb.scaled_step_(numba_ref, views, steps.tolist(), decays.tolist())  # the CPU kernel
    torch_ref = [p.clone() for p in params]
    for p, v, s, d in zip(torch_ref, views, steps.tolist(), decays.tolist(), strict=True):  # a GPU's torch ops
        if d != 1.0:
            p.mul_(d)
        p.add_(v, alpha=-s)
    assert all(torch.equal(a, b) for a, b in zip(numba_ref, torch_ref, strict=True))
    twice = [p * d - v * torch.tensor(s) for p, v, s, d in zip(params, views, steps.tolist(), decays, strict=True)]
    assert not all(torch.equal(a, b) for a, b in zip(twice, torch_ref, strict=True))  # one rounding, not two
    out = [p.clone() for p in params]
    kc.scaled_step([out[0], None, out[2]], u, offsets, steps, decays)  # the middle parameter is left alone
    assert torch.equal(out[0], torch_ref[0]) and torch.equal(out[2], torch_ref[2])
    assert torch.equal(out[1], params[1])
    kc.scaled_step(out, u, offsets, steps, decays, go=torch.zeros(1, dtype=torch.bool))  # a step skipped: nothing
    assert torch.equal(out[0], torch_ref[0]) and torch.equal(out[1], params[1])
    functional_lamb.scaled_step_(out, views, steps.tolist(), decays.tolist(), go=torch.zeros(1, dtype=torch.bool))
    assert torch.equal(out[0], torch_ref[0]) and torch.equal(out[1], params[1])  # the CPU kernel's path alike
    with pytest.raises(ValueError, match="fp32"):
        kc.scaled_step(out, u, offsets, steps.double(), decays)
    with pytest.raises(ValueError, match="of their offsets' sizes"):  # it would write past the parameter
        kc.scaled_step([out[0], out[1][:-1], out[2]], u, offsets, steps, decays)
    assert torch.equal(out[0], torch_ref[0])  # nothing written


def _in_layout_order(v: np.ndarray) -> float:
    """The sum of fp64 ``v`` in :mod:`layout`'s order: tiles of REDUCE_TILE, 32 lanes summed in order each, the
    halving tree, the tiles in order."""
    total = 0.0
    for lo in range(0, v.size, REDUCE_TILE):
        tile = v[lo:lo + REDUCE_TILE]
        lanes = [float(np.cumsum(tile[j::REDUCE_LANES])[-1]) if tile[j::REDUCE_LANES].size else 0.0
                 for j in range(REDUCE_LANES)]
        h = REDUCE_LANES // 2
        while h:
            lanes[:h] = [lanes[j] + lanes[j + h] for j in range(h)]
            h //= 2
        total += lanes[0]
    return total


@pytest.mark.parametrize("inside", [True, False])
def test_the_layer_stats_kernel_sums_in_the_layout_order_and_takes_torch_s_ratios(inside):
    g = torch.Generator().manual_seed(1)
    sizes = [5, 0, REDUCE_TILE + 808, 300]  # an empty layer, one of two tiles
    offsets = [0, 5, 5, 5 + REDUCE_TILE + 808]
    n = sum(sizes)
    u, d = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5
    fresh = torch.rand(n, generator=g) * 2
    params = [torch.randn(k, generator=g) for k in sizes]
    out = torch.full((4, 4), 7.0)
    kc.lamb_stats(params, u, d, fresh, offsets, out, eps=1e-3, eps_inside_sqrt=inside)
    f32 = np.float32
    fn, dn = fresh.numpy(), d.numpy()
    df = np.sqrt(fn + f32(1e-3)) if inside else np.sqrt(fn) + f32(1e-3)  # IEEE's fp32 square root
    ratio = dn / df
    for k, (lo, size) in enumerate(zip(offsets, sizes, strict=True)):
        x, q = u[lo:lo + size].double().numpy(), params[k].double().numpy()
        want = [float(ratio[lo:lo + size].max()) if size else -math.inf,
                *(float(f32(_in_layout_order(a * b))) for a, b in ((x, x), (x, q), (q, q)))]
        assert out[:, k].tolist() == want
    exact = float((u[5:5 + sizes[2]].double() * params[2].double()).sum())
    assert out[2, 2].item() == pytest.approx(exact, rel=1e-6)
    wide = torch.full((4, 9), 7.0)  # a group's buffer: this bucket's layers from column 3, the rest left alone
    kc.lamb_stats(params, u, d, fresh, offsets, wide, eps=1e-3, eps_inside_sqrt=inside, column=3)
    assert torch.equal(wide[:, 3:7], out) and (wide[:, :3] == 7).all() and (wide[:, 7:] == 7).all()
    # a NaN ratio makes its layer's maximum NaN (torch's maximum), the others' stay; without dot products
    # only the maxima are written
    fresh[7] = float("nan")
    top = torch.zeros(1, 4)
    kc.lamb_stats(params, u, d, fresh, offsets, top, eps=1e-3, eps_inside_sqrt=inside)
    assert math.isnan(top[0, 2]) and top[0, [0, 3]].tolist() == out[0, [0, 3]].tolist() and top[0, 1] == -math.inf
    with pytest.raises(ValueError, match="of their offsets' sizes"):  # it would read past the parameter
        kc.lamb_stats([params[0], params[1], params[2][:-1], params[3]], u, d, fresh, offsets, out, eps=1e-3,
                      eps_inside_sqrt=inside)
    with pytest.raises(ValueError, match=r"\[4 or 1, 4\]"):
        kc.lamb_stats(params, u, d, fresh, offsets, out[:, :3], eps=1e-3, eps_inside_sqrt=inside)
    with pytest.raises(ValueError, match="4 columns from column 6"):  # it would write past the buffer
        kc.lamb_stats(params, u, d, fresh, offsets, wide, eps=1e-3, eps_inside_sqrt=inside, column=6)
    with pytest.raises(ValueError, match="fresh has"):
        kc.lamb_stats(params, u, d, fresh[1:], offsets, out, eps=1e-3, eps_inside_sqrt=inside)


@pytest.mark.parametrize("inside", [True, False])
def test_the_layer_stats_kernel_writes_the_moments_with_the_cpu_kernel_s_bits(inside):
    g = torch.Generator().manual_seed(2)
    sizes, offsets = [300, 0, 5, 711], [0, 300, 300, 305]
    n = sum(sizes)
    m, prev, d = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5
    fresh = torch.rand(n, generator=g)
    params = [torch.randn(k, generator=g) for k in sizes]
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-6, eps_inside_sqrt=inside)
    f_cpu, u_cpu = fresh.clone(), torch.empty(n)
    split = [list(t.split(sizes)) for t in (m, prev, f_cpu, d, u_cpu)]
    maxima = functional_lamb.lamb_moments_(*split, [0.7] * len(sizes), **kw)  # numba's CPU kernel
    mask = torch.tensor([3, 310, 700])
    u_cpu[mask] = 0.0
    f_dev, u_dev, out = fresh.clone(), torch.full((n,), 9.0), torch.empty(4, len(sizes))
    kc.lamb_stats(params, u_dev, d, f_dev, offsets, out, exp_avg=m, prev=prev, mask=mask, bias_correction=0.7,
                  **kw)
    assert torch.equal(f_dev, f_cpu) and torch.equal(u_dev, u_cpu)
    assert torch.equal(out[0], maxima)
    # the dot products are those of the update it wrote, masked
    ref = torch.empty(4, len(sizes))
    kc.lamb_stats(params, u_cpu, d, f_cpu, offsets, ref, eps=1e-6, eps_inside_sqrt=inside)
    assert torch.equal(out, ref)


def test_the_layer_stats_kernel_shifts_the_synced_momentum_in_as_torch_does_and_writes_nothing_unless_go():
    g = torch.Generator().manual_seed(4)
    sizes, offsets = [300, 0, 5, 711], [0, 300, 300, 305]
    n = sum(sizes)
    m, synced, d = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3, torch.rand(n, generator=g) + 0.5
    fresh, prev = torch.rand(n, generator=g), torch.randn(n, generator=g)
    params = [torch.randn(k, generator=g) for k in sizes]
    divisors = [0.37, 1.0, 3.1, 0.9]  # the layers' scaling coefficients: a division each, not a reciprocal's product
    mask = torch.tensor([3, 310, 700])
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-6, eps_inside_sqrt=True, bias_correction=0.7, mask=mask)
    # what the host does: torch's shift (copy, foreach division), the mask's fill, then the kernel
    want = [t.clone() for t in (m, prev, fresh)]
    functional_lamb.shift_in_(want[1].split(sizes), want[0].split(sizes), synced.split(sizes), divisors)
    want[0][mask] = 0.0
    u_want, out_want = torch.empty(n), torch.empty(4, 4)
    kc.lamb_stats(params, u_want, d, want[2], offsets, out_want, exp_avg=want[0], prev=want[1], **kw)
    got = [t.clone() for t in (m, prev, fresh)]
    u, out = torch.empty(n), torch.empty(4, 4)
    div = torch.tensor(divisors)
    kc.lamb_stats(params, u, d, got[2], offsets, out, exp_avg=got[0], prev=got[1], synced=synced, divisors=div, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(u, u_want) and torch.equal(out, out_want)
    # a step the device decided to skip: no buffer, statistic or counter written
    before = [t.clone() for t in (*got, u, out)]
    kc.lamb_stats(params, u, d, got[2], offsets, out, exp_avg=got[0], prev=got[1], synced=synced, divisors=div,
                  go=torch.zeros(1, dtype=torch.bool), **kw)
    assert all(torch.equal(a, b) for a, b in zip((*got, u, out), before, strict=True))
    with pytest.raises(ValueError, match="synced and divisors together"):
        kc.lamb_stats(params, u, d, got[2], offsets, out, exp_avg=got[0], prev=got[1], synced=synced, **kw)
    with pytest.raises(ValueError, match="divisors has 3 elements"):
        kc.lamb_stats(params, u, d, got[2], offsets, out, exp_avg=got[0], prev=got[1], synced=synced,
                      divisors=div[:3], **kw)


@pytest.mark.parametrize("wd", [0.0, 0.07])
def test_the_factors_kernel_has_the_bits_of_the_torch_ops(wd):
    g = torch.Generator().manual_seed(3)
    n = 40
    stats = torch.rand(4, n, generator=g) * 3
    stats[2] -= 1.5  # <u, p> of either sign
    stats[0, :6] = torch.tensor([9.0, 0.1, 1.0, float("nan"), 2.0, 1.0])  # clipped both ways, NaN
    stats[1:, 6] = 0.0  # ||u + wd p|| = 0: the share is undefined
    stats[1, 7], stats[2, 7] = 1e-30, -1e-30  # a tiny norm
    stats[2, 8] = float("nan")
    last = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5)
    freeze = torch.rand(n, generator=g, dtype=torch.float64) * 2
    kw = dict(lr=3e-3, factor_threshold=0.1, factor_min=0.5, factor_max=4.0)
    rows = stats if wd else stats[:1].contiguous()
    want = (last.clone(), torch.empty(n), torch.empty(n))  # the torch ops (the CPU's backend has no kernel)
    functional_lamb.layer_factors_(rows, want[0], freeze, weight_decay=wd, **kw, out=want[1:],
                                   work=torch.empty(len(rows) + 1, n, dtype=torch.float64),
                                   undefined=torch.empty(n, dtype=torch.bool))
    got_last, steps, decays = last.clone(), torch.empty(n), torch.empty(n)
    kc.lamb_factors(rows, got_last, freeze, steps, decays, weight_decay=wd, **kw)
    for a, b in zip((got_last, steps, decays), want, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert got_last[3].isnan() and not got_last[8].isnan()  # a NaN norm makes the share undefined: 1
    # layers of a bucket whose step the device skipped keep their factor, step size and decay
    go, owner = torch.tensor([True, False, True]), torch.arange(n) % 3
    kept = (last.clone(), torch.full((n,), 5.0), torch.full((n,), 6.0))
    kc.lamb_factors(rows, kept[0], freeze, *kept[1:], weight_decay=wd, **kw, go=go, owner=owner)
    skip = owner == 1
    for a, b, old in zip(kept, (got_last, steps, decays), (last, torch.full((n,), 5.0), torch.full((n,), 6.0)),
                         strict=True):
        assert torch.equal(a[skip], old[skip].to(a.dtype))
        assert torch.equal(a[~skip].nan_to_num(), b[~skip].nan_to_num())
    with pytest.raises(ValueError, match=r"stats must be a contiguous fp32 \[4, 40\]"):
        kc.lamb_factors(stats[:1].contiguous(), got_last, freeze, steps, decays, weight_decay=0.1, **kw)


VOCAB = 24
DEFERS = OnebitLamb._defers


class TinyLM(nn.Module):
    """Embedding, attention, LayerNorm and biases next to wider layers, and a layer no step uses (its bucket
    takes the path of a bucket whose parameters did not all get a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.unused = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.emb(x))))


def _train(model: TinyLM, opt: OnebitLamb, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(100 + t)
        x = torch.randint(0, VOCAB, (4, 6), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), torch.roll(x, 1, 1).flatten()).backward()
        opt.step()


def _run(on_device: bool, monkeypatch, *, reload_at: int | None = None) -> tuple[TinyLM, OnebitLamb]:
    # the codec's kernels stay the CPU's (the simulator's would take minutes); the scaled step finds the cuda
    # backend's kernel, and torch's ops run where the CPU's kernels would, as on a GPU. Off the device the sync's
    # result is shifted in by torch's ops as it finishes (the update does not decode it)
    monkeypatch.setattr(functional, "get_backend", lambda device, forced=None: kc)
    monkeypatch.setattr(functional, "_fusable", lambda *tensors: False)
    monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: on_device)
    monkeypatch.setattr(OnebitLamb, "_defers", DEFERS if on_device else lambda self, b: False)
    kw = dict(lr=2e-2, warmup_steps=2, weight_decay=0.1, factor_threshold=0.05, bucket_cap_mb=0.0012)
    torch.manual_seed(0)
    model = TinyLM()
    opt = OnebitLamb(model.parameters(), **kw)
    steps = 5
    if reload_at is None:
        _train(model, opt, range(steps))
        return model, opt
    _train(model, opt, range(reload_at))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    torch.manual_seed(1)  # other weights, replaced by the checkpoint's
    model = TinyLM()
    model.load_state_dict(ckpt["model"])
    opt = OnebitLamb(model.parameters(), **kw)
    opt.load_state_dict(ckpt["opt"])
    _train(model, opt, range(reload_at, steps))
    return model, opt


def test_the_factors_and_the_step_on_the_device_have_the_bits_of_the_host_s(monkeypatch):
    stored = []
    real = OnebitLamb._store_factors
    monkeypatch.setattr(OnebitLamb, "_store_factors", lambda self, *a: stored.append(1) or real(self, *a))
    read_model, read_opt = _run(False, monkeypatch)
    assert len(stored) == 3  # on the host the per-parameter factors are written every compression step
    stored.clear()
    launches, stats, factors = [], [], []
    kernel, stats_kernel, factors_kernel = kc.scaled_step, kc.lamb_stats, kc.lamb_factors
    monkeypatch.setattr(kc, "scaled_step", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    def shifting(*a, **k):
        stats.append(k["synced"] is not None)
        return stats_kernel(*a, **k)

    monkeypatch.setattr(kc, "lamb_stats", shifting)
    monkeypatch.setattr(kc, "lamb_factors", lambda *a, **k: factors.append(1) or factors_kernel(*a, **k))
    dev_model, dev_opt = _run(True, monkeypatch)
    assert not stored and dev_opt._factors  # on the device they stay there
    whole = [b for b in dev_opt._buckets if all(p.grad is not None for p in b.params)]
    # one launch of each a bucket whose parameters all got a gradient, a step; the factors one a step
    assert len(launches) == len(stats) == 3 * len(whole) > 0 and len(factors) == 3
    # the synced momentum shifted in by the kernel, but where a masked coordinate's gradient came (an embedding
    # row first used): that call's result is folded in as it finishes
    assert any(stats) and stats.count(False) <= 2, stats
    assert dev_opt.compressing and len(dev_opt._buckets) >= 3
    assert any(0 < sum(h) < len(h) for h in ([p.grad is not None for p in b.params] for b in dev_opt._buckets))
    for p, q in zip(read_model.parameters(), dev_model.parameters(), strict=True):
        assert torch.equal(p, q)
    factors = [read_opt.state[p].get("last_factor") for p in read_model.parameters()]
    assert any(f not in (None, 1.0) for f in factors)  # the factors moved (and were clipped at 5% a step)
    got, want = dev_opt.state_dict()["state"], read_opt.state_dict()["state"]  # the device's factors brought up
    assert got.keys() == want.keys() and all(got[k].get("last_factor") == want[k].get("last_factor") for k in want)
    # written and reloaded between two compression steps, the run goes on with the same bits
    resumed, _ = _run(True, monkeypatch, reload_at=4)
    for p, q in zip(dev_model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def _simulated(on_device: bool, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(functional, "get_backend", lambda device, forced=None: kc)
    monkeypatch.setattr(functional, "_fusable", lambda *tensors: False)
    monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: on_device)
    monkeypatch.setattr(OnebitLamb, "_defers", DEFERS if on_device else lambda self, b: False)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 16))
    params = list(net.parameters())
    opt = OnebitLamb(params, lr=1e-2, warmup_steps=2, weight_decay=0.1, simulate_workers=2, bucket_cap_mb=0.0005)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        opt.step_workers([[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)])
    assert len(opt._buckets) > 1 and all(opt._defers(b) == on_device for b in opt._buckets)
    return [p.detach().clone() for p in params]


def test_simulated_workers_decode_and_shift_in_the_update_with_the_host_s_bits(monkeypatch):
    """Simulated workers' collective leaves its result for the update too (no predicate: the host decided it)."""
    host = _simulated(False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(host, _simulated(True, monkeypatch), strict=True))

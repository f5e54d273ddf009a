"""CUDA kernels under numba's CUDA simulator. Collected only in a process that has
NUMBA_ENABLE_CUDASIM=1 set before numba is imported (see tests/test_cuda_simulator.py)."""

import os

import pytest
import torch

from lightning_onebit.compress.source import Source

from codec_cases import assert_matches_reference, assert_rejects_nonfinite, make_codec

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="needs NUMBA_ENABLE_CUDASIM=1 in this process")


@pytest.mark.parametrize("kind", ["l2", "l1", "minmax"])
@pytest.mark.parametrize("block_size,n,nseg", [(None, 0, 1), (None, 1, 1), (None, 77, 1), (16, 77, 1),
                                                (8, 96, 3), (None, 90, 3), (256, 520, 2)])
def test_cuda_matches_reference(kind, block_size, n, nseg):
    g = torch.Generator().manual_seed(n + nseg)
    x = torch.randn(n, generator=g)
    if n > 20:
        x[:9] = 0.0
        x[9] = -0.0
    assert_matches_reference(kind, block_size, "cuda", x, nseg=nseg)


@pytest.mark.parametrize("kind", ["l2", "l1", "minmax"])
@pytest.mark.parametrize("block_size,nseg", [(None, 1), (None, 3), (16, 2)])
def test_cuda_matches_reference_with_groups(kind, block_size, nseg):
    """Scale blocks that start inside code bytes (tensor boundaries in a bucket)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(96, generator=g) * torch.logspace(-3, 3, 96)
    assert_matches_reference(kind, block_size, "cuda", x, nseg=nseg, groups=[3, 17, 18, 50, 95])


@pytest.mark.parametrize("kind", ["minmax4", "minmax2"])
@pytest.mark.parametrize("block_size,n,nseg,groups", [(None, 77, 1, None), (8, 96, 3, None), (None, 90, 3, None),
                                                       (16, 96, 2, [3, 17, 18, 50, 95])])
def test_cuda_packed_minmax_matches_reference(kind, block_size, n, nseg, groups):
    """4- and 2-bit codes packed through shared memory: odd lengths end inside a byte, blocks and
    groups start inside one, several rows (the cases of the two tests above the costliest leave out)."""
    g = torch.Generator().manual_seed(n + nseg)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    assert_matches_reference(kind, block_size, "cuda", x, nseg=nseg, groups=groups)


@pytest.mark.parametrize("kind", ["l2", "minmax"])
def test_cuda_rejects_non_finite(kind):
    assert_rejects_nonfinite(kind, None, "cuda", n=20)


def test_cuda_half_inputs():
    from lightning_onebit.compress import SignCodec

    x = torch.randn(40).to(torch.bfloat16)
    enc = SignCodec(backend="cuda").encode(x)
    ref = SignCodec(backend="torch").encode(x)
    assert torch.equal(enc.codes, ref.codes)
    assert SignCodec(backend="cuda").decode(enc).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["error_feedback", "markov"])
@pytest.mark.parametrize("make", ["sign", "sign-blocked", "minmax"])
def test_cuda_pipelined_allreduce_matches_reference(mode, make):
    """Pieces hand the kernels strided code views and sliced scales; they must read them right."""
    from lightning_onebit.comm import SimulatedCluster
    from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec

    def codec(backend):
        if make == "minmax":
            return MinMaxUInt8Codec(backend=backend)
        return SignCodec(block_size=64 if make == "sign-blocked" else None, backend=backend)

    # 2 x 3 pieces of 40 values: 64-value scale blocks and tensor groups straddle the pieces
    groups = (5, 77, 181)
    cuda = SimulatedCluster(codec("cuda"), mode, 2, pieces=3, groups=groups)
    ref = SimulatedCluster(codec("torch"), mode, 2, pieces=1, groups=groups)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        xs = [torch.randn(240, generator=g) for _ in range(2)]
        for a, b in zip(cuda.allreduce(xs), ref.allreduce(xs), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cuda.workers[0].num_pieces == 3


@pytest.mark.parametrize("kind", ["l2", "minmax"])
def test_cuda_padding_and_scales_equal_numba(kind):
    """Padding decodes to 0 and keeps its state; the reductions sum in the numba backend's order, so
    the scales are the same bits."""
    from codec_cases import make_codec

    g = torch.Generator().manual_seed(3)
    n, valid = 3 * 120, 300
    x = torch.randn(n, generator=g) * torch.logspace(-2, 2, n)
    x[valid:] = 0.0
    got = {}
    for backend in ("cuda", "numba"):
        codec = make_codec(kind, None, backend)
        lay = codec.layout(n, 3, groups=[0, 7, 130], valid=valid)
        err = torch.zeros(n)
        enc = codec.encode_error_feedback(x, err, layout=lay)
        got[backend] = (enc.codes.clone(), enc.scales.clone(), codec.decode(enc), err)
    for a, b in zip(got["cuda"], got["numba"], strict=True):
        assert torch.equal(a, b)
    assert not got["cuda"][2][valid:].any() and not got["cuda"][3][valid:].any()


# --- payload sources read in place ------------------------------------------------------------------

N_SRC = 160
GROUPS = (0, 37, 37, 101)  # group 1 is empty: a position's group is the last of equal bounds
MASK = (0, 5, 36, 37, 99, 100, 159)  # group ends and starts, and the last element
FACTORS = (0.5, 3.0, 7.0, 1e-3)
SOURCE_CASES = ["lerp-0.1", "lerp-0.9", "lerp-factors", "lerp-mask-nonfinite", "lerp-mask-zero", "lerp-per-group-end",
                "gradient", "gradient-per-group-end", "quotient"]


def _tensors(nan_at: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(momentum, gradient) of N_SRC elements; the gradient NaN at ``nan_at``."""
    g = torch.Generator().manual_seed(5)
    m = torch.randn(N_SRC, generator=g) * torch.logspace(-2, 2, N_SRC)
    grad = torch.randn(N_SRC, generator=g)
    if nan_at is not None:
        grad[nan_at] = float("nan")
    return m, grad


def _source(case: str) -> Source:
    """A fresh Source of ``case`` (nothing of it materialised or cached yet)."""
    m, grad = _tensors()
    mask = torch.tensor(MASK)
    if case in ("lerp-0.1", "lerp-0.9"):
        return Source.lerp(m, grad, float(case[5:]), groups=GROUPS)
    if case == "lerp-factors":
        return Source.lerp(m, grad, 0.1, groups=GROUPS, factors=FACTORS)
    if case == "lerp-mask-nonfinite":
        return Source.lerp(m, grad, 0.1, groups=GROUPS, factors=FACTORS, mask=mask)
    if case == "lerp-mask-zero":
        return Source("lerp", numel=N_SRC, groups=GROUPS, start=m, end=grad, weight=0.1, mask=mask, masked="zero")
    if case == "lerp-per-group-end":  # the parameters' own gradients; group 2 has none (zeros)
        ends = [grad[:37].clone(), grad[37:37].clone(), None, grad[101:].clone()]
        return Source.lerp(m, ends, 0.9, groups=GROUPS, factors=FACTORS, mask=mask)
    if case == "gradient":
        return Source.gradient(grad, numel=N_SRC, groups=GROUPS, mask=mask)
    if case == "gradient-per-group-end":
        ends = [grad[:37].clone(), None, grad[37:101].clone(), None]
        return Source.gradient(ends, numel=N_SRC, groups=GROUPS, mask=mask, masked="nonfinite")
    if case == "quotient":
        return Source.quotient(m, [3.0, 7.0, 0.1, 11.0], groups=GROUPS, mask=mask)
    raise ValueError(case)


def _run(kind: str, backend: str, mode: str, lay, x, state: torch.Tensor) -> tuple:
    """One reduce and one encode by ``backend`` of ``x`` handed over as the codecs hand it (a Source
    stays one where the backend reads it): (totals, scales, codes, state after)."""
    from lightning_onebit.compress.codecs import MODES, Codec
    from lightning_onebit.compress.kernels import get_backend

    codec = make_codec(kind, None, backend)
    kernels = get_backend(torch.device("cpu"), backend)
    x, st = Codec._readable(x, kernels), state.clone()
    totals = kernels.reduce(codec.kind, MODES[mode], lay, x, st)
    enc = codec.empty(lay)
    enc.scales.copy_(codec._scales_unchecked(totals, lay)[0])
    kernels.encode(codec.kind, MODES[mode], lay, x, st, enc.scales, enc.codes)
    return totals, enc.scales, enc.codes, st


def _assert_source_matches(kind: str, mode: str, make, lay, monkeypatch) -> None:
    """The CUDA kernels reading the Source ``make()`` in place give the bits of the CUDA kernels on its
    materialised tensor (totals, scales, codes, state), and the torch reference's codes and values."""
    from lightning_onebit.compress.kernels import numba_cuda as kc

    x = make().materialize().clone()
    state = torch.randn(lay.numel, generator=torch.Generator().manual_seed(9))
    src = make()
    assert kc.accepts(src)
    with monkeypatch.context() as mp:  # the kernels read the source: nothing materialises it
        mp.setattr(Source, "materialize", lambda self: pytest.fail("the CUDA backend's source was materialised"))
        got = _run(kind, "cuda", mode, lay, src, state)
    want = _run(kind, "cuda", mode, lay, x, state)
    for a, b, what in zip(got, want, ("totals", "scales", "codes", "state"), strict=True):
        assert torch.equal(a, b), what
    ref = _run(kind, "torch", mode, lay, x, state)
    assert torch.equal(got[2], ref[2]), "codes differ from the torch reference"
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=0.0, msg="totals")  # fp64 sums, another order
    for a, b, what in ((got[1], ref[1], "scales"), (got[3], ref[3], "state")):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-30, msg=what)


@pytest.mark.parametrize("kind", ["l2", "minmax"])
@pytest.mark.parametrize("case", SOURCE_CASES)
def test_cuda_reads_sources_in_place(case, kind, monkeypatch):
    """Every operation of a Source, with factors, a mask in both modes and per-group gradients."""
    lay = make_codec(kind, None, "torch").layout(N_SRC, 2, groups=[0, 37, 101])
    mode = "markov" if case.startswith("gradient") else "error_feedback"
    _assert_source_matches(kind, mode, lambda: _source(case), lay, monkeypatch)


@pytest.mark.parametrize("kind", ["l2", "minmax"])
def test_cuda_reads_source_windows_and_padding(kind, monkeypatch):
    """A window ``src[lo:hi]`` reads from ``base = lo``; ``src.padded(D)`` and its windows read zeros
    past the data (a two-stage collective's padded chunks and its pipeline pieces)."""
    codec = make_codec(kind, None, "torch")
    make = lambda: _source("lerp-per-group-end")
    lo, hi = 24, 24 + 96  # across groups and masked positions
    _assert_source_matches(kind, "error_feedback", lambda: make()[lo:hi], codec.layout(hi - lo, 2), monkeypatch)
    padded = 192
    lay = codec.layout(padded, 2, groups=[0, 37, 101], valid=N_SRC)
    _assert_source_matches(kind, "error_feedback", lambda: make().padded(padded), lay, monkeypatch)
    _assert_source_matches(kind, "markov", lambda: make().padded(padded)[120:184], codec.layout(64, 1), monkeypatch)


@pytest.mark.parametrize("masked", ["nonfinite", "zero"])
def test_cuda_source_mask_keeps_a_nan_gradient_visible(masked):
    """A NaN gradient at a masked position sends |0 * NaN| = NaN, so its block's scale is not finite
    (the collective's check fails, as with the materialised payload), or 0 with ``masked="zero"``."""
    from lightning_onebit.compress.kernels import numba_cuda as kc

    codec = make_codec("l2", None, "cuda")
    lay = codec.layout(N_SRC, 2, groups=[0, 37, 101])

    def make():
        m, grad = _tensors(nan_at=99)
        return Source("lerp", numel=N_SRC, groups=GROUPS, start=m, end=grad, weight=0.1, factors=FACTORS,
                      mask=torch.tensor(MASK), masked=masked)

    assert kc.accepts(make())
    scales, ok = codec.compute_scales_unchecked(make(), layout=lay)
    want, want_ok = codec.compute_scales_unchecked(make().materialize().clone(), layout=lay)
    assert bool(ok) == bool(want_ok) == (masked == "zero")
    finite = torch.isfinite(scales)
    assert torch.equal(finite, torch.isfinite(want)) and torch.equal(scales[finite], want[finite])
    if masked == "nonfinite":  # only the block of position 99 (row 1's first block, [80, 101)) is not finite
        assert finite.sum() == scales.numel() - 1 and not finite[1, 0]


def test_cuda_quotient_divides_as_torch_does_on_a_gpu(monkeypatch):
    """On a GPU torch divides by a Python float as ``a * (1 / b)`` (the fp32 reciprocal, one bit less
    exact than the CPU's division): the kernels multiply by the reciprocals there (RECIPROCAL), here
    forced on the simulator's CPU tensors."""
    from lightning_onebit.compress.kernels import numba_cuda_source as kcs

    monkeypatch.setattr(kcs, "_reciprocal_division", lambda device: True)
    m, _ = _tensors()
    bounds = (*GROUPS, N_SRC)
    recips = [torch.tensor(1.0) / torch.tensor(d) for d in (3.0, 7.0, 0.1, 11.0)]  # fp32, as CUDA torch
    x = torch.cat([m[a:b] * r for a, b, r in zip(bounds[:-1], bounds[1:], recips, strict=True)])
    x[torch.tensor(MASK)] = 0.0
    assert not torch.equal(x, _source("quotient").materialize()), "no element where the two divisions differ"
    lay = make_codec("l2", None, "torch").layout(N_SRC, 2, groups=[0, 37, 101])
    state = torch.randn(N_SRC, generator=torch.Generator().manual_seed(9))
    got = _run("l2", "cuda", "error_feedback", lay, _source("quotient"), state)
    for a, b in zip(got, _run("l2", "cuda", "error_feedback", lay, x, state), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reciprocal", [False, True])
def test_a_cached_expression_takes_new_factors_into_its_own_buffer(reciprocal, monkeypatch):
    """0/1 Adam's synchronisation sends ``u / sums`` with new sums each time, its expression cached in the
    bucket's cache: the kernels read the new factors (the GPU's reciprocals too) from the same kernel array,
    and a buffer of another expression with the old values, shared by value, is left as it was."""
    from lightning_onebit.compress.kernels import numba_cuda_source as kcs

    monkeypatch.setattr(kcs, "_reciprocal_division", lambda device: reciprocal)
    m, _ = _tensors()
    lay = make_codec("l2", None, "torch").layout(N_SRC, 2, groups=[0, 37, 101])
    state = torch.randn(N_SRC, generator=torch.Generator().manual_seed(9))
    cache, out, mask = {}, torch.empty(N_SRC), torch.tensor(MASK)
    shared = Source.quotient(m, FACTORS, groups=GROUPS, mask=mask)  # no cache: its factors are shared by value
    shared_factors = kcs._expression(shared)[4].copy()
    arrays = None
    for factors in (FACTORS, (2.0, 0.25, 9.0, 3e-2), (2.0, 0.25, 9.0, 3e-2)):  # new values, then the same
        def make(factors=factors):
            return Source.quotient(m, factors, groups=GROUPS, mask=mask, out=out, cache=cache)
        src = make()
        got = _run("l2", "cuda", "error_feedback", lay, src, state)
        # the same expression written out as it would be on that device, the same kernels on it
        want = _run("l2", "cuda", "error_feedback", lay, _materialised(make(), reciprocal), state)
        for a, b, what in zip(got, want, ("totals", "scales", "codes", "state"), strict=True):
            assert torch.equal(a, b), (factors, what)
        now = kcs._expression(src)
        assert arrays is None or now[4] is arrays[4], "the factors' kernel array was made again"
        arrays = now
    assert (kcs._expression(shared)[4] == shared_factors).all()


def _materialised(src: Source, reciprocal: bool) -> torch.Tensor:
    """A quotient Source's values: torch's division on the CPU, its multiply by the fp32 reciprocal on a GPU."""
    if not reciprocal:
        return src.materialize().clone()
    bounds = (*src.groups, src.valid)
    x = torch.cat([src.start[a:b] * (torch.tensor(1.0) / torch.tensor(f))
                   for a, b, f in zip(bounds[:-1], bounds[1:], src.factors, strict=True)])
    x[src.mask] = 0.0
    return x


def test_cuda_backend_materialises_the_sources_it_cannot_read():
    from lightning_onebit.compress.codecs import Codec
    from lightning_onebit.compress.kernels import numba_cuda as kc

    m, grad = _tensors()
    strided = Source.lerp(m, torch.stack([grad, grad], 1)[:, 0], 0.1, groups=GROUPS)  # a non-contiguous end
    assert not kc.accepts(strided) and isinstance(Codec._readable(strided, kc), torch.Tensor)
    assert not kc.accepts(Source.lerp(m, grad, 0.1, groups=GROUPS, mask=torch.tensor(MASK, dtype=torch.int32)))
    # |0 * end| without an end: materialize() refuses it, the kernels must not read past an empty end
    no_end = Source("quotient", numel=N_SRC, groups=GROUPS, start=m, factors=FACTORS, mask=torch.tensor(MASK))
    assert not kc.accepts(no_end)


def test_launch_arguments_match_the_compiled_signatures(monkeypatch):
    """compile_ptx compiles each kernel for the argument types in kernel_signatures(); the
    wrappers must launch with exactly those (numba's typeof of what they pass), or the PTX
    checked ahead of time is not what a GPU would compile."""
    import numba

    from lightning_onebit.comm import SimulatedCluster
    from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec
    from lightning_onebit.compress.kernels import numba_cuda as kc

    seen: dict[str, set] = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, config):
            launch = self.kernel[config]

            def call(*args):
                seen.setdefault(self.name, set()).add(tuple(numba.typeof(a) for a in args))
                return launch(*args)

            return call

    from lightning_onebit.compress.kernels import numba_cuda_factors as kf
    from lightning_onebit.compress.kernels import numba_cuda_update as ku

    sigs = kc.kernel_signatures()
    for name in sigs:
        recorder = Recorder(name, getattr(kc, name))
        monkeypatch.setattr(kc, name, recorder)
        for module in (ku, kf):
            if hasattr(module, name):  # launched from the module that defines it
                monkeypatch.setattr(module, name, recorder)
    g = torch.Generator().manual_seed(0)
    for codec in (SignCodec(backend="cuda"), SignCodec(backend="cuda", block_size=16),
                  MinMaxUInt8Codec(backend="cuda")):
        x = torch.randn(90, generator=g)
        err = torch.zeros(90)
        enc = codec.encode_error_feedback(x, err, groups=[0, 7, 40])
        m, grad = torch.randn(90, generator=g), torch.randn(90, generator=g)  # a payload source: its arguments
        src = Source.lerp(m, [grad[:7], None, grad[40:]], 0.1, groups=[0, 7, 40], factors=[1.0, 0.5, 2.0],
                          mask=torch.tensor([3, 50]))
        codec.encode_error_feedback(src, err, groups=[0, 7, 40])
        codec.decode(enc)
        codec.decode_mean(codec.encode(x, nseg=3))
        codec.server_step(codec.encode(x, nseg=3), torch.zeros(30))  # the mean decoded by the reduction
        kc.reduce(codec.kind, 0, codec.layout(90, groups=[0, 7, 40]), x, None)  # the totals alone (no codec op)
        sim = SimulatedCluster(codec, "markov", 3, pieces=2, groups=[0, 5])
        sim.allreduce([torch.randn(70, generator=g) for _ in range(3)])
    params = [torch.randn(7, generator=g), None, torch.randn(50, generator=g)]
    kc.scaled_step(params, torch.randn(90, generator=g), [0, 7, 40], torch.rand(3, generator=g),
                   torch.rand(3, generator=g))
    u, d, f = (torch.rand(90, generator=g) for _ in range(3))
    for rows in (4, 1):  # with the dot products, and the maxima alone
        kc.lamb_stats(params, u, d, f, [0, 7, 40], torch.empty(rows, 3), eps=1e-8, eps_inside_sqrt=rows == 4)
        kc.lamb_factors(torch.rand(rows, 3), torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                        torch.empty(3), torch.empty(3), weight_decay=0.01 if rows == 4 else 0.0, lr=0.1,
                        factor_threshold=0.1, factor_min=0.5, factor_max=4.0)
    assert set(seen) == set(sigs)
    for name, types in seen.items():
        assert types == {sigs[name]}, (name, types, sigs[name])


@pytest.mark.parametrize("kind,block_size", [("l2", None), ("minmax", 16)])
def test_cuda_server_step_decodes_the_mean_in_the_reduction(kind, block_size):
    """The server's mean over 3 rows is decoded by the reduction, written into ``mean`` for the encode:
    the re-encoded row, its error feedback and the mean are the numba backend's bits."""
    g = torch.Generator().manual_seed(9)
    n, rows = 90, 3
    x = torch.randn(rows * n, generator=g) * torch.logspace(-2, 2, rows * n)
    got = {}
    for backend in ("cuda", "numba"):
        codec = make_codec(kind, block_size, backend)
        msgs = codec.encode(x, nseg=rows)
        err, mean = torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.full((n,), float("nan"))
        out = codec.server_step(msgs, err, mean=mean)
        got[backend] = (out.codes.clone(), out.scales.clone(), err, codec.decode_mean(msgs))
        if backend == "cuda":
            assert torch.equal(mean, got[backend][3])
    for a, b in zip(got["cuda"], got["numba"], strict=True):
        assert torch.equal(a, b)


def test_fused_reduce_and_scales_match_the_two_pass_reduction(monkeypatch):
    """``reduce_to_scales`` combines each scale block's tiles in the launch that reduced them (the last
    tile's thread block, the partials read LANES at a time): with 8-element tiles a block spans 70 tiles
    (three rounds of reads), and the totals (min-max: all three columns) are those of ``reduce`` (reduce
    then combine, two launches) bit for bit; a non-finite input clears the flag, and the next call's
    counters start at zero."""
    from lightning_onebit.compress.kernels import numba_cuda as kc
    from lightning_onebit.compress.kernels.layout import MINMAX_U8, make_layout

    monkeypatch.setattr(kc, "REDUCE_TILE", 8)  # the summation order of both paths alike
    layout = make_layout(1, 600, None, groups=[0, 40, 41])  # blocks of 40, 1 and 559 elements
    g = torch.Generator().manual_seed(5)
    x = torch.randn(layout.numel, generator=g) * torch.logspace(-2, 2, layout.numel)
    for bad in (True, False):
        xi = x.clone()
        if bad:
            xi[500] = float("nan")
        scales = torch.empty(layout.nseg, layout.blocks_per_seg * 2)
        ok = kc.reduce_to_scales(MINMAX_U8, 0, layout, xi, None, scales)
        fused = layout.__dict__["_scratch"]  # (partials, totals, flag, flag 0-d, counters) by stream
        (totals, counters), = [(b[1], b[4]) for b in fused.values()]
        two_pass = kc.reduce(MINMAX_U8, 0, layout, xi, None)
        assert bool(ok) is not bad
        assert torch.equal(totals.nan_to_num(), two_pass.nan_to_num()) and torch.equal(totals.isnan(), two_pass.isnan())
        assert not counters.any()

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_onebit.compress import Encoded, MinMaxCodec, MinMaxUInt8Codec, SignCodec
from lightning_onebit.compress.kernels import threads

from codec_cases import assert_matches_reference, assert_rejects_nonfinite, make_codec

KINDS = ["l2", "l1", "minmax", "minmax4", "minmax2"]
BLOCKS = [None, 8, 16, 40, 4096]

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
special = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.0e38, -3.0e38, 1.0, -1.0])
values = st.one_of(finite32, special)


@st.composite
def vectors(draw, max_len=600):
    n = draw(st.integers(0, max_len))
    kind = draw(st.sampled_from(["random", "list", "zeros", "mixed_blocks"]))
    if kind == "list":
        vals = draw(st.lists(values, min_size=n, max_size=n))
        return torch.tensor(vals, dtype=torch.float32)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(n)
    x = torch.randn(n, generator=g) * draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e20]))
    if kind == "mixed_blocks" and n > 16:
        x[: n // 2] = 0.0  # all-zero blocks beside live ones
    return x


@pytest.fixture(params=["serial", "parallel"])
def numba_path(request, monkeypatch):
    """The numba kernels run serially below SERIAL_BELOW elements and in parallel above; the
    property tests' vectors are small, so each runs once on either path."""
    if request.param == "parallel":
        monkeypatch.setattr(threads, "SERIAL_BELOW", 0)
    return request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", BLOCKS)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(x=vectors(), nseg=st.sampled_from([1, 2, 3]))
def test_numba_matches_reference(kind, block_size, x, nseg, numba_path):
    n = x.numel() - x.numel() % nseg
    assert_matches_reference(kind, block_size, "numba", x[:n].contiguous(), nseg=nseg)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [None, 16])
def test_serial_and_parallel_kernels_give_the_same_bits(kind, block_size, monkeypatch):
    """Around the size where the kernels switch, both paths: codes, scales, state, decode, row mean."""
    n = 3 * (threads.SERIAL_BELOW // 3 + 77)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    out = {}
    for below in (n + 1, 0):  # serial, then parallel
        monkeypatch.setattr(threads, "SERIAL_BELOW", below)
        codec = make_codec(kind, block_size, "numba")
        err = torch.linspace(-1, 1, n)
        enc = codec.encode_error_feedback(x, err, nseg=3, groups=[0, 5, n // 2])
        rows = codec.encode(x, nseg=3)
        out[below] = (enc.codes, enc.scales, err, codec.decode(enc), codec.decode_mean(rows))
    for a, b in zip(*out.values(), strict=True):
        assert torch.equal(a, b)


@st.composite
def grouped(draw, max_len=700):
    """A vector, a row count and group offsets that land anywhere (inside code bytes too)."""
    nseg = draw(st.sampled_from([1, 2, 3, 5]))
    seg = draw(st.integers(1, max_len // nseg))
    n = nseg * seg
    groups = draw(st.lists(st.integers(0, n), max_size=12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-4, 4, n)[torch.randperm(n, generator=g)]
    if draw(st.booleans()):
        x[: n // 3] = 0.0
    return x, nseg, groups


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [None, 8, 24])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=grouped())
def test_numba_matches_reference_with_groups(kind, block_size, case):
    x, nseg, groups = case
    assert_matches_reference(kind, block_size, "numba", x, nseg=nseg, groups=groups)


def _expected_blocks(n: int, nseg: int, groups: list[int], block: int | None) -> list[list[tuple[int, int]]]:
    """Scale blocks by definition: cut at row starts, group starts and every `block` from each group start."""
    seg = n // nseg
    gs = sorted({0, *[g for g in groups if g < n]})
    cuts = set(range(0, n, seg)) | set(gs)
    if block:
        for a, b in zip(gs, [*gs[1:], n], strict=True):
            cuts |= set(range(a, b, block))
    cuts = sorted(cuts) + [n]
    rows = [[] for _ in range(nseg)]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        rows[a // seg].append((a - a // seg * seg, b - a // seg * seg))
    return rows


@pytest.mark.parametrize("backend", ["torch", "numba"])
@settings(max_examples=40, deadline=None)
@given(case=grouped(max_len=300), block=st.sampled_from([None, 8, 16]))
def test_scales_follow_group_boundaries(backend, case, block):
    """One l2 scale per piece of a group inside a row (cut further by block_size from the group's
    start), computed from that piece alone; unused scale slots of shorter rows are 0."""
    x, nseg, groups = case
    enc = SignCodec(block_size=block, backend=backend).encode(x, nseg=nseg, groups=groups)
    y = SignCodec(block_size=block, backend=backend).decode(enc)
    seg = x.numel() // nseg
    for r, blocks in enumerate(_expected_blocks(x.numel(), nseg, groups, block)):
        got = enc.layout.starts[r].tolist()
        assert got[: len(blocks)] == [a for a, _ in blocks] and set(got[len(blocks):]) == {seg}
        for j, (a, b) in enumerate(blocks):
            xb = x[r * seg + a : r * seg + b]
            s = xb.double().square().mean().sqrt().float()
            torch.testing.assert_close(enc.scales[r, j], s, rtol=1e-6, atol=0)
            torch.testing.assert_close(y[r * seg + a : r * seg + b], torch.where(xb >= 0, s, -s))
        assert (enc.scales[r, len(blocks):] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_padding_decodes_to_zero_and_keeps_its_state(kind):
    """Elements from `valid` on are padding: they count in no scale, decode to exactly 0 and their
    error / estimate state does not change; numba equals the reference."""
    g = torch.Generator().manual_seed(0)
    n, nseg, valid = 3 * 40, 3, 93  # row 2 is data up to column 13
    x = torch.randn(n, generator=g)
    x[valid:] = 0.0
    outs = {}
    for backend in ("torch", "numba"):
        codec = make_codec(kind, 16, backend)
        lay = codec.layout(n, nseg, groups=[0, 50], valid=valid)
        err = torch.randn(n, generator=torch.Generator().manual_seed(1))
        err[valid:] = 0.0
        enc = codec.encode_error_feedback(x, err, layout=lay)
        dec = codec.decode(enc)
        assert torch.equal(dec[valid:], torch.zeros(n - valid)) and torch.equal(err[valid:], torch.zeros(n - valid))
        est = torch.zeros(n)
        codec.encode_markov(x, est, layout=lay)
        assert torch.equal(est[valid:], torch.zeros(n - valid))
        outs[backend] = (enc, dec, err)
    assert torch.equal(outs["torch"][0].codes[:, :2], outs["numba"][0].codes[:, :2])
    torch.testing.assert_close(outs["torch"][0].scales, outs["numba"][0].scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(outs["torch"][1], outs["numba"][1])
    torch.testing.assert_close(outs["torch"][2], outs["numba"][2])
    if kind == "l2":  # row 2 is cut at 82 and 98 (every 16 from the group start 50): the block
        # [82, 98) holds data up to 93 and counts those 11 elements only
        lay = make_codec(kind, 16, "numba").layout(n, nseg, groups=[0, 50], valid=valid)
        assert lay.starts[2].tolist()[:3] == [0, 2, 18]
        want = x[82:93].double().square().mean().sqrt().float()
        torch.testing.assert_close(make_codec(kind, 16, "numba").encode(x, layout=lay).scales[2, 1], want,
                                   rtol=1e-6, atol=0)


def test_a_small_tensor_keeps_its_own_scale():
    """Two tensors with gradients 1e-4 and 1 in one vector: with their boundary as a group, the small
    one decodes at its own magnitude; without, it takes the large one's scale (what a shared
    bucket scale did)."""
    x = torch.cat([torch.full((1000,), 1e-4), torch.ones(3000)]) * torch.tensor([1.0, -1.0]).repeat(2000)
    for backend in ("torch", "numba"):
        codec = SignCodec(backend=backend)
        per_tensor = codec.decode(codec.encode(x, nseg=2, groups=[0, 1000]))
        shared = codec.decode(codec.encode(x, nseg=2))
        torch.testing.assert_close(per_tensor[:1000].abs(), torch.full((1000,), 1e-4))
        assert shared[:1000].abs().min() > 0.5


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [None, 16])
def test_rejects_non_finite_without_touching_state(backend, kind, block_size):
    assert_rejects_nonfinite(kind, block_size, backend)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@settings(max_examples=40, deadline=None)
@given(x=vectors(), block=st.sampled_from(BLOCKS), scale=st.sampled_from(["l2", "l1"]))
def test_sign_codec_semantics(backend, x, block, scale):
    codec = SignCodec(scale=scale, block_size=block, backend=backend)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert not torch.isnan(y).any()
    assert enc.nbytes == math.ceil(x.numel() / 8) + 4 * enc.scales.numel()
    if x.numel() == 0:
        return
    pos = x >= 0  # -0.0 codes as +1
    nb = enc.scales.numel()
    starts = enc.layout.starts[0].tolist()
    for b in range(nb):
        sl = slice(starts[b], starts[b + 1])
        xb = x[sl].double()
        expect = (xb.square().mean().sqrt() if scale == "l2" else xb.abs().mean()).float()
        torch.testing.assert_close(enc.scales.view(-1)[b], expect, rtol=1e-6, atol=0)
        s = enc.scales.view(-1)[b]
        torch.testing.assert_close(y[sl], torch.where(pos[sl], s, -s))


@pytest.mark.parametrize("backend", ["torch", "numba"])
@settings(max_examples=40, deadline=None)
@given(x=vectors(), block=st.sampled_from(BLOCKS), bits=st.sampled_from([8, 4, 2]))
def test_minmax_error_bound(backend, x, block, bits):
    codec = MinMaxCodec(bits, block_size=block, backend=backend)
    top = (1 << bits) - 1
    x = x.clamp(-1e30, 1e30)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert enc.codes.dtype == torch.uint8 and enc.nbytes == math.ceil(x.numel() * bits / 8) + 8 * enc.scales.shape[1]
    if x.numel() == 0:
        return
    starts = enc.layout.starts[0].tolist()
    for b in range(enc.scales.shape[1]):
        sl = slice(starts[b], starts[b + 1])
        lo, hi = x[sl].min().double(), x[sl].max().double()
        bound = (hi - lo) / (2 * top) * (1 + 1e-6) + 1e-6 * max(abs(lo), abs(hi))
        assert (y[sl].double() - x[sl].double()).abs().max() <= bound
        slack = 1e-6 * (hi - lo) + 1e-6 * max(abs(lo), abs(hi))  # decode stays inside [min, max]
        assert y[sl].double().min() >= lo - slack and y[sl].double().max() <= hi + slack


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_packed_minmax_codes_are_little_endian_within_a_byte(backend):
    """The wire format of 4- and 2-bit codes: element i at bit (i * bits) % 8 of byte i * bits // 8."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0])  # min 0, max 3: 2-bit codes are the values
    enc = MinMaxCodec(2, backend=backend).encode(x)
    assert enc.codes.tolist() == [[0b11100100, 0b010011]]
    assert torch.equal(MinMaxCodec(2, backend=backend).decode(enc), x)
    x = torch.tensor([15.0, 14.0, 13.0, 12.0, 0.0])  # min 0, max 15: 4-bit codes are the values
    enc = MinMaxCodec(4, backend=backend).encode(x)
    assert enc.codes.tolist() == [[0xEF, 0xCD, 0x00]] and enc.nbytes == 3 + 8
    assert torch.equal(MinMaxCodec(4, backend=backend).decode(enc), x)
    with pytest.raises(ValueError, match="bits must be one of"):
        MinMaxCodec(3)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_inputs(backend, dtype, kind):
    x = torch.randn(1001).to(dtype)
    codec = make_codec(kind, None, backend)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == dtype and y.shape == x.shape
    ref = make_codec(kind, None, "torch").encode(x.float())
    assert torch.equal(enc.codes, ref.codes)
    torch.testing.assert_close(enc.scales, ref.scales)  # scales computed in fp32/fp64 either way


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_edge_lengths_and_zero_blocks(backend):
    codec = SignCodec(block_size=8, backend=backend)
    for n in (0, 1, 7, 8, 9, 17):
        x = torch.zeros(n)
        enc = codec.encode(x)
        assert enc.codes.numel() == math.ceil(n / 8)
        y = codec.decode(enc)
        assert torch.equal(y, torch.zeros(n))
    x = torch.tensor([-0.0, 0.0, -1e-45, 1e-45])
    enc = SignCodec(backend=backend).encode(x)
    assert enc.codes.tolist() == [[0b1011]]  # -0.0 and +0.0 -> +1; -denormal -> -1
    assert enc.scales.item() > 0


def test_error_feedback_identity():
    codec = SignCodec(backend="numba")
    g = torch.Generator().manual_seed(1)
    x, err = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    v = x + err
    enc = codec.encode_error_feedback(x, err)
    torch.testing.assert_close(codec.decode(enc) + err, v)


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 8"):
        SignCodec(block_size=12)
    with pytest.raises(ValueError, match="scale"):
        SignCodec(scale="linf")
    with pytest.raises(ValueError, match="fp32"):
        SignCodec().encode_error_feedback(torch.randn(10), torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="10 elements"):
        SignCodec().encode_error_feedback(torch.randn(10), torch.zeros(11))
    with pytest.raises(TypeError, match="floating-point"):
        SignCodec().encode(torch.arange(10))
    with pytest.raises(ValueError, match="unknown compression backend"):
        SignCodec(backend="nope")
    with pytest.raises(ValueError, match="another codec"):
        SignCodec().decode(MinMaxUInt8Codec().encode(torch.randn(4)))
    assert isinstance(SignCodec().encode(torch.randn(3)), Encoded)


def test_backend_env_var(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "torch")
    from lightning_onebit.compress.kernels import resolve_backend_name

    assert resolve_backend_name(torch.device("cpu")) == "torch"
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        resolve_backend_name(torch.device("cpu"))


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("with_error", [True, False])
def test_server_step_is_the_mean_then_encode(backend, kind, block_size, with_error):
    """server_step(messages, e) = encode_error_feedback(mean of the decoded rows, e), where the mean
    sums workers 0..n-1 in fp64 in order (built here row by row, not with decode_mean)."""
    cod = make_codec(kind, block_size, backend)
    g = torch.Generator().manual_seed(5)
    n, seg = 3, 8 * 37 + 4
    msgs = cod.encode(torch.randn(n * seg, generator=g) * 3, nseg=n)
    acc = torch.zeros(seg, dtype=torch.float64)
    for w in range(n):
        acc += cod.decode(msgs.row(w)).double()
    mean = (acc / n).float()
    err0 = torch.randn(seg, generator=g) if with_error else None
    e_step, e_want = (err0.clone(), err0.clone()) if with_error else (None, None)
    got = cod.server_step(msgs, e_step, mean=torch.full((seg,), float("nan")))  # mean= is overwritten
    want = cod.encode_error_feedback(mean, e_want) if with_error else cod.encode(mean)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    if with_error:
        assert torch.equal(e_step, e_want)
    if kind == "l2":  # and the scale is the 1-bit Adam one: ||v||_2 / sqrt(len) per block
        v = mean + (err0 if with_error else 0)
        blocks = v.split(block_size or seg)
        want_scales = torch.stack([b.double().norm() / len(b) ** 0.5 for b in blocks]).float()
        torch.testing.assert_close(got.scales.view(-1), want_scales, rtol=1e-6, atol=0)


@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_decode_mean_is_bit_identical_to_the_reference(rows, block_size):
    """Up to 4 sign rows the numba kernel looks the mean up in a table of the 2^n possible values;
    each entry is the reference's in-order fp64 sum, so the result must match bit for bit."""
    g = torch.Generator().manual_seed(rows)
    for kind in ("l2", "l1"):
        for seg in (1, 13, 8 * 1100 + 5):
            x = torch.randn(rows * seg, generator=g) * torch.logspace(-3, 3, rows * seg)
            x[: rows * seg // 3] = 0.0  # all-zero blocks: scale 0
            msgs = make_codec(kind, block_size, "numba").encode(x, nseg=rows)
            got = make_codec(kind, block_size, "numba").decode_mean(msgs)
            want = make_codec(kind, block_size, "torch").decode_mean(msgs)
            assert torch.equal(got, want), (kind, seg)
            acc = torch.randn(seg, generator=g)
            acc_ref = acc.clone()
            make_codec(kind, block_size, "numba").decode_mean(msgs, out=acc, accumulate=True)
            make_codec(kind, block_size, "torch").decode_mean(msgs, out=acc_ref, accumulate=True)
            assert torch.equal(acc, acc_ref), (kind, seg)


@pytest.mark.parametrize("make", [lambda: SignCodec("l2"), lambda: SignCodec("l1", block_size=64),
                                  lambda: MinMaxUInt8Codec()])
def test_unchecked_scales_report_finiteness_without_raising(make):
    """compute_scales_unchecked gives the checked scales and a device-side flag, so a collective can
    fold the check into its agreement and wait once; compute_scales raises on the same input."""
    codec = make()
    x = torch.randn(1000)
    scales, ok = codec.compute_scales_unchecked(x, groups=[0, 300])
    assert ok.dtype == torch.bool and ok.dim() == 0 and bool(ok)
    assert torch.equal(scales, codec.compute_scales(x, groups=[0, 300]))
    x[500] = float("nan")
    _, ok = codec.compute_scales_unchecked(x, groups=[0, 300])
    assert not bool(ok)
    with pytest.raises(ValueError, match="not finite"):
        codec.compute_scales(x, groups=[0, 300])
    _, ok = codec.compute_scales_unchecked(torch.zeros(0))
    assert bool(ok)

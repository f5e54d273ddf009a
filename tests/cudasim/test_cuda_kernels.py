"""CUDA kernels under numba's CUDA simulator. Collected only in a process that has
NUMBA_ENABLE_CUDASIM=1 set before numba is imported (see tests/test_cuda_simulator.py)."""

import os

import pytest
import torch

from codec_cases import assert_matches_reference, assert_rejects_nonfinite

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

    sigs = kc.kernel_signatures()
    for name in sigs:
        monkeypatch.setattr(kc, name, Recorder(name, getattr(kc, name)))
    g = torch.Generator().manual_seed(0)
    for codec in (SignCodec(backend="cuda"), SignCodec(backend="cuda", block_size=16),
                  MinMaxUInt8Codec(backend="cuda")):
        x = torch.randn(90, generator=g)
        err = torch.zeros(90)
        enc = codec.encode_error_feedback(x, err, groups=[0, 7, 40])
        codec.decode(enc)
        codec.decode_mean(codec.encode(x, nseg=3))
        sim = SimulatedCluster(codec, "markov", 3, pieces=2, groups=[0, 5])
        sim.allreduce([torch.randn(70, generator=g) for _ in range(3)])
    assert set(seen) == set(sigs)
    for name, types in seen.items():
        assert types == {sigs[name]}, (name, types, sigs[name])

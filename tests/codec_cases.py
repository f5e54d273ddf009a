"""Shared checks of every codec op against the torch reference (used by the numba tests
and, in a separate process, by the CUDA-simulator tests)."""

from __future__ import annotations

import torch

from lightning_onebit.compress import MinMaxCodec, MinMaxUInt8Codec, SignCodec


def make_codec(kind: str, block_size, backend: str):
    if kind == "minmax":
        return MinMaxUInt8Codec(block_size=block_size, backend=backend)
    if kind in ("minmax4", "minmax2"):  # packed: two or four codes to a byte
        return MinMaxCodec(int(kind[-1]), block_size=block_size, backend=backend)
    return SignCodec(scale=kind, block_size=block_size, backend=backend)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=1e-30, msg=what)


def assert_matches_reference(kind: str, block_size, backend: str, x: torch.Tensor, nseg: int = 1,
                             seed: int = 0, groups=None) -> None:
    """Every op of ``backend`` equals the torch reference: codes bit for bit, floats to tolerance.
    With ``groups`` (scale blocks that start anywhere, also inside a code byte) the rows differ in
    their cuts; the server step is then checked on rows cut alike (a server's view)."""
    ref = make_codec(kind, block_size, "torch")
    cod = make_codec(kind, block_size, backend)
    g = torch.Generator().manual_seed(seed)
    n = x.numel()
    kw = {"groups": groups}

    e_ref, e_bk = ref.encode(x, nseg=nseg, **kw), cod.encode(x, nseg=nseg, **kw)
    assert torch.equal(e_ref.codes, e_bk.codes), "codes differ"
    _close(e_bk.scales, e_ref.scales, "scales")
    _close(cod.decode(e_bk), ref.decode(e_ref), "decode")
    assert e_bk.nbytes == ref.encoded_nbytes(n, nseg, **kw)

    err0 = torch.randn(n, generator=g)
    err_ref, err_bk = err0.clone(), err0.clone()
    a, b = ref.encode_error_feedback(x, err_ref, nseg=nseg, **kw), cod.encode_error_feedback(x, err_bk, nseg=nseg, **kw)
    assert torch.equal(a.codes, b.codes), "error-feedback codes differ"
    _close(err_bk, err_ref, "error after feedback")

    est_ref, est_bk = err0.clone(), err0.clone()
    a, b = ref.encode_markov(x, est_ref, nseg=nseg, **kw), cod.encode_markov(x, est_bk, nseg=nseg, **kw)
    assert torch.equal(a.codes, b.codes), "markov codes differ"
    _close(est_bk, est_ref, "markov estimate")

    if groups is not None and nseg > 1 and n:  # a server's message: every worker's copy of row 1
        lay = ref.layout(n, nseg, groups).repeat_row(1, nseg)
        m_ref, m_bk = ref.encode(x, layout=lay), cod.encode(x, layout=lay)
        assert torch.equal(m_ref.codes, m_bk.codes), "codes of a server message differ"
        serr0 = torch.randn(lay.seg_len, generator=g)
        s_ref_err, s_bk_err = serr0.clone(), serr0.clone()
        s_ref, s_bk = ref.server_step(m_ref, s_ref_err), cod.server_step(m_bk, s_bk_err)
        assert torch.equal(s_ref.codes, s_bk.codes), "server codes differ"
        _close(s_bk_err, s_ref_err, "server error")
        _close(cod.decode_mean(m_bk), ref.decode_mean(m_ref), "decode_mean")
    elif nseg > 1 and n:
        msgs_ref, msgs_bk = ref.encode(x, nseg=nseg), cod.encode(x, nseg=nseg)
        seg = n // nseg
        serr0 = torch.randn(seg, generator=g)
        s_ref_err, s_bk_err = serr0.clone(), serr0.clone()
        s_ref, s_bk = ref.server_step(msgs_ref, s_ref_err), cod.server_step(msgs_bk, s_bk_err)

        assert torch.equal(s_ref.codes, s_bk.codes), "server codes differ"
        _close(s_bk.scales, s_ref.scales, "server scales")
        _close(s_bk_err, s_ref_err, "server error")
        _close(cod.decode_mean(msgs_bk), ref.decode_mean(msgs_ref), "decode_mean")
        acc_ref, acc_bk = serr0.clone(), serr0.clone()
        ref.decode_mean(msgs_ref, out=acc_ref, accumulate=True)
        cod.decode_mean(msgs_bk, out=acc_bk, accumulate=True)
        _close(acc_bk, acc_ref, "decode_mean accumulate")


def assert_rejects_nonfinite(kind: str, block_size, backend: str, n: int = 50) -> None:
    cod = make_codec(kind, block_size, backend)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(n)
        x[n // 2] = bad
        err = torch.randn(n)
        before = err.clone()
        for op, args in ((cod.encode, (x,)), (cod.encode_error_feedback, (x, err)),
                         (cod.encode_markov, (x, err))):
            try:
                op(*args)
            except ValueError as exc:
                assert "not finite" in str(exc)
            else:
                raise AssertionError(f"{bad} input was encoded")
            assert torch.equal(err, before), "state changed although the input was rejected"

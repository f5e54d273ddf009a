"""A compression step decided on the device (the cuda backend): the kernels' predicates, and 1-bit Adam /
QAdam skipping a step with a NaN gradient with no host read, learnt at the next step, on one rank and on two
gloo ranks (the NaN on one of them), in `step()` and bucket by bucket in DDP's hook; a server's overflow learnt
from the next agreement on two ranks; and 0/1 Adam's synchronisations on the cuda backend against the CPU's bits.

Runs under numba's CUDA simulator (tests/test_cuda_simulator.py starts it), where CPU tensors stand in for
device memory: the cuda backend's kernels, flags and predicated writes run as on a GPU.
"""

import pytest
import torch
from torch import nn

import lightning_onebit as lo
from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec
from lightning_onebit.compress.source import Sink
from lightning_onebit.optim import NonFiniteGradientError

from dist_utils import run_ranks, values

FLAGS = {True: torch.ones(1, dtype=torch.bool), False: torch.zeros(1, dtype=torch.bool)}


@pytest.mark.parametrize("make", [lambda: SignCodec(backend="cuda"), lambda: MinMaxUInt8Codec(backend="cuda")])
def test_predicated_encode_and_decode_write_only_when_go(make):
    codec = make()
    g = torch.Generator().manual_seed(0)
    x, err = torch.randn(77, generator=g), torch.randn(77, generator=g) * 0.1
    ref_err = err.clone()
    ref = codec.encode_error_feedback(x, ref_err)
    enc = codec.encode_error_feedback(x, err.clone())  # message buffers to write into
    before_codes, kept_err = enc.codes.clone(), err.clone()
    codec.encode_error_feedback(x, kept_err, out=enc, go=FLAGS[False])
    assert torch.equal(kept_err, err) and torch.equal(enc.codes, before_codes)  # nothing written
    codec.encode_error_feedback(x, kept_err, out=enc, go=FLAGS[True])
    assert torch.equal(kept_err, ref_err) and torch.equal(enc.codes, ref.codes)

    values = codec.decode(ref)
    for go, and_go in ((True, True), (True, False), (False, True)):
        out, copy = torch.full((70,), 7.0), torch.full((77,), 7.0)  # out: the result without padding's worth
        flags, decay = torch.zeros(2, dtype=torch.bool), torch.zeros(1)
        codec.decode_predicated(ref, out, copy, go=FLAGS[go], and_go=FLAGS[and_go], flags=flags, decay=0.99,
                                decay_out=decay)
        both = go and and_go
        assert torch.equal(out, values[:70] if both else torch.full((70,), 7.0))
        assert torch.equal(copy, values if both else torch.zeros(77))
        assert flags.tolist() == [both, and_go or not go]
        assert decay.item() == (torch.tensor(0.99).item() if both else 1.0)


@pytest.mark.parametrize("decay", [1.0, 0.99])
def test_the_decode_kernel_applies_a_sink_with_the_cpu_bits(decay):
    # the update of a step decided on the device, applied by the decode kernel: the bits of Sink.apply on the
    # CPU (the numba CPU kernel's too), a group without a target and masked coordinates left alone
    codec, n = SignCodec(backend="cuda"), 77
    g = torch.Generator().manual_seed(2)
    enc = codec.encode_error_feedback(torch.randn(n, generator=g), torch.zeros(n))
    values = codec.decode(enc)
    targets = [torch.randn(30, generator=g), None, torch.randn(27, generator=g)]
    denom, mask = torch.rand(n, generator=g) + 0.5, torch.tensor([3, 31, 60])

    def sink(ts, sizes=(-0.01, -0.02, -0.01)):
        return Sink(numel=n, groups=[0, 30, 50], targets=ts, denom=denom, values=sizes, decay=decay, mask=mask)

    ref = [None if t is None else t.clone() for t in targets]
    sink(ref).apply(values.clone())
    got = [None if t is None else t.clone() for t in targets]
    assert codec.fuses_predicated_sink(sink(got))  # one step size where there are targets
    out = torch.full((n,), 7.0)
    codec.decode_predicated(enc, out, None, go=FLAGS[False], sink=sink(got))
    assert all(torch.equal(a, b) for a, b in zip(got[::2], targets[::2], strict=True))  # skipped: untouched
    assert torch.equal(out, torch.full((n,), 7.0))
    codec.decode_predicated(enc, out, None, go=FLAGS[True], sink=sink(got))
    assert torch.equal(out, values)  # the state gets the values unmasked, as without the sink
    assert all(torch.equal(a, b) for a, b in zip(got[::2], ref[::2], strict=True))
    # a decode the host decided (0/1 Adam's synchronisation, a call before its collective was verified) alike
    plain = [None if t is None else t.clone() for t in targets]
    assert codec.fuses_sink(sink(plain))
    out = torch.full((n,), 7.0)
    codec.decode(enc, out=out, sink=sink(plain))
    assert torch.equal(out, values) and all(torch.equal(a, b) for a, b in zip(plain[::2], ref[::2], strict=True))
    uneven = sink(got, sizes=(-0.01, -0.01, -0.02))
    assert not codec.fuses_predicated_sink(uneven) and not codec.fuses_sink(uneven)  # torch applies it then
    with pytest.raises(ValueError, match="one step size"):
        codec.decode_predicated(enc, out, None, go=FLAGS[True], sink=uneven)


def test_a_planned_launch_follows_its_tensors_memory_and_the_steps_numbers():
    # a launch's arguments are planned once per layout and tensors and replayed: a new step size is used, a
    # tensor whose memory was swapped (as `p.data = ...` does) is written where it points now, and a plan keeps
    # no tensor alive
    import gc
    import weakref

    codec, n = SignCodec(backend="cuda"), 77
    g = torch.Generator().manual_seed(3)
    x, err = torch.randn(n, generator=g), torch.zeros(n)
    enc = codec.encode_error_feedback(x, err.clone())
    values = codec.decode(enc)
    target, denom = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5

    def sink(t, size):
        return Sink(numel=n, groups=[0], targets=[t], denom=denom, values=[size], decay=0.99)

    def expect(t, size):
        ref = t.clone()
        sink(ref, size).apply(values.clone())
        return ref

    out = torch.empty(n)
    for size in (-0.01, -0.03):  # the second call replays the first's plan with its own step size
        want = expect(target, size)
        codec.decode_predicated(enc, out, None, go=FLAGS[True], sink=sink(target, size))
        assert torch.equal(target, want)
    old = target.clone()
    moved = target.clone()
    target.set_(moved)  # the same tensor object on new memory
    want = expect(target, -0.02)
    kept = old.clone()
    codec.decode_predicated(enc, out, None, go=FLAGS[True], sink=sink(target, -0.02))
    assert torch.equal(target, want) and torch.equal(old, kept)

    st = torch.zeros(n)
    codec.encode_error_feedback(x, st, out=enc, go=FLAGS[True])
    old_st = st[:]  # the first memory, through a view
    first = old_st.clone()
    fresh, ref = torch.zeros(n), torch.zeros(n)
    codec.encode_error_feedback(x, ref)
    st.set_(fresh)  # the error state on new memory: written there
    codec.encode_error_feedback(x, st, out=enc, go=FLAGS[True])
    assert torch.equal(fresh, ref) and torch.equal(old_st, first)

    ok = torch.empty(1, dtype=torch.bool)  # a caller's flag, written by the planned reduction
    scales, flag = codec.compute_scales_unchecked(x, ok=ok)
    assert flag is ok and bool(ok)
    gone = [weakref.ref(out), weakref.ref(ok)]
    del out, ok, flag, scales
    gc.collect()
    assert all(r() is None for r in gone)


def test_predicates_need_the_cuda_backend():
    codec = SignCodec(backend="numba")
    with pytest.raises(ValueError, match="predicates its kernels"):
        codec.encode_error_feedback(torch.randn(8), torch.zeros(8), go=FLAGS[True])


class Tiny(nn.Module):
    """Where compression breaks: an embedding, a LayerNorm, attention, biases next to a wider layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 40)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.emb(idx))
        return self.out(self.attn(x, x, x)[0])


def _state(opt) -> dict:
    sd = opt.state_dict()
    # the collectives' call and byte counters count a call whose writes the device skipped: left out
    comm = [{k: v for k, v in c.items() if k not in ("calls", "bytes_sent")} for c in sd["onebit"]["comm"]]
    return {"state": sd["state"], "comm": comm, "step": sd["onebit"]["step"]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _run(algorithm: str, *, nan_at: int = -1, omit: int = -1, no_grad_at: int = -1, steps: int = 5,
         policy: str = "skip", backend: str = "cuda", monkeypatch=None, rank: int = 0, after_step=None):
    if monkeypatch is not None:
        monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", backend)
    torch.manual_seed(0)
    net = Tiny()
    params = list(net.parameters())
    opt = getattr(lo, algorithm)(params, lr=1e-2, weight_decay=0.01, warmup_steps=2, bucket_cap_mb=0.002)
    opt.set_nonfinite_policy(policy, max_consecutive=3)
    g = torch.Generator().manual_seed(1 + rank)
    seen = []  # (step, skipped_steps, optimizer_steps) after each call, as the host saw them then
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        if t == nan_at:
            grads[3].view(-1)[5] = float("nan")  # the LayerNorm's bias
        if t == omit:
            continue
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        if t == no_grad_at:
            params[3].grad = None  # the LayerNorm's bias, which had a gradient the step before
        opt.step()
        seen.append((t, opt.skipped_steps, opt.optimizer_steps))
        if after_step is not None:
            after_step()
    return params, opt, seen


@pytest.mark.budget(40)  # three 5-step runs under the simulator, which pays per launch (a thread per CUDA thread)
@pytest.mark.parametrize("algorithm", ["OnebitAdam", "QAdam", "OnebitLamb"])
def test_a_nan_step_decided_on_the_device_changes_nothing(algorithm, monkeypatch):
    from lightning_onebit.compress.kernels import numba_cuda
    from lightning_onebit.optim import functional, local_steps

    if algorithm == "OnebitLamb":  # its update's kernels run where torch's ops would (a GPU), its factors stay there
        monkeypatch.setattr(functional, "_fusable", lambda *tensors: False)
        monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: True)

    made, planned = [0], numba_cuda.planned

    def counting(layout, key, tensors, make):
        def counted():
            made[0] += 1
            return make()
        return planned(layout, key, tensors, counted)

    monkeypatch.setattr(numba_cuda, "planned", counting)
    marks = []
    params, opt, seen = _run(algorithm, nan_at=3, monkeypatch=monkeypatch, after_step=lambda: marks.append(made[0]))
    # the launches' arguments are planned by the first compressed steps and replayed after them, the skipped
    # step's included
    assert marks[2] > 0 and marks[4] == marks[3], marks
    comms = [b.sync.comm for b in opt._buckets]
    assert len(comms) > 1 and all(c.skip_on_device for c in comms)
    # the host learns at the next step: step 3 counted as taken, then taken back when step 4 begins
    assert seen[3] == (3, 0, 4) and seen[4] == (4, 1, 4), seen
    ref_params, ref, _ = _run(algorithm, omit=3, monkeypatch=monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert _same(_state(opt), _state(ref))  # moments, error state, step counts: as if step 3 never came
    if algorithm == "OnebitAdam":  # and the numba CPU backend, which reads the flag on the host: the same bits
        cpu_params, cpu, cpu_seen = _run(algorithm, nan_at=3, backend="numba", monkeypatch=monkeypatch)
        assert cpu_seen[3] == (3, 1, 3), cpu_seen  # at once
        assert all(torch.equal(a, b) for a, b in zip(params, cpu_params, strict=True))
        assert cpu.skipped_steps == opt.skipped_steps == 1


@pytest.mark.budget(30)  # two 5-step runs under the simulator
def test_a_parameter_without_a_gradient_on_the_cuda_backend_has_the_cpus_bits(monkeypatch):
    """A compressed step in which a parameter got no gradient, after a step skipped for its NaN: the cuda backend,
    whose buckets' gradients are copied into their flat buffers first (zeros for it, not the last step's NaN), takes
    the step the numba CPU backend takes reading each gradient where it is, bit for bit."""
    cuda_params, cuda, _ = _run("OnebitAdam", nan_at=3, no_grad_at=4, monkeypatch=monkeypatch)
    cpu_params, cpu, _ = _run("OnebitAdam", nan_at=3, no_grad_at=4, backend="numba", monkeypatch=monkeypatch)
    assert cuda.optimizer_steps == cpu.optimizer_steps == 4 and cuda.skipped_steps == cpu.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(cuda_params, cpu_params, strict=True))
    assert _same(cuda.state_dict()["state"], cpu.state_dict()["state"])


def _rank_run(rank: int, world: int, nan_rank: int) -> tuple:
    """A rank of the two-rank test: step 3 with a NaN on ``nan_rank``'s LayerNorm bias, then without step 3."""
    params, opt, seen = _run("OnebitAdam", nan_at=3 if rank == nan_rank else -1, rank=rank)
    decided = [b.sync.comm.skip_on_device for b in opt._buckets]
    ref_params, ref, _ = _run("OnebitAdam", omit=3, rank=rank)
    return seen, decided, params, _state(opt), ref_params, _state(ref)


@pytest.mark.budget(60)  # two ranks of two 5-step runs under the simulator
def test_two_ranks_skip_a_nan_on_one_of_them_on_the_device(monkeypatch):
    """With several ranks the flags go in the agreement rounds' gathered signatures: every rank computes the
    same ``go`` on the device, so a NaN on rank 1 leaves both ranks as if the step never came."""
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "cuda")
    ranks = values(run_ranks(_rank_run, 2, 1, timeout_s=120))
    for seen, decided, params, state, ref_params, ref_state in ranks:
        assert all(decided), decided
        assert seen[3] == (3, 0, 4) and seen[4] == (4, 1, 4), seen  # learnt at the next step, on both ranks
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
        assert _same(state, ref_state)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][2], ranks[1][2], strict=True))  # the ranks agree


def _hook_rank(rank: int, world: int, algorithm: str) -> tuple:
    """A rank of the DDP hook test: ``algorithm`` attached to DDP (the policy "raise": the sync in the hook), a
    NaN in rank 1's LayerNorm bias gradient at step 3, and rank 0 reading its state between that backward and
    ``step()`` (which decodes the hook's results there, the skipped one included)."""
    from lightning_onebit.optim import functional, local_steps

    if algorithm == "OnebitLamb":  # its update's kernels run where torch's ops would (a GPU)
        functional._fusable = lambda *tensors: False
        local_steps.flags_stay_on_device = lambda device: True
    torch.manual_seed(0)
    net = Tiny()
    # 1-bit LAMB: a factor clipped every step (to 0.01% a step), so that one computed from stale statistics moves
    kw = dict(factor_threshold=1e-4) if algorithm == "OnebitLamb" else {}
    opt = getattr(lo, algorithm)(net.parameters(), lr=1e-2, warmup_steps=2, bucket_cap_mb=0.002, **kw)
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002)
    opt.attach(ddp)
    poison = []
    net.norm.bias.register_hook(lambda g: g.clone().fill_(float("nan")) if poison else g)
    names = {id(p): n for n, p in net.named_parameters()}
    nan_bucket = next([names[id(p)] for p in b.params] for b in opt._buckets
                      if any(p is net.norm.bias for p in b.params))
    g = torch.Generator().manual_seed(1 + rank)
    before, raised, factors = None, None, []
    for t in range(5):
        poison[:] = [True] if (t == 3 and rank == 1) else []
        opt.zero_grad()
        ddp(torch.randint(0, 16, (2, 5), generator=g)).square().mean().backward()
        if t == 3:  # the hook's syncs left their decode to step(): the parameters are still step 2's
            before = {n: p.detach().clone() for n, p in net.named_parameters()}
            factors.append(_last_factors(opt, net))
            if rank == 0:
                opt.state_dict()
        try:
            opt.step()
        except NonFiniteGradientError as exc:
            raised = (t, str(exc))
            break
    after = {n: p.detach().clone() for n, p in net.named_parameters()}
    counts = {n: opt.state[p]["step"] for n, p in net.named_parameters()}
    factors.append(_last_factors(opt, net))
    return raised, nan_bucket, before, after, counts, factors


def _last_factors(opt, net) -> dict:
    """1-bit LAMB's layer factors, brought to the host (empty for another optimizer)."""
    if not hasattr(opt, "_sync_factors"):
        return {}
    opt._sync_factors()
    return {n: opt.state[p].get("last_factor") for n, p in net.named_parameters()}


@pytest.mark.budget(60)  # two ranks of one 5-step run under the simulator
@pytest.mark.parametrize("algorithm", ["OnebitAdam", "OnebitLamb"])
def test_ddp_hook_decides_each_bucket_on_the_device_and_raise_comes_a_step_late(algorithm, monkeypatch):
    """In DDP's hook a bucket's sync is decided on the device as it comes: the bucket holding rank 1's NaN
    skips step 3 on both ranks, the others take it, and "raise" comes at step 4, on both ranks alike. 1-bit
    LAMB's layer factors, computed for all buckets in one launch, change only in the buckets that took it. Rank
    0's state read before ``step()`` (a checkpoint there) changes none of it: the ranks stay equal."""
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "cuda")
    ranks = values(run_ranks(_hook_rank, 2, algorithm, timeout_s=120))
    for raised, nan_bucket, before, after, counts, (was, now) in ranks:
        if algorithm == "OnebitLamb":
            moved = {n for n in now if now[n] != was[n]}
            assert moved and not moved & set(nan_bucket), (moved, nan_bucket)
        assert raised is not None and raised[0] == 4, raised
        assert "optimizer step 4" in raised[1] and "the others took the step" in raised[1], raised
        assert 0 < len(nan_bucket) < len(after), nan_bucket
        for n in after:
            skipped = n in nan_bucket
            assert torch.equal(after[n], before[n]) == skipped, n  # the NaN's bucket alone kept its values
            assert counts[n] == (3 if skipped else 4), (n, counts[n])
    assert all(torch.equal(ranks[0][3][n], ranks[1][3][n]) for n in ranks[0][3])  # the ranks agree


def test_raise_and_consecutive_skips_act_a_step_late(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "cuda")
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(33)), nn.Parameter(torch.randn(5, 7))]
    opt = lo.OnebitAdam(params, lr=1e-2, warmup_steps=1)
    opt.set_nonfinite_policy("raise")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step(), opt.step()  # the warm-up, then a step decided on the device
    before = [p.detach().clone() for p in params]
    params[1].grad[2, 3] = float("inf")
    opt.step()  # no read: nothing raises yet, and nothing is written
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    params[1].grad[2, 3] = 1.0
    with pytest.raises(NonFiniteGradientError, match="optimizer step 3 .* the host learned it at the next step"):
        opt.step()
    assert opt.optimizer_steps == 2 and all(torch.equal(a, b) for a, b in zip(params, before, strict=True))

    opt.set_nonfinite_policy("skip", max_consecutive=2)
    params[0].grad[0] = float("nan")
    opt.step(), opt.step()  # two skipped; the second is learnt by state_dict(), which settles first
    with pytest.raises(NonFiniteGradientError, match="2 consecutive steps"):
        opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


def _zero_one_opt(params, policy: str = "skip"):
    opt = lo.ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, var_freeze_step=2, var_update_scaler=1,
                         local_step_scaler=1, local_step_clipper=2, bucket_cap_mb=0.002)
    opt.set_nonfinite_policy(policy)
    return opt


def _zero_one_run(backend: str, monkeypatch) -> tuple:
    """2 variance refreshes, synchronisations at steps 3, 4 and 6, a NaN in a gradient of step 5 (a local step,
    reported at the next synchronisation). The cuda backend as on a GPU: its flags stay on the device."""
    from lightning_onebit.optim import local_steps

    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", backend)
    monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: backend == "cuda")
    torch.manual_seed(0)
    net = Tiny()
    params = list(net.parameters())
    opt = _zero_one_opt(params)
    g = torch.Generator().manual_seed(1)
    seen = []  # (kind of step, dropped gradients the host knows of after it)
    for t in range(7):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if t == 4:
            params[3].grad[1] = float("nan")
        kind = opt.schedule().kind(opt.optimizer_steps + 1)
        opt.step()
        seen.append((kind, opt.dropped_gradients))
    return params, opt, seen


@pytest.mark.budget(30)  # two 7-step runs, one under the simulator's kernels
def test_zero_one_adams_synchronisations_on_the_cuda_backend_have_the_cpus_bits(monkeypatch):
    """0/1 Adam's interval synchronisations (``u / sums``, new sums each time, read in place by the kernels
    from an expression kept in the bucket's cache) give the numba CPU backend's bits, decided on the device as a
    GPU decides them (the anchor's update predicated on the calls' flags), a dropped gradient learnt a step later
    than the CPU, which reads it."""
    params, opt, seen = _zero_one_run("cuda", monkeypatch)
    assert [k for k, _ in seen] == ["refresh", "refresh", "sync", "sync", "local", "sync", "local"], seen
    assert all("kernel_expression" in b.cache and b.sync.comm.skip_on_device for b in opt._buckets)
    assert len(opt._buckets) > 1
    cpu_params, cpu, cpu_seen = _zero_one_run("numba", monkeypatch)
    assert [d for _, d in cpu_seen] == [0, 0, 0, 0, 0, 1, 1], cpu_seen  # read at the synchronisation
    assert [d for _, d in seen] == [0, 0, 0, 0, 0, 0, 1], seen  # a step later
    assert all(torch.equal(a, b) for a, b in zip(params, cpu_params, strict=True))
    assert _same(opt.state_dict()["state"], cpu.state_dict()["state"])


def _zero_one_rank(rank: int, world: int) -> tuple:
    """A rank of the two-rank 0/1 Adam test (the policy "raise"): rank 1 drops a NaN gradient in step 5 (local),
    then, once that was raised, sends a synchronisation whose payload overflowed (its u made inf)."""
    from lightning_onebit.optim import local_steps

    local_steps.flags_stay_on_device = lambda device: True
    torch.manual_seed(0)
    net = Tiny()
    params = list(net.parameters())
    opt = _zero_one_opt(params, policy="raise")
    g = torch.Generator().manual_seed(1 + rank)
    raised, left = [], None
    for t in range(14):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if t == 4 and rank == 1:
            params[3].grad[1] = float("nan")
        kind = opt.schedule().kind(opt.optimizer_steps + 1)
        if kind == "sync" and left is not None and rank == 1:  # the second synchronisation after the raise
            opt._buckets[0].flat["update_sum"].fill_(float("inf"))
        try:
            opt.step()
        except NonFiniteGradientError as exc:
            raised.append((t, opt.optimizer_steps, str(exc)))
            if len(raised) == 2:
                break
            continue
        if kind == "sync" and raised and left is None:  # the first after it: the model every rank has
            left = [p.detach().clone() for p in params]
    comms = [b.sync.comm.skip_on_device for b in opt._buckets]
    anchors = [p.detach().clone() for p in params]
    return raised, comms, left, anchors, opt.dropped_gradients


@pytest.mark.budget(60)  # two ranks of one run of 14 steps at most under the simulator (about 25 s)
def test_two_ranks_learn_a_dropped_gradient_and_an_overflowed_synchronisation_a_step_later(monkeypatch):
    """With several ranks a synchronisation decided on the device carries each rank's dropped-gradient count in
    its first call's gathered signatures: "raise" comes at the next step on every rank alike, though only rank 1
    dropped one. A synchronisation whose payload overflowed on rank 1 is skipped on the device on both ranks
    (the anchor and the momentum kept), leaves every rank at the model of the synchronisation before, and raises
    at the next step on both."""
    monkeypatch.setenv("LIGHTNING_ONEBIT_BACKEND", "cuda")
    ranks = values(run_ranks(_zero_one_rank, 2, timeout_s=120))
    for rank, (raised, comms, left, anchors, dropped) in enumerate(ranks):
        assert all(comms), comms
        assert dropped == (1 if rank == 1 else 0), dropped
        assert len(raised) == 2, raised
        (t0, _, first), (t1, _, second) = raised
        assert t0 == 6 and "dropped a NaN/inf gradient" in first and "decided on the device" in first, raised
        assert "had a NaN/inf payload" in second and "the host learned it at the next step" in second, raised
        assert all(torch.equal(a, b) for a, b in zip(anchors, left, strict=True))  # back at the last synchronisation
    assert [r[:2] for r in ranks[0][0]] == [r[:2] for r in ranks[1][0]]  # at the same steps
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][3], ranks[1][3], strict=True))


def _overflow_rank(rank: int, world: int) -> tuple:
    """A rank of the server-overflow test: three calls of one collective, the last two decided on the device;
    rank 1's server state is pushed past fp32's limit before the second."""
    from lightning_onebit.comm import CompressedAllreduce, check_together

    car = CompressedAllreduce(SignCodec(backend="cuda"), "error_feedback")
    car.skip_on_device = True
    g, out, seen, paired = torch.Generator().manual_seed(rank), torch.empty(96), [], []
    for t in range(3):
        if t == 1 and rank == 1:
            car.server.fill_(float("inf"))
        paired.append(car._gathered_ok is not None and car._gathered_ok.data_ptr() == car._flag_pair.data_ptr())
        car.begin(torch.randn(96, generator=g))
        verdict = check_together([car])
        car.send()
        car.relay()
        car.complete(out, defer=True)
        car.decode_pending()
        if verdict is not None:
            finite, overflowed = verdict.read()
            seen.append((finite, len(overflowed)))
    return seen, paired


@pytest.mark.budget(40)  # two ranks of three small calls under the simulator
def test_two_ranks_learn_a_server_overflow_from_the_next_agreement_on_the_device(monkeypatch):
    """A call decided on the device whose gathered server scales are not finite leaves its flag beside the next
    call's input flag, and the next agreement carries both in one copy: every rank's verdict names the
    collective, as the host's check would have raised on every rank."""
    ranks = values(run_ranks(_overflow_rank, 2, timeout_s=120))
    for seen, paired in ranks:
        assert seen == [(True, 0), (True, 1)], seen  # the first call was verified on the host
        assert paired == [False, False, True], paired  # the overflowed call's flag went out with the pair

"""0/1 Adam: the schedules against a hand-computed table, the reductions to Adam, DDP == simulation
(local steps send nothing), non-finite gradients in local steps, checkpoints."""

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn

from lightning_onebit import ZeroOneAdam
from lightning_onebit.compress import Source
from lightning_onebit.optim import NonFiniteGradientError, ZeroOneSchedule
from lightning_onebit.optim.sync import BucketSync

from dist_utils import run_ranks, values

SMALL = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
R, B, L, S = "refresh", "onebit", "local", "sync"  # B: a 1-bit step


class TinyTransformer(nn.Module):
    """Embedding, attention, LayerNorm and biases next to a wide layer: where compression breaks."""

    def __init__(self, vocab: int = 40, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.att = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln = nn.LayerNorm(dim)
        self.wide = nn.Linear(dim, 4 * dim)
        self.head = nn.Linear(4 * dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.att(h, h, h, need_weights=False)
        return self.head(torch.relu(self.wide(self.ln(h + a)))).mean(1)


def _batch(step: int, worker: int, vocab: int = 40):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randint(0, vocab, (8, 6), generator=g), torch.randint(0, 5, (8,), generator=g)


def _model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


# -- the schedules ----------------------------------------------------------------------------
def test_schedule_matches_the_hand_computed_table():
    """kappa = 2: refreshes at 1, 2 (interval 1), 4, 6 (interval 2), 8, 12 (interval 4); then, after
    step 12, the local interval 1 for 3 steps, 2 for 3 steps (16, 18), then 4 = H (20, 24, 28)."""
    table = [R, R, B, R, B, R, B, R, B, B, B, R,  # 1..12: phase A
             S, S, S,  # 13..15: interval 1
             S, L, S,  # 16..18: interval 2 (16, 18)
             L, S, L, L, L, S, L, L, L, S]  # 19..28: interval 4, capped by H = 4
    assert ZeroOneSchedule(**SMALL).kinds(28) == table


def test_schedule_with_deepspeeds_defaults():
    """var_update_scaler=16: 16 refreshes a step apart, 16 two apart, 16 four apart ...; after the freeze
    32678 steps synchronise every step, then every 2nd, ... up to every 16th."""
    s = ZeroOneSchedule(var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16)
    kinds = s.kinds(200)
    refreshes = [t for t, k in enumerate(kinds, 1) if k == R]
    assert refreshes[:16] == list(range(1, 17))
    assert refreshes[16:32] == list(range(18, 49, 2))
    assert refreshes[32:48] == list(range(52, 113, 4))
    assert refreshes[48:] == list(range(120, 201, 8))
    b = ZeroOneSchedule(var_freeze_step=10, var_update_scaler=16, local_step_scaler=4, local_step_clipper=16)
    syncs = [t for t, k in enumerate(b.kinds(200), 1) if k == S]
    # the interval doubles every 4 steps (steps, not synchronisations): 1 for 11-14, 2 for 15-18, 4 for 19-22
    assert syncs[:8] == [11, 12, 13, 14, 16, 18, 20, 24]
    gaps = {y - x for x, y in zip(syncs[-5:], syncs[-4:], strict=False)}
    assert gaps == {16}


def test_each_step_sends_what_its_kind_says():
    """Simulated 2 workers on the table's schedule: a refresh step sends an fp32 allreduce, a 1-bit step
    and a synchronisation one 1-bit call, a local step nothing; rounds count what sent anything."""
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=3e-3, simulate_workers=2, **SMALL)
    sent = []
    for t in range(1, 29):
        opt.step_workers(_grads(opt, model, t))
        sent.append(opt.comm_counter.last.bytes_sent)
    kinds = ZeroOneSchedule(**SMALL).kinds(28)
    by_kind = {k: {b for b, kk in zip(sent, kinds, strict=True) if kk == k} for k in (R, B, L, S)}
    d = sum(p.numel() for p in model.parameters())
    assert by_kind[R] == {4 * d}  # 2 (n-1)/n * 4 d
    assert by_kind[L] == {0}
    assert by_kind[B] == by_kind[S] and len(by_kind[B]) == 1 and 0 < next(iter(by_kind[B])) < 4 * d / 20
    assert opt.comm_counter.rounds == sum(k != L for k in kinds) == 20
    assert opt.step_counts == {R: 6, B: 6, L: 8, S: 8} and opt.local_steps == 8


def _grads(opt, model, step, workers=2, nan=()):
    """Each worker's gradient at its own replica (worker_parameters), as real ranks compute them."""
    out = []
    for w in range(workers):
        x, y = _batch(step, w)
        with opt.worker_parameters(w):
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            if (step, w) in nan:
                loss = loss * float("nan")
            loss.backward()
            out.append([None if p.grad is None else p.grad.clone() for p in opt.params_in_order()])
    return out


# -- reductions to Adam -----------------------------------------------------------------------
def test_refreshing_every_step_is_adamw_bit_for_bit():
    """The variance refreshed at every step (the interval never grows) and never frozen: exactly
    torch.optim.AdamW (eps outside the root, as AdamW), weight decay and bias corrections included."""
    a, b = _model(), _model()
    za = ZeroOneAdam(a.parameters(), lr=1e-2, weight_decay=0.1, eps_inside_sqrt=False, var_freeze_step=10**6,
                     var_update_scaler=10**6)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for t in range(1, 16):
        x, y = _batch(t, 0)
        for m, o in ((a, za), (b, ref)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert za.step_counts[R] == 15
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


class _ExactMean:
    """A collective without compression: the fp32 mean (stands in for the 1-bit one)."""

    any_flag = False

    def allreduce(self, xs, flags=None):
        self.any_flag = bool(flags and any(flags))
        xs = [x.materialize() if isinstance(x, Source) else x for x in xs]  # payloads come as expressions
        return [torch.stack(xs).mean(0)] * len(xs)

    def allreduce_into(self, xs, out, flags=None):
        return out.copy_(self.allreduce(xs, flags)[0])

    def bind(self, numel, device):
        pass

    def reset_state(self):
        pass

    def state_views(self, lo, hi):
        return []

    def state_dict(self):
        return {"world_size": 2}


def _frozen_adam_reference(model, steps, freeze, lr, wd, syncs=(), beta=(0.9, 0.999), eps=1e-8):
    """AdamW whose variance stops at step ``freeze``, eps inside the root; at the steps ``syncs`` the
    momentum becomes the lr-weighted mean of the momenta since the last one (0/1 Adam's rule)."""
    ps = list(model.parameters())
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    u = [torch.zeros_like(p) for p in ps]
    total = 0.0
    for t in range(1, steps + 1):
        x, y = _batch(t, 0)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for i, p in enumerate(ps):
                g = p.grad
                m[i].lerp_(g, 1 - beta[0])
                if t <= freeze:
                    v[i].mul_(beta[1]).addcmul_(g, g, value=1 - beta[1])
                k = min(t, freeze)
                d = (v[i] / (1 - beta[1] ** k)).add(eps).sqrt()
                step = lr / (1 - beta[0] ** t)
                p.mul_(1 - lr * wd).addcdiv_(m[i], d, value=-step)
                if t > freeze:
                    u[i].add_(m[i], alpha=step)
                    if t in syncs:
                        m[i] = u[i] / (total + step)
                        u[i].zero_()
        if t > freeze:
            total = 0.0 if t in syncs else total + lr / (1 - beta[0] ** t)


@pytest.mark.parametrize("clipper,wd", [(1, 0.1), (4, 0.0)])
def test_without_compression_it_is_adam_with_the_variance_frozen(clipper, wd, monkeypatch):
    """The 1-bit collective replaced by an exact mean, every worker on the same data. With interval 1
    (H = 1) every step synchronises and the run is Adam whose variance stops at var_freeze_step. With
    H = 4 the model is rebuilt from the anchor every 4th step and the momentum becomes the interval's
    lr-weighted mean momentum, as the paper has it. To fp32 rounding: the synchronisation divides
    the accumulated update by the sum of step sizes (and with weight decay it applies the interval's
    product of decay factors to the anchor, which is not the same rounding as step by step)."""
    monkeypatch.setattr(BucketSync, "collective", lambda self: _ExactMean())
    a, b = _model(), _model()
    opt = ZeroOneAdam(a.parameters(), lr=1e-2, weight_decay=wd, var_freeze_step=6, var_update_scaler=10**6,
                      local_step_scaler=1, local_step_clipper=clipper, simulate_workers=2)
    for t in range(1, 25):
        x, y = _batch(t, 0)
        a.zero_grad()
        nn.functional.cross_entropy(a(x), y).backward()
        opt.step_workers([[p.grad.clone() for p in opt.params_in_order()]] * 2)
    kinds = ZeroOneSchedule(var_freeze_step=6, var_update_scaler=10**6, local_step_scaler=1,
                            local_step_clipper=clipper).kinds(24)
    assert opt.step_counts[L] == kinds.count(L) == (0 if clipper == 1 else 12)
    _frozen_adam_reference(b, 24, 6, lr=1e-2, wd=wd, syncs={t for t, k in enumerate(kinds, 1) if k == S})
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# -- DDP == simulation --------------------------------------------------------------------------
CAP = 0.004  # MB: the optimizer's buckets of TinyTransformer, 4 (a synchronisation's calls run together)


def _ddp_rank(rank, world_size, steps, wires):
    from lightning_onebit.comm import CompressedAllreduce

    from dist_utils import counting_collectives

    out = {}
    phases: list[str] = []
    real = {name: getattr(CompressedAllreduce, name) for name in ("begin", "complete")}

    def logged(name):
        def phase(self, *args, **kwargs):
            phases.append(name)
            return real[name](self, *args, **kwargs)
        return phase

    for name in real:  # the order of the calls' phases in each step
        setattr(CompressedAllreduce, name, logged(name))
    try:
        for wire in wires:
            calls: list[str] = []
            with counting_collectives(calls.append):  # every collective this process starts
                out[wire] = _ddp_steps(rank, steps, calls, phases, wire)
        out["raise"] = _ddp_raises(rank)
    finally:
        for name, f in real.items():
            setattr(CompressedAllreduce, name, f)
    return out


def _ddp_steps(rank, steps, calls: list, phases: list, wire, policy: str = "skip", nan_at: int | None = None,
               record: list | None = None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model)
    opt = ZeroOneAdam(model.parameters(), lr=3e-3, warmup_comm_dtype=wire, bucket_cap_mb=CAP, **SMALL)
    opt.set_nonfinite_policy(policy)
    opt.attach(ddp)
    record = [] if record is None else record
    record.append(opt)  # the caller's list: the optimizer first, then a step each
    for t in range(1, steps + 1):
        x, y = _batch(t, rank)
        before = [p.detach().clone() for p in model.parameters()]
        local = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        start, first = len(calls), len(phases)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if t == nan_at:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        record.append({"before": before, "grads": [g.clone() for g in local],
                       "anchors": [b.flat["anchor"].clone() for b in opt._buckets if "anchor" in b.flat]})
        opt.step()
        record[-1].update(calls=len(calls) - start, phases=phases[first:], buckets=len(opt._buckets),
                          bytes=opt.comm_counter.last.bytes_sent)
    return record[1:], [p.detach().clone() for p in model.parameters()], opt.comm_counter.rounds


def _ddp_raises(rank) -> tuple[str, bool]:
    """Policy "raise", rank 1's gradient NaN at local step 21: (what step 24, a synchronisation, raised, whether
    every anchor was left as it was)."""
    record: list = []
    try:
        _ddp_steps(rank, 24, [], [], None, policy="raise", nan_at=21 if rank == 1 else None, record=record)
    except NonFiniteGradientError as exc:
        return f"step {len(record) - 1}: {exc}", all(torch.equal(b.flat["anchor"], a) for b, a in zip(
            record[0]._buckets, record[-1]["anchors"], strict=True))
    return "nothing", False


def test_ddp_hook_equals_the_simulation_and_local_steps_send_nothing():
    """2 gloo ranks with the DDP comm hook against the simulated cluster fed the ranks' own gradients:
    every worker's replica equals its rank's before every step, bit for bit, through refresh, 1-bit,
    local and synchronising steps; the local steps start no collective at all, DDP's included. The
    same with the refreshes' mean sent in fp16 (half their bytes) and as 8-bit codes sent by ``step()``
    (fewer still): equal to the simulation too. A synchronisation begins every bucket's call before it
    completes any (their round trips overlap). With the policy "raise" and a NaN dropped by rank 1 in a local
    step, both ranks raise at the next synchronisation and leave the anchor as it was."""
    steps, wires = 28, (None, "fp16", "uint8")
    runs = values(run_ranks(_ddp_rank, 2, steps, wires, timeout_s=120))
    kinds = ZeroOneSchedule(**SMALL).kinds(steps)
    for rank in (0, 1):
        said, kept = runs[rank]["raise"]
        assert said.startswith("step 24: ") and "dropped a NaN/inf gradient in a local step" in said and kept, said
    for wire in wires:
        (r0, p0, rounds0), (r1, p1, _) = runs[0][wire], runs[1][wire]
        assert [s["calls"] for s, k in zip(r0, kinds, strict=True) if k == L] == [0] * kinds.count(L)
        assert all(s["calls"] > 0 for s, k in zip(r0, kinds, strict=True) if k != L)
        n = r0[-1]["buckets"]
        assert n >= 3 and all(s["phases"] == ["begin"] * n + ["complete"] * n
                              for s, k in zip(r0, kinds, strict=True) if k == S), (wire, n)
        assert [s["bytes"] for s in r0] == [s["bytes"] for s in r1] and rounds0 == steps - kinds.count(L)
        model = _model()
        sim = ZeroOneAdam(model.parameters(), lr=3e-3, simulate_workers=2, warmup_comm_dtype=wire,
                          bucket_cap_mb=CAP, **SMALL)
        parted = False
        for t, (s0, s1) in enumerate(zip(r0, r1, strict=True), 1):
            for w, rec in enumerate((s0, s1)):
                with sim.worker_parameters(w):
                    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), rec["before"], strict=True)), \
                        (wire, t, w)
            parted |= any(not torch.equal(p, q) for p, q in zip(s0["before"], s1["before"], strict=True))
            sim.step_workers([s0["grads"], s1["grads"]])
            assert sim.comm_counter.last.bytes_sent == s0["bytes"], (wire, t)
        assert parted, "the replicas never differed: no local step was taken"
        assert kinds[-1] == S and all(torch.equal(p, q) for p, q in zip(p0, p1, strict=True))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), p0, strict=True))
    numel = sum(p.numel() for p in runs[0][None][1])
    refresh = [t for t, k in enumerate(kinds) if k == R]
    assert refresh and all(runs[0][None][0][t]["bytes"] - runs[0]["fp16"][0][t]["bytes"] == numel * 2 for t in refresh)
    assert all(runs[0]["uint8"][0][t]["bytes"] < runs[0]["fp16"][0][t]["bytes"] for t in refresh)


def test_two_level_simulation_keeps_the_replicas_apart_until_they_meet():
    """2 simulated nodes x 2 ranks (the two-level collective): after every synchronisation the four
    replicas are one model; between them they differ; the 1-bit calls cross nodes, fp32 stays inside."""
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=3e-3, simulate_workers=4, **SMALL)
    opt.set_topology(hierarchical=True, ranks_per_node=2)
    kinds = ZeroOneSchedule(**SMALL).kinds(24)
    for t in range(1, 25):
        opt.step_workers(_grads(opt, model, t, workers=4))
        reps = []
        for w in range(4):
            with opt.worker_parameters(w):
                reps.append([p.detach().clone() for p in model.parameters()])
        same = all(torch.equal(p, q) for r in reps[1:] for p, q in zip(reps[0], r, strict=True))
        assert same == (kinds[t - 1] != L), t
    assert opt.intra_node_counter.total.bytes_sent > 0 and opt.comm_counter.rounds == 24 - kinds.count(L)


# -- non-finite gradients in local steps ----------------------------------------------------------
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradient_in_a_local_step(policy, caplog):
    """A NaN in worker 1's gradient at local step 21: the worker drops it (no collective to agree in);
    at the next synchronisation (24) every worker learns it: "skip" logs and goes on, "raise" raises
    before the synchronisation changes the model."""
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=3e-3, simulate_workers=2, **SMALL)
    opt.set_nonfinite_policy(policy)
    assert ZeroOneSchedule(**SMALL).kinds(24)[20:] == [L, L, L, S]
    for t in range(1, 24):
        opt.step_workers(_grads(opt, model, t, nan={(21, 1)}))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    anchors = [b.flat["anchor"].clone() for b in opt._buckets]
    with caplog.at_level(logging.WARNING, logger="lightning_onebit"):
        if policy == "raise":
            with pytest.raises(NonFiniteGradientError, match="dropped a NaN/inf gradient in a local step"):
                opt.step_workers(_grads(opt, model, 24))
            # the model of the last synchronisation is intact
            assert all(torch.equal(b.flat["anchor"], a) for b, a in zip(opt._buckets, anchors, strict=True))
            return
        opt.step_workers(_grads(opt, model, 24))
    assert opt.dropped_gradients == 1 and "dropped a NaN/inf gradient" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def _run_with_a_nan_and_a_missing_gradient(opt, model, steps: int, reads: list | None = None) -> None:
    """``steps`` steps of two simulated workers: worker 1's gradient NaN at step 21, worker 0 without the
    head's bias gradient at step 15; ``reads``: the host reads of tensors in the local steps after the first."""
    kinds = ZeroOneSchedule(**SMALL).kinds(steps)
    for t in range(1, steps + 1):
        grads = _grads(opt, model, t, nan={(21, 1)})
        if t == 15:
            grads[0][-1] = None
        counting = reads is not None and kinds[t - 1] == L and kinds[t - 2] == L
        with _counting_reads(reads if counting else None):
            opt.step_workers(grads)


@contextlib.contextmanager
def _counting_reads(reads: list | None):
    if reads is None:
        yield
        return
    saved = {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def counted(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return saved[name](self, *args, **kwargs)
        return read

    for name in saved:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_a_local_step_on_a_device_reads_nothing_and_takes_the_cpus_bits(monkeypatch):
    """The local step a GPU takes, on the CPU: finiteness flags kept on the device (a flagged worker's
    gradients zeroed by its flag: a product by it would keep the NaN), each bucket's gradients in one flat
    buffer and every bucket's moments and parameters in one foreach op each (per param group: two here, with
    their own lr and weight decay), the torch ops instead of the CPU's kernels. No host read in a local step,
    and bit for bit the CPU's path through a NaN, a missing gradient and the synchronisation."""
    import lightning_onebit.optim.functional as functional
    import lightning_onebit.optim.local_steps as local_steps

    runs = {}
    for path in ("cpu", "device"):
        if path == "device":
            monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: True)
            monkeypatch.setattr(functional, "_fusable", lambda *tensors: False)  # a GPU runs the torch ops
        model = _model()
        params = list(model.parameters())
        groups = [{"params": params[:len(params) // 2]}, {"params": params[len(params) // 2:], "lr": 1e-3,
                                                          "weight_decay": 0.0}]
        opt = ZeroOneAdam(groups, lr=3e-3, weight_decay=0.01, simulate_workers=2, bucket_cap_mb=0.002, **SMALL)
        opt.set_nonfinite_policy("skip")
        reads: list[str] = []
        _run_with_a_nan_and_a_missing_gradient(opt, model, 26, reads)
        replicas = []
        for w in range(2):
            with opt.worker_parameters(w):
                replicas.append([p.detach().clone() for p in model.parameters()])
        runs[path] = (replicas, [{k: v.clone() for k, v in b.flat.items()} for b in opt._buckets],
                      opt.dropped_gradients, reads)
    (cpu, cpu_flat, cpu_dropped, _), (dev, dev_flat, dev_dropped, dev_reads) = runs["cpu"], runs["device"]
    assert cpu_dropped == dev_dropped == 1 and dev_reads == []
    assert all(torch.isfinite(p).all() for r in dev for p in r)
    for a, b in zip(cpu, dev, strict=True):
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q)
    for a, b in zip(cpu_flat, dev_flat, strict=True):
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []



def test_one_ranks_local_step_on_a_device_drops_a_nan_over_its_buckets_with_the_cpus_bits(monkeypatch):
    """The same with one rank's own gradients (no simulated workers): its buckets' gradients are slices of one
    buffer, which the flag zeroes in one op where a NaN came (all the slices, none of the memory around them), with
    the CPU's bits through the NaN, a missing gradient and the synchronisations."""
    import lightning_onebit.optim.functional as functional
    import lightning_onebit.optim.local_steps as local_steps

    runs = {}
    for path in ("cpu", "device"):
        if path == "device":
            monkeypatch.setattr(local_steps, "flags_stay_on_device", lambda device: True)
            monkeypatch.setattr(functional, "_fusable", lambda *tensors: False)
        model = _model()
        opt = ZeroOneAdam(model.parameters(), lr=3e-3, weight_decay=0.01, bucket_cap_mb=0.002, **SMALL)
        opt.set_nonfinite_policy("skip")
        for t in range(1, 27):
            x, y = _batch(t, 0)
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            (loss * float("nan") if t == 21 else loss).backward()
            if t == 15:
                list(model.parameters())[-1].grad = None
            opt.step()
        assert len(opt._buckets) > 2 and opt._buckets[0].grad._base is opt._buckets[-1].grad._base
        runs[path] = ([p.detach().clone() for p in model.parameters()], opt.dropped_gradients,
                      [{k: v.clone() for k, v in b.flat.items()} for b in opt._buckets])
    (cpu, cpu_dropped, cpu_flat), (dev, dev_dropped, dev_flat) = runs["cpu"], runs["device"]
    assert cpu_dropped == dev_dropped == 1 and all(torch.isfinite(p).all() for p in dev)
    assert all(torch.equal(p, q) for p, q in zip(cpu, dev, strict=True))
    for a, b in zip(cpu_flat, dev_flat, strict=True):
        assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_spans_cover_their_buffers_and_nothing_between():
    from lightning_onebit.optim.buckets import spans

    arena, other = torch.zeros(10), torch.zeros(2)
    a, b, c = arena[0:3], arena[3:5], arena[6:9]  # a and b adjacent, a gap before c
    views = spans([a, b, c, other])
    assert [(v.data_ptr(), v.numel()) for v in views] == [(a.data_ptr(), 5), (c.data_ptr(), 3), (other.data_ptr(), 2)]
    assert [(v.data_ptr(), v.numel()) for v in spans([b, a])] == [(b.data_ptr(), 2), (a.data_ptr(), 3)]

def test_bf16_parameters_take_the_local_steps_of_their_fp32_values():
    """bf16 parameters (``bf16-true``): their gradients reach the fp32 moments through the bucket's fp32
    buffers, so m and u are bit for bit those of fp32 parameters fed the same gradients, through local steps
    and synchronisations; the parameters stay bf16, within its rounding of the fp32 run."""
    g = torch.Generator().manual_seed(3)
    shapes = [(20, 8), (8,), (4, 8), (4,)]
    values = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    runs = []
    for dtype in (torch.float32, torch.bfloat16):
        params = [nn.Parameter(v.to(dtype)) for v in values]
        opt = ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, **SMALL)
        gg = torch.Generator().manual_seed(4)
        for _ in range(26):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gg).bfloat16().to(dtype)
            opt.step()
        runs.append((params, opt))
    (p32, o32), (p16, o16) = runs
    assert o16.step_counts == o32.step_counts and o16.step_counts[L] > 0 and o16.step_counts[S] > 0
    for a, b in zip(o32._buckets, o16._buckets, strict=True):
        for name in ("exp_avg", "update_sum"):
            assert torch.equal(a.flat[name], b.flat[name]), name
    for a, b in zip(p32, p16, strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, rtol=2e-2, atol=2e-2)


# -- checkpoints, arguments ---------------------------------------------------------------------
def test_state_dict_mid_local_interval_resumes_exactly():
    """One process: a state_dict taken between two synchronisations (anchor, u, step-size sums, the
    schedule's counters) continues bit for bit; a simulated cluster asks for sync_replicas() first."""
    a = _model()
    opt = ZeroOneAdam(a.parameters(), lr=3e-3, weight_decay=0.01, **SMALL)

    def step(m, o, t):
        x, y = _batch(t, 0)
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()

    for t in range(1, 22):  # 21 is a local step, 20 the last synchronisation
        step(a, opt, t)
    assert opt._since_sync == 1
    b = copy.deepcopy(a)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = ZeroOneAdam(b.parameters(), lr=3e-3, weight_decay=0.01, **SMALL)
    opt2.load_state_dict(sd)
    for t in range(22, 31):
        step(a, opt, t)
        step(b, opt2, t)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt2.step_counts == opt.step_counts and opt2.comm_counter.rounds == opt.comm_counter.rounds
    sim_model = _model()
    sim = ZeroOneAdam(sim_model.parameters(), lr=3e-3, simulate_workers=2, **SMALL)
    for t in range(1, 22):
        sim.step_workers(_grads(sim, sim_model, t))
    with pytest.raises(RuntimeError, match="call sync_replicas"):
        sim.state_dict()
    assert sim.sync_replicas() and sim.flushes == 1 and not sim.sync_replicas()
    sim.state_dict()


@pytest.mark.parametrize("kwargs,match", [
    ({"var_freeze_step": 0}, "var_freeze_step must be an int >= 1 or a float"),
    ({"var_freeze_step": 1.5}, "var_freeze_step must be"),
    ({"var_update_scaler": 0.5}, "var_update_scaler must be an int >= 1, got 0.5"),
    ({"local_step_scaler": True}, "local_step_scaler must be"),
    ({"local_step_clipper": 0}, "local_step_clipper must be an int >= 1"),
    ({"betas": (0.9, 1.0)}, "invalid betas"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroOneAdam(_model().parameters(), **kwargs)


def test_strategy_names_are_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_onebit import ZeroOneAdamStrategy

    assert {"zero_one_adam", "zero_one_adam_spawn"} <= set(StrategyRegistry)
    assert StrategyRegistry["zero_one_adam_spawn"]["init_params"]["start_method"] == "spawn"
    assert ZeroOneAdamStrategy().optimizer_cls is ZeroOneAdam


def test_fractions_of_the_run_resolve_when_the_length_is_known():
    model = _model()
    opt = ZeroOneAdam(model.parameters(), var_freeze_step=0.25, local_step_scaler=0.1)
    model(_batch(1, 0)[0]).sum().backward()
    with pytest.raises(ValueError, match=r"var_freeze_step=0.25 is a fraction of the run; call set_total_steps"):
        opt.step()
    opt.set_total_steps(200)
    assert (opt.schedule().var_freeze_step, opt.schedule().local_step_scaler) == (50, 20)
    opt.step()
    with pytest.raises(RuntimeError, match="cannot be added after the variance froze"):
        opt._local = True
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})


# -- the Lightning strategy -------------------------------------------------------------------------
STRATEGY_SCHEDULE = dict(var_freeze_step=3, var_update_scaler=2, local_step_scaler=2, local_step_clipper=3)


def _fit(tmp_path, model, max_epochs, ckpt_path=None, callbacks=(), **kw):
    import lightning as L
    from lit_models import SaveParams

    from lightning_onebit import CompressedDDPStrategy

    out = tmp_path / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    strategy = CompressedDDPStrategy("zero_one_adam", optimizer_kwargs=STRATEGY_SCHEDULE, start_method="forkserver")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=max_epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[SaveParams(str(out)), *callbacks], **kw)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.usefixtures("fresh_process_group")
def test_strategy_checkpoints_one_model_mid_interval_and_resumes_exactly(tmp_path):
    """strategy zero_one_adam on 2 processes, 8 steps an epoch: the epoch ends (8, 16, 32) fall inside
    local intervals, so the checkpoint synchronises first (one extra round) and holds one model; the
    run resumed from the epoch-1 file ends bit for bit like the uninterrupted one, and both ranks end
    with the same model (synchronised before on_train_end callbacks)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lit_models import DigitsMLP

    kinds = ZeroOneSchedule(**STRATEGY_SCHEDULE).kinds(32)
    assert [kinds[t - 1] for t in (8, 16, 24, 32)] == [L, L, S, L]
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
    # with an LR scheduler (halving every epoch): the local steps use each step's lr
    full = _fit(tmp_path / "a", DigitsMLP(scheduler=True), 4, callbacks=[ck], enable_checkpointing=True)
    for p, q in zip(full[0]["params"], full[1]["params"], strict=True):
        assert torch.equal(p, q)
    # nothing sent in the local steps; the checkpoint's round after step 16 is logged with step 17
    # (the one after 8 with step 9, a synchronisation anyway; the one after 32 with no step)
    silent = {t for t, b, _, _ in full[0]["steps"] if b == 0}
    assert silent == {t for t, k in enumerate(kinds, 1) if k == L} - {17}
    assert full[0]["rounds"] == 32 - kinds.count(L) + 3
    path = sorted((tmp_path / "ck").glob("epoch=1*.ckpt"))[0]
    extra = torch.load(path, weights_only=False)["optimizer_states"][0]["onebit"]["extra"]
    assert extra["since_sync"] == 0 and extra["flushes"] == 2 and extra["step_counts"]["local"] > 0
    resumed = _fit(tmp_path / "b", DigitsMLP(scheduler=True), 4, ckpt_path=str(path))
    for p, q in zip(full[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(p, q)
    assert resumed[0]["rounds"] == full[0]["rounds"]


@pytest.mark.usefixtures("fresh_process_group")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_strategy_validates_one_model(tmp_path, accumulate):
    """Validation at the end of each epoch (inside a local interval): every rank evaluates the same model.
    With gradient accumulation DDP's no_sync covers the other micro-batch and the hook runs once per step."""
    from lit_models import DigitsMLPWithValidation

    ranks = _fit(tmp_path, DigitsMLPWithValidation(), 2, enable_checkpointing=False,
                 accumulate_grad_batches=accumulate)
    per_epoch = 8 // accumulate
    assert [v[0] for v in ranks[0]["validated"]] == [v[0] for v in ranks[1]["validated"]] == [per_epoch, 2 * per_epoch]
    kinds = ZeroOneSchedule(**STRATEGY_SCHEDULE).kinds(2 * per_epoch)
    assert ranks[0]["rounds"] == sum(k != L for k in kinds) + sum(kinds[t - 1] == L for t in (per_epoch, 2 * per_epoch))
    for (_, a, _), (_, b, _) in zip(ranks[0]["validated"], ranks[1]["validated"], strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))

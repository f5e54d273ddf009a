"""DiLoCo (optim/diloco.py): the paper's algorithm written out here in plain torch, real gloo ranks,
no collective in the inner steps, the compressed outer all-reduce, exact resume, bad input."""

import io
import os
import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn as nn

from lightning_onebit import DiLoCo
from lightning_onebit.optim import NonFiniteGradientError
from lightning_onebit.strategies.checkpoints import SHARD_DIR, shard_path

from dist_utils import counting_collectives, run_ranks, values

H, OUTER = 3, 2  # inner steps per outer step, outer steps per run


def _model() -> nn.Module:
    """Embedding, LayerNorm, attention and a wide layer: where compression breaks."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.norm = nn.LayerNorm(16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.wide = nn.Linear(16, 96)
            self.out = nn.Linear(96, 40)

        def forward(self, tok):
            x = self.norm(self.emb(tok))
            x = x + self.attn(x, x, x, need_weights=False)[0]
            return self.out(torch.relu(self.wide(x)))

    return Net()


def _backward(net: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    tok = torch.randint(0, 40, (4, 6), generator=g)
    net.zero_grad()
    nn.functional.cross_entropy(net(tok).reshape(-1, 40), tok.roll(1, 1).reshape(-1)).backward()


def _reference(world: int, fragments: list[list[int]] | None = None, steps: int = H * OUTER, overlap: int = 0,
               mixing: float = 0.0, replicas: bool = False, fused: bool | None = None,
               keep_local: bool = False) -> list[torch.Tensor]:
    """The paper's algorithm in a few lines: replicas with their own AdamW, the mean of anchor - local,
    torch.optim.SGD(nesterov) on the anchor, every replica restarts from it. On one thread, as the
    ranks run: the attention's key bias gets a gradient of pure rounding noise, whose sign AdamW
    turns into a whole step, and the noise depends on the summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(world, fragments, steps, overlap, mixing, replicas, fused, keep_local)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(world: int, fragments: list[list[int]] | None, steps: int, overlap: int, mixing: float,
                     want_replicas: bool, fused: bool | None = None, keep_local: bool = False):
    """(Streaming DiLoCo with ``overlap`` and ``mixing``: fragment f's pseudo-gradient is taken after step
    t, its outer step lands after step t + overlap, and each replica keeps ``mixing`` of its own values, or
    with ``keep_local`` the inner steps it took since step t.)"""
    replicas = [_model() for _ in range(world)]
    inner = [torch.optim.AdamW(r.parameters(), lr=3e-3, weight_decay=0.01, fused=fused) for r in replicas]
    anchor = [p.detach().clone().requires_grad_(True) for p in replicas[0].parameters()]
    fragments = fragments or [list(range(len(anchor)))]
    F = len(fragments)
    outer = [torch.optim.SGD([anchor[i] for i in frag], lr=0.7, momentum=0.9, nesterov=True) for frag in fragments]
    in_flight: dict[int, tuple[int, list[torch.Tensor]]] = {}
    sent: dict[int, list[list[torch.Tensor]]] = {}  # per fragment, each replica's values when it was sent

    def land(f):
        _, grads = in_flight.pop(f)
        for i, g in zip(fragments[f], grads, strict=True):
            anchor[i].grad = g
        outer[f].step()
        with torch.no_grad():
            for r, net in enumerate(replicas):
                for k, i in enumerate(fragments[f]):
                    p = list(net.parameters())[i]
                    if keep_local:
                        p.sub_(sent[f][r][k]).add_(anchor[i])
                    else:
                        p.copy_(p.mul(mixing).add_(anchor[i], alpha=1 - mixing) if mixing else anchor[i])

    for t in range(1, steps + 1):
        for r, (net, opt) in enumerate(zip(replicas, inner, strict=True)):
            _backward(net, r, t - 1)
            opt.step()
        for f in [f for f, (at, _) in in_flight.items() if at == t]:
            land(f)
        for f, frag in enumerate(fragments):  # Streaming DiLoCo: fragment f after steps (f + 1) H / F mod H
            if t % H != (H * (f + 1) // F) % H:
                continue
            with torch.no_grad():
                grads = [sum((anchor[i] - list(net.parameters())[i]) / world for net in replicas) for i in frag]
                sent[f] = [[list(net.parameters())[i].clone() for i in frag] for net in replicas]
            in_flight[f] = (t + overlap, grads)
            if overlap == 0:
                land(f)
    for f in sorted(in_flight):  # the end of the run: what is in flight lands, the fragments with inner
        land(f)  # steps since their last outer step take one, and every replica takes the anchor
    last = {f: max(t for t in range(1, steps + 1) if t % H == (H * (f + 1) // F) % H) for f in range(F)}
    for f in [f for f in range(F) if last[f] < steps and (overlap or mixing)]:  # (those runs call outer_step())
        with torch.no_grad():
            in_flight[f] = (steps, [sum((anchor[i] - list(net.parameters())[i]) / world for net in replicas)
                                    for i in fragments[f]])
            sent[f] = [[list(net.parameters())[i].clone() for i in fragments[f]] for net in replicas]
        land(f)
    if overlap or mixing:
        with torch.no_grad():
            for net in replicas:
                for p, a in zip(net.parameters(), anchor, strict=True):
                    p.copy_(a)
    if want_replicas:
        return [a.detach() for a in anchor], [[p.detach() for p in net.parameters()] for net in replicas]
    return [a.detach() for a in anchor]


def _train(rank: int, world: int, compression: str, calls: list | None = None, **kwargs):
    net = _model()
    opt = DiLoCo(net.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H, compression=compression, **kwargs)
    for t in range(H * OUTER):
        _backward(net, rank, t)
        opt.step()
        if calls is not None:
            calls.append(opt.comm_counter.total.bytes_sent)
    return [p.detach().clone() for p in net.parameters()], opt


def _fp32_ranks(rank: int, world: int):
    seen: list[int] = []
    counts = []
    # each collective's place: how many inner steps had run (the finiteness OR is an all_to_all on gloo)
    with counting_collectives(lambda name: counts.append(len(seen))):
        params, opt = _train(rank, world, "fp32", seen)
    fused, _ = _train(rank, world, "fp32", fused=True)
    return params, counts, opt.comm_counter.total.bytes_sent, opt.outer_steps, fused


def test_fp32_on_gloo_ranks_is_the_papers_algorithm_and_inner_steps_send_nothing():
    (p0, calls0, sent, outer, fused0), (p1, _, _, _, fused1) = values(run_ranks(_fp32_ranks, 2))
    ref = _reference(2)
    for a, b, r in zip(p0, p1, ref, strict=True):
        assert torch.equal(a, b)  # one model on every rank after the outer step
        assert torch.equal(a, r)  # two ranks: (a / 2 + b / 2) rounds the same in any order
    # fused=True: torch's fused AdamW kernel inside, which rounds differently from the for-loop
    ref_fused = _reference(2, fused=True)
    assert all(torch.equal(a, b) and torch.equal(a, r) for a, b, r in zip(fused0, fused1, ref_fused, strict=True))
    assert not all(torch.equal(a, r) for a, r in zip(fused0, ref, strict=True))
    # collectives only at the outer steps (after inner steps 3 and 6): the finiteness agreement and the mean
    assert calls0 == [H - 1, H - 1, 2 * H - 1, 2 * H - 1] and outer == OUTER
    numel = sum(p.numel() for p in p0)
    assert sent > OUTER * numel * 4 * 2 * (2 - 1) / 2  # two fp32 ring all-reduces, plus the flags


def _compressed(rank: int, world: int, compression: str):
    calls: list[str] = []
    with counting_collectives(calls.append):
        params, opt = _train(rank, world, compression)
    anchor = opt.state_dict()["diloco"]["outer"]["anchor"]
    # a NaN in one rank's replica: the outer step fails on every rank and changes nothing
    replica = [p for g in opt.param_groups for p in g["params"]]
    for p in replica:
        p.grad = torch.zeros_like(p)
    opt.step()  # an inner step, so that an outer step has something to average
    if rank == 1:
        with torch.no_grad():
            replica[0][0, 0] = float("nan")
    before = opt.state_dict()["diloco"]
    failed = None
    try:
        opt.outer_step()
    except NonFiniteGradientError as exc:
        failed = str(exc)
    after = opt.state_dict()["diloco"]
    same = [torch.equal(a, b) for k in ("outer", "collectives") for a, b in zip(_tensors(before[k]), _tensors(after[k]),
                                                                                  strict=True)]
    unchanged = after["outer_steps"] == before["outer_steps"] and all(same) and len(same) > 2
    return params, opt.comm_counter.total.bytes_sent, anchor, len(calls), failed, unchanged


def _tensors(tree) -> list[torch.Tensor]:
    """Every tensor of a nested state (dicts in key order)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for x in tree for t in _tensors(x)]
    return []


def _every_compression(rank: int, world: int):
    return {c: _compressed(rank, world, c) for c in ("bf16", "8bit", "4bit", "2bit", "1bit")}


def test_compressed_outer_updates_agree_on_every_rank_and_send_fewer_bytes():
    r0, r1 = values(run_ranks(_every_compression, 2))  # one pair of processes for every codec
    ref = _reference(2)  # compressed, yet close to the exact outer step on this small run
    numel = sum(r.numel() for r in ref)
    fp32 = OUTER * numel * 4  # two ranks: the ring sends 2 (n-1)/n x 4 B per element and outer step
    # at least this many times fewer bytes than fp32 (the 18 tensors' scales and the flags cost some),
    # measured 2.0, 3.9, 7.7, 14.7, 29.3
    expected = {"bf16": 1.9, "8bit": 3.5, "4bit": 7.0, "2bit": 13.0, "1bit": 25.0}
    # largest error relative to the exact outer step, measured 0.008, 0.007, 0.074, 0.27, 0.66 (two outer
    # steps: the error feedback of the coarse codes has barely started)
    bound = {"bf16": 0.02, "8bit": 0.02, "4bit": 0.12, "2bit": 0.4, "1bit": 1.0}
    for compression, want in expected.items():
        (p0, sent, anchor0, calls, *failed0), (p1, _, anchor1, _, *failed1) = r0[compression], r1[compression]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True)) and torch.equal(anchor0, anchor1)
        # per outer step: bf16 an OR of the finiteness flags and the all-reduce; the compressed call carries
        # the flags in its agreement round, then its all-to-all and the gather of the server rows
        assert calls == OUTER * (2 if compression == "bf16" else 3), (compression, calls)
        for msg, unchanged in (failed0, failed1):  # one rank's NaN fails the outer step on both
            assert msg is not None and "non-finite pseudo-gradient" in msg and unchanged, (compression, msg)
        assert fp32 / sent >= want, (compression, fp32 / sent)
        err = max(float((a - r).abs().max() / r.abs().max()) for a, r in zip(p0, ref, strict=True))
        assert err < bound[compression], (compression, err)


def _two_level(rank: int, world: int):
    from lightning_onebit.comm import HierarchicalAllreduce

    out = {}
    for hierarchical in (None, False):  # 2 nodes x 2 ranks: automatic (two-level), then flat
        params, opt = _train(rank, world, "4bit", ranks_per_node=2, hierarchical=hierarchical)
        kinds = {type(c).__name__ for c in opt._collectives.values()}
        out[hierarchical] = (params, opt.comm_counter.total.bytes_sent, opt.intra_node_counter.total.bytes_sent,
                             kinds, opt.state_dict())
    assert out[None][3] == {HierarchicalAllreduce.__name__} and out[False][3] == {"CompressedAllreduce"}
    try:  # the error state of one layout does not fit the other
        DiLoCo(_model().parameters(), sync_every=H, compression="4bit", ranks_per_node=2,
               hierarchical=False).load_state_dict(out[None][4])
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_two_level_outer_allreduce_on_two_nodes_of_two_ranks():
    """With several ranks per node the compressed outer all-reduce averages in fp32 inside the node
    and compresses between nodes only: every rank ends on one model, close to the exact step,
    sending fewer compressed bytes than the flat call; a checkpoint of one layout refuses the other."""
    results = values(run_ranks(_two_level, 4))
    ref = _reference(4)
    for hierarchical in (None, False):
        p0 = results[0][hierarchical][0]
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(p0, r[hierarchical][0], strict=True))
        err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(p0, ref, strict=True))
        assert err < 0.1, (hierarchical, err)  # measured 0.058 (two-level), 0.053 (flat)
    two, flat = results[0][None], results[0][False]
    assert two[2] > 0 and flat[2] == 0  # fp32 traffic inside the node only in the two-level layout
    assert two[1] < flat[1] / 2, (two[1], flat[1])  # measured 3906 against 11714 bytes
    assert "two-level with 2 ranks per node" in results[0]["mismatch"]


def test_resume_mid_interval_is_bit_for_bit():
    full, _ = _train(0, 1, "fp32")
    net = _model()
    opt = DiLoCo(net.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H)
    for t in range(H + 1):  # one step into the second interval
        _backward(net, 0, t)
        opt.step()
    buf = io.BytesIO()  # the split state as files hold it: what every rank shares, and this rank's own
    torch.save({"shared": opt.shared_state_dict(), "rank": opt.rank_state_dict()}, buf)
    buf.seek(0)
    split = torch.load(buf, weights_only=True)
    anchor = opt.anchor_views()
    saved = {"model": net.state_dict(), "opt": opt.state_dict()}
    net2 = _model()
    net2.load_state_dict(saved["model"])
    opt2 = DiLoCo(net2.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H)
    opt2.load_state_dict(saved["opt"])
    net3 = _model()  # its parameters are not the replica: the rank's part brings it back
    opt3 = DiLoCo(net3.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H)
    opt3.load_split_state_dict(split["shared"], split["rank"])
    for t in range(H + 1, H * OUTER):
        for n, o in ((net2, opt2), (net3, opt3)):
            _backward(n, 0, t)
            o.step()
    for n, o in ((net2, opt2), (net3, opt3)):
        assert all(torch.equal(a, b) for a, b in zip(full, n.parameters(), strict=True))
        assert o.outer_steps == OUTER and o.inner_steps == H * OUTER
    with pytest.raises(ValueError, match="sync_every=3.*sync_every=4"):
        DiLoCo(_model().parameters(), sync_every=4).load_state_dict(saved["opt"])
    # without the rank's part: the replica is the anchor, the moments fresh (or given), the clock kept
    net4 = _model()
    opt4 = DiLoCo(net4.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H)
    opt4.load_split_state_dict(split["shared"], inner=split["rank"]["inner"])
    assert all(torch.equal(p, anchor[id(q)]) for p, q in zip(net4.parameters(), net.parameters(), strict=True))
    assert _same(_tensors(torch.optim.Optimizer.state_dict(opt4)["state"]), _tensors(split["rank"]["inner"]))
    opt4.load_split_state_dict(split["shared"])
    assert not opt4.state and opt4._t == H + 1 and opt4.outer_steps == 1
    with pytest.raises(ValueError, match="shared part of a DiLoCo state"):
        opt4.load_state_dict(split["shared"])
    with pytest.raises(ValueError, match="not the shared part"):
        opt4.load_split_state_dict(saved["opt"])


def test_bad_input_is_named_and_a_nonfinite_gradient_follows_the_policy():
    params = list(_model().parameters())
    for kw, msg in (({"sync_every": 0}, "sync_every"), ({"compression": "3bit"}, "compression must be one of"),
                    ({"ranks_per_node": 0}, "ranks_per_node"), ({"hierarchical": "yes"}, "hierarchical"),
                    ({"overlap": 3, "sync_every": 3}, "overlap must be"), ({"mixing": 1.0}, "mixing must be"),
                    ({"keep_local": True, "mixing": 0.5}, "keep_local must be"),
                    ({"outer_momentum": 1.0}, "outer_momentum"), ({"outer_lr": 0}, "outer_lr"),
                    ({"on_nonfinite": "ignore"}, "on_nonfinite"), ({"lr": -1.0}, "learning rate"),
                    ({"offload": "yes"}, "offload must be True or False")):
        with pytest.raises(ValueError, match=msg):
            DiLoCo(params, **kw)
    net = _model()
    before = [p.detach().clone() for p in net.parameters()]
    for policy in ("raise", "skip"):
        opt = DiLoCo(net.parameters(), sync_every=2, on_nonfinite=policy)
        _backward(net, 0, 0)
        next(net.parameters()).grad[0, 0] = float("nan")
        if policy == "raise":
            with pytest.raises(NonFiniteGradientError, match="inner step 1"):
                opt.step()
        else:
            opt.step()
            assert opt.skipped_steps == 1 and opt.inner_steps == 0
        assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


# -- through Lightning: strategy="diloco" on 2 processes --------------------------------------------
def _lightning_fit(out, ckpt_path=None, checkpoint=False, diloco=None, devices=2, probe=False, **trainer_kwargs):
    """Each rank's final state (``SaveParams``); with ``probe``, also what it held once restored (``_Probe``)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lit_models import DigitsBNWithValidation, SaveParams

    from lightning_onebit import DiLoCoStrategy

    out.mkdir(parents=True, exist_ok=True)
    callbacks = [SaveParams(str(out)), *([_Probe(str(out))] if probe else [])]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpt"), save_top_k=-1, every_n_epochs=1))
    strategy = DiLoCoStrategy(**(diloco or {"sync_every": 3}), start_method="forkserver")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu",
                        devices=devices, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=checkpoint, default_root_dir=str(out),
                        callbacks=callbacks, **trainer_kwargs)
    trainer.fit(DigitsBNWithValidation(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


class _Probe(L.Callback):
    """What each rank's DiLoCo holds once a resume restored it (at the start of training), and the warnings
    the rank gave until then."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def setup(self, trainer, pl_module, stage) -> None:  # before the checkpoint is read
        self._catching = warnings.catch_warnings(record=True)
        self._seen = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module) -> None:
        self._catching.__exit__(None, None, None)
        opt = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        torch.save({"replica": opt._flat(), "outer": dict(opt._outer), "collectives": sorted(opt._collectives),
                    "errors": [t for c in opt._collectives.values() for t in _tensors(c.state_dict())],
                    "pending": {f: r for f, (_, _, r) in opt._pending.items()},
                    "inner": torch.optim.Optimizer.state_dict(opt)["state"],
                    "warnings": [str(w.message) for w in self._seen]},
                   os.path.join(self.outdir, f"probe{trainer.global_rank}.pt"))


def _probes(out, devices: int) -> list[dict]:
    return [torch.load(out / f"probe{r}.pt", weights_only=False) for r in range(devices)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _main_file_and_shards(ckpt, params: list[torch.Tensor]) -> tuple[dict, list[dict]]:
    """The main file holds what the ranks share: no replica, moments or error state, and optimizer state
    only as large as the anchor, the outer momentum and the outer steps in flight, whatever the number
    of ranks. Each rank's own is in its shard. Returns the main file and each rank's shard state."""
    saved = torch.load(ckpt, weights_only=False)
    (state,) = saved["optimizer_states"]
    section = state["diloco"]
    assert state["state"] == {} and "ranks" not in section and set(section["outer"]) == {"anchor", "momentum0"}
    assert section["per_rank"] == "shards" and section["world_size"] == 2
    assert all(isinstance(f, int) for f in section["collectives"])  # which fragments have one, not their state
    d = sum(p.numel() for p in params)
    assert section["outer"]["anchor"].numel() == d
    assert sum(t.numel() for t in _tensors(saved["optimizer_states"])) == (2 + len(section["pending"])) * d
    shards = [torch.load(shard_path(ckpt, r, 2), weights_only=True) for r in range(2)]
    assert [s["rank"] for s in shards] == [0, 1] and all(s["world_size"] == 2 for s in shards)
    own = [s["optimizers"][0] for s in shards]
    assert all(o["replica"].numel() == d and o["inner"] for o in own)
    assert not torch.equal(own[0]["replica"], own[1]["replica"])  # saved inside an interval: each its own
    return saved, own


@pytest.mark.usefixtures("fresh_process_group")
@pytest.mark.budget(40)  # two 2-rank fits
def test_strategy_validates_the_anchor_ends_on_one_model_and_resumes_mid_interval_bit_for_bit(tmp_path):
    """With a BatchNorm model: each rank's running statistics come from its own batches. DDP does not
    broadcast them in every forward (a round per inner step); the ranks take their mean at each outer
    step, validate with the mean, and resume each with its own."""
    full = _lightning_fit(tmp_path / "full", checkpoint=True)
    assert full[0]["broadcast_buffers"] is False
    # 8 steps per epoch, an outer step every 3: validation after step 8 falls inside an interval,
    # yet both ranks evaluate one model (the anchor, the mean of the buffers); the end of fit adds an
    # outer step (16 = 5 x 3 + 1)
    (step, v0, b0), (_, v1, b1) = full[0]["validated"][0], full[1]["validated"][0]
    assert step == 8 and _same(v0, v1) and _same(b0, b1)
    assert _same(full[0]["params"], full[1]["params"]) and _same(full[0]["buffers"], full[1]["buffers"])
    assert full[0]["global_step"] == 16 and full[0]["comm_steps"] == 16
    # 6 outer steps, each with its buffer mean; a buffer mean per validation (the sanity check's and
    # 2 epochs') and per checkpoint (2)
    assert full[0]["rounds"] == 6 * 2 + 3 + 2
    # resumed from the checkpoint after epoch 1 (mid-interval), each rank continues its own replica
    # and its own buffers
    (ckpt,) = (tmp_path / "full" / "ckpt").glob("epoch=0-*.ckpt")
    resumed = _lightning_fit(tmp_path / "resumed", ckpt_path=str(ckpt))
    for r in range(2):
        assert _same(full[r]["params"], resumed[r]["params"]) and _same(full[r]["buffers"], resumed[r]["buffers"])
    saved, ranks = _main_file_and_shards(ckpt, full[0]["params"])  # each rank's shard: its own buffers
    assert len(ranks) == 2 and not torch.equal(ranks[0]["buffers"][0], ranks[1]["buffers"][0])  # own batches
    # the model's buffers: the mean of the ranks' (running mean; num_batches_tracked is equal)
    assert torch.allclose(saved["state_dict"]["net.1.running_mean"],
                          (ranks[0]["buffers"][0] + ranks[1]["buffers"][0]) / 2, rtol=0, atol=1e-6)


_OVERLAPPED_4BIT = {"sync_every": 4, "compression": "4bit", "overlap": 2, "keep_local": True}


@pytest.fixture(scope="module")
def overlapped_4bit_fit(tmp_path_factory):
    """A 2-rank fit whose 4-bit outer all-reduce overlaps on its thread, validating twice an epoch, with a
    checkpoint after every epoch (the first saved while an outer step is in flight): (its directory, the
    ranks' final state)."""
    out = tmp_path_factory.mktemp("overlapped_4bit")
    return out, _lightning_fit(out / "full", checkpoint=True, diloco=_OVERLAPPED_4BIT, val_check_interval=0.5)


@pytest.mark.usefixtures("fresh_process_group")
@pytest.mark.budget(40)  # three 2-rank fits (one in the module's fixture)
def test_a_checkpoint_written_while_validation_holds_the_anchor_resumes_bit_for_bit(tmp_path, overlapped_4bit_fit):
    """Validating twice an epoch, ModelCheckpoint saves at the end of validation, while the parameters
    and buffers hold the anchor and the mean: the checkpoint must still keep each rank's own replica.
    Here the 4-bit outer all-reduce overlaps on its thread: the one sent after step 8 is in flight while
    Lightning's own collectives (the buffers' mean, the checkpoint's barrier) run on the main thread."""
    src, full = overlapped_4bit_fit
    assert [v[0] for v in full[0]["validated"]] == [4, 8, 12, 16]
    assert _same(full[0]["params"], full[1]["params"])  # the fit's end lands the last step: one model
    ckpt = src / "full" / "ckpt" / "epoch=0-step=8.ckpt"  # saved at validation's end, mid-flight
    saved, own = _main_file_and_shards(ckpt, full[0]["params"])
    assert saved["optimizer_states"][0]["diloco"]["pending"]
    # each rank's error state (the collective's, keep_local's sent replica) is in its own shard only
    assert not torch.equal(own[0]["collectives"][0]["worker"], own[1]["collectives"][0]["worker"])
    assert all("sent0" in o["outer"] for o in own)
    resumed = _lightning_fit(tmp_path / "resumed", ckpt_path=str(ckpt), diloco=_OVERLAPPED_4BIT,
                             val_check_interval=0.5)
    # and a checkpoint of the format before shards, every rank's state in the main file, too
    old = _gathered(ckpt, tmp_path / "gathered.ckpt")
    gathered = _lightning_fit(tmp_path / "from_gathered", ckpt_path=str(old), diloco=_OVERLAPPED_4BIT,
                              val_check_interval=0.5)
    for r in range(2):
        for run in (resumed, gathered):
            assert _same(full[r]["params"], run[r]["params"]) and _same(full[r]["buffers"], run[r]["buffers"])


def _gathered(ckpt, out):
    """``ckpt`` as checkpoints were written before the shards: every rank's ``local_state()`` (replica,
    whole ``state_dict()``, buffers) gathered into the main file under ``diloco["ranks"]``."""
    saved = torch.load(ckpt, weights_only=False)
    (state,) = saved["optimizer_states"]
    shared = {k: v for k, v in state["diloco"].items() if k not in ("world_size", "per_rank")}
    ranks = []
    for r in range(2):
        own = torch.load(shard_path(ckpt, r, 2), weights_only=True)["optimizers"][0]
        section = dict(shared, outer={**shared["outer"], **own["outer"]}, collectives=own["collectives"],
                       **{k: own[k] for k in ("inner_steps", "skipped_steps", "comm_counter")})
        ranks.append({"params": own["replica"], "buffers": own["buffers"],
                      "optimizer": {"state": own["inner"], "param_groups": state["param_groups"], "diloco": section}})
    first = ranks[0]["optimizer"]
    saved["optimizer_states"] = [dict(first, diloco=dict(first["diloco"], ranks=ranks))]
    torch.save(saved, out)
    return out


@pytest.mark.usefixtures("fresh_process_group")
@pytest.mark.budget(60)  # a 3-rank resume of one step, a 3-rank start that stops at the resume, a 2-rank resume
def test_a_resume_on_other_ranks_or_without_a_shard_starts_from_the_anchor(tmp_path, overlapped_4bit_fit):
    """2 -> 3 ranks: the anchor, the outer momentum and the outer step in flight are kept, every rank
    starts from the anchor (error state zero) with rank 0's AdamW moments, and one warning says so, on
    rank 0 only; strict_resume=True stops instead. On 2 ranks without rank 1's shard: rank 1 alone starts
    so, with a warning naming it and the path, and rank 0 continues its own state."""
    src, _ = overlapped_4bit_fit
    ckpt = src / "full" / "ckpt" / "epoch=0-step=8.ckpt"
    main = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["diloco"]
    shard0 = torch.load(shard_path(ckpt, 0, 2), weights_only=True)["optimizers"][0]

    def from_the_anchor(p: dict) -> None:
        anchor = p["outer"]["anchor"]
        assert torch.equal(anchor, main["outer"]["anchor"]) and torch.equal(p["outer"]["momentum0"],
                                                                           main["outer"]["momentum0"])
        assert torch.equal(p["replica"], anchor) and torch.equal(p["outer"]["sent0"], anchor)  # sent from the anchor
        assert p["collectives"] == [0] and all(not t.any() for t in p["errors"])  # error state zero
        assert _same(_tensors(p["inner"]), _tensors(shard0["inner"]))  # rank 0's AdamW moments
        assert _same(_tensors(p["pending"]), _tensors(main["pending"]))  # the outer step in flight, kept

    three = _lightning_fit(tmp_path / "three", ckpt_path=str(ckpt), diloco=_OVERLAPPED_4BIT, devices=3, max_steps=9,
                           probe=True)
    probes = _probes(tmp_path / "three", 3)
    for p in probes:
        from_the_anchor(p)
    said = [[w for w in p["warnings"] if "anchor" in w or "shard" in w] for p in probes]
    assert len(said[0]) == 1 and "written on 2 ranks, resuming on 3" in said[0][0] and said[1:] == [[], []], said
    assert _same(three[0]["params"], three[2]["params"])  # and the 3 ranks train on to one model
    with pytest.raises(Exception, match="resuming on 3.*strict_resume=True"):
        _lightning_fit(tmp_path / "strict", ckpt_path=str(ckpt), diloco={**_OVERLAPPED_4BIT, "strict_resume": True},
                       devices=3, max_steps=9)
    # the same world size without rank 1's shard
    lost = tmp_path / "lost" / ckpt.name
    lost.parent.mkdir()
    shutil.copy(ckpt, lost)
    shutil.copytree(src / "full" / "ckpt" / SHARD_DIR / ckpt.name, tmp_path / "lost" / SHARD_DIR / ckpt.name)
    Path(shard_path(lost, 1, 2)).unlink()
    _lightning_fit(tmp_path / "two", ckpt_path=str(lost), diloco=_OVERLAPPED_4BIT, max_steps=9, probe=True)
    p0, p1 = _probes(tmp_path / "two", 2)
    from_the_anchor(p1)
    assert torch.equal(p0["replica"], shard0["replica"]) and _same(p0["errors"], _tensors(shard0["collectives"][0]))
    said = [[w for w in p["warnings"] if "anchor" in w or "shard" in w] for p in (p0, p1)]
    assert said[0] == [] and len(said[1]) == 1, said
    assert f"rank 1: the DiLoCo shard {shard_path(lost, 1, 2)} is missing" in said[1][0]


def test_strategy_refuses_what_it_cannot_run():
    from lightning_onebit import DiLoCoStrategy

    with pytest.raises(ValueError, match="compression must be one of"):
        DiLoCoStrategy(compression="3bit")
    with pytest.raises(ValueError, match="hierarchical"):
        DiLoCoStrategy(hierarchical="auto")
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        DiLoCoStrategy(ddp_comm_hook=lambda *a: None)
    with pytest.raises(ValueError, match="L2 regularisation"):
        DiLoCo.from_optimizer(torch.optim.Adam(_model().parameters(), weight_decay=0.1))
    with pytest.raises(ValueError, match="cannot convert SGD"):
        DiLoCo.from_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    adamw = torch.optim.AdamW(_model().parameters(), lr=2e-3, betas=(0.8, 0.99), weight_decay=0.05, fused=True)
    new = DiLoCo.from_optimizer(adamw, sync_every=8)
    # the user's fused kernel stays the inner step's
    assert [(g["lr"], g["betas"], g["weight_decay"], g["fused"]) for g in new.param_groups] == [
        (2e-3, (0.8, 0.99), 0.05, True)]


def _fragmented(rank: int, world: int):
    net = _model()
    opt = DiLoCo(net.parameters(), lr=3e-3, weight_decay=0.01, sync_every=H, fragments=3)
    synced = []
    for t in range(2 * H):
        _backward(net, rank, t)
        opt.step()
        synced.append(opt.comm_counter.rounds)
    views = opt.anchor_views()
    return [views[id(p)].clone() for p in net.parameters()], opt.fragment_tensors(), synced


def test_streaming_fragments_each_sync_on_their_own_schedule_like_the_reference():
    (p0, frags, synced), (p1, _, _) = values(run_ranks(_fragmented, 2))  # the anchors
    assert len(frags) == 3 and sorted(i for f in frags for i in f) == list(range(len(p0)))
    assert synced == [1, 2, 3, 4, 5, 6]  # H = F = 3: one fragment's outer step after every inner step
    ref = _reference(2, frags, steps=2 * H)
    assert all(torch.equal(a, b) and torch.equal(a, r) for a, b, r in zip(p0, p1, ref, strict=True))


class _Inline:
    """A sender that runs each job at once on the caller's thread: the arithmetic without the thread."""

    def submit(self, fn):
        from concurrent.futures import Future

        done = Future()
        done.set_result(fn())
        return done


def _overlapped(rank: int, world: int, compression: str, inline: bool = False, **extra):
    """Streaming DiLoCo with overlap 1 and mixing 0.5, once straight through and once saved while an
    outer step is in flight and resumed into a fresh model and optimizer. Between steps the main thread
    all-reduces on the default group, as Lightning's logging does while an outer step is in flight."""
    import threading

    import torch.distributed as dist

    kw = {"lr": 3e-3, "weight_decay": 0.01, "sync_every": H, "fragments": 3, "overlap": 1, "mixing": 0.5,
          "compression": compression, **extra}
    net = _model()
    opt = DiLoCo(net.parameters(), **kw)
    if inline:
        opt._means._sender = _Inline()
    threads = set()
    with counting_collectives(lambda name: threads.add(threading.current_thread() is threading.main_thread())):
        for t in range(2 * H):
            _backward(net, rank, t)
            opt.step()
            dist.all_reduce(torch.ones(3))
            if t == H:  # after inner step H + 1: fragment 0 was sent and lands at the next step
                assert not opt.synced
                buf = io.BytesIO()  # as a checkpoint file: the live optimizer state goes on changing
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt.outer_step()  # the end of a fit: the step in flight lands
    assert opt.synced
    views = opt.anchor_views()
    full = ([views[id(p)].clone() for p in net.parameters()], [p.detach().clone() for p in net.parameters()])
    net2 = _model()
    net2.load_state_dict(saved["model"])
    opt2 = DiLoCo(net2.parameters(), **kw)
    opt2.load_state_dict(saved["opt"])
    for t in range(H + 1, 2 * H):
        _backward(net2, rank, t)
        opt2.step()
    opt2.outer_step()
    views = opt2.anchor_views()
    resumed = ([views[id(p)].clone() for p in net2.parameters()], [p.detach().clone() for p in net2.parameters()])
    return full, resumed, opt.fragment_tensors(), threads, opt.comm_counter.total.bytes_sent


def _nan_in_flight(rank: int, world: int) -> str | None:
    """One rank's NaN in a compressed outer step that overlaps: the step fails when it lands, on both ranks."""
    net = _model()
    opt = DiLoCo(net.parameters(), lr=3e-3, sync_every=H, compression="4bit", overlap=1, on_nonfinite="skip")
    for t in range(H - 1):
        _backward(net, rank, t)
        opt.step()
    _backward(net, rank, H - 1)
    if rank == 1:
        with torch.no_grad():
            net.wide.weight[0, 0] = float("nan")
    opt.step()  # the outer step goes out with the NaN in one replica; nothing fails yet
    _backward(net, rank, H)  # NaN gradients on that rank: its inner step is skipped (the policy)
    try:
        opt.step()
    except NonFiniteGradientError as exc:
        return str(exc)
    return None


def _lost_in_flight(rank: int, world: int, how: str):
    """Rank 1 dies, or stalls past the process group's timeout, instead of sending its second outer step
    (4-bit, on the sender thread); rank 0 sends its own and trains on until it lands (out: the error, how
    long the step took, at which inner step, whether the anchor stayed as it was, outer steps sent)."""
    import time

    net = _model()
    opt = DiLoCo(net.parameters(), lr=3e-3, sync_every=H, compression="4bit", overlap=2)
    for t in range(2 * H + 2):
        if t == 2 * H - 1 and rank == 1:
            if how == "dies":
                raise SystemExit(1)  # the process ends, its sockets close
            time.sleep(6)
            return None
        _backward(net, rank, t)
        anchor = opt._outer["anchor"].clone() if "anchor" in opt._outer else None
        t0 = time.monotonic()
        try:
            opt.step()
        except Exception as exc:
            unchanged = torch.equal(opt._outer["anchor"], anchor)
            return type(exc).__name__, str(exc), time.monotonic() - t0, t, unchanged, opt.outer_steps
    return None


@pytest.mark.parametrize("how", ["dies", "stalls"])
@pytest.mark.budget(30)  # the stall waits for the timeout by design
def test_a_lost_rank_fails_the_outer_allreduce_in_flight_where_it_lands(how):
    """The sender thread's collective runs on DiLoCo's own group, made with the default group's timeout:
    a rank that dies fails the others at once, one that stalls after the timeout, never later; the
    error names the fragment, the inner step and the rank, and the outer step is not applied."""
    (s0, r0), (s1, _) = run_ranks(_lost_in_flight, 2, how, timeout_s=3)
    assert s0 == "ok" and r0 is not None, r0
    name, msg, elapsed, t, unchanged, outer_steps = r0
    assert name == "CollectiveError", msg
    assert "outer all-reduce of fragment 0, sent after inner step 6" in msg and "rank 0" in msg, msg
    assert t == 2 * H + 1 and unchanged and outer_steps == 2, (t, unchanged, outer_steps)  # lands, not applied
    assert elapsed < (2 if how == "dies" else 3 + 2), elapsed


def _overlaps(rank: int, world: int):
    out = {c: _overlapped(rank, world, c) for c in ("fp32", "4bit")}
    out["inline"] = _overlapped(rank, world, "4bit", inline=True)
    out["keep_local"] = _overlapped(rank, world, "fp32", overlap=2, mixing=0.0, keep_local=True)
    out["nan"] = _nan_in_flight(rank, world)
    return out


def test_streaming_overlap_and_mixing_are_the_papers_and_resume_in_flight():
    """fp32: the reference's numbers; 4-bit: the outer all-reduce runs on the sender thread, on a group of
    its own next to the main thread's collectives, with the same numbers as without the thread."""
    r0, r1 = values(run_ranks(_overlaps, 2))
    frags = r0["fp32"][2]
    ref_anchor, ref_replicas = _reference(2, frags, steps=2 * H, overlap=1, mixing=0.5, replicas=True)
    for rank, r in enumerate((r0, r1)):
        full, resumed = r["fp32"][:2]
        assert all(torch.equal(a, b) for a, b in zip(full[0], ref_anchor, strict=True))
        # the fit's end: every replica, mixed until then, takes the anchor
        assert all(torch.equal(a, b) for a, b in zip(full[1], ref_replicas[rank], strict=True))
        for compression in ("fp32", "4bit"):
            full, resumed = r[compression][:2]
            assert all(torch.equal(a, b) for a, b in zip(full[0] + full[1], resumed[0] + resumed[1], strict=True))
        threaded, inline = r["4bit"], r["inline"]
        assert all(torch.equal(a, b) for a, b in zip(threaded[0][0], inline[0][0], strict=True))
        assert threaded[3] == {True, False} and inline[3] == {True}  # the thread sends; the main thread too
        assert threaded[4] == inline[4] > 0  # the thread's bytes counted, as without it
        assert r["nan"] is not None and "non-finite pseudo-gradient" in r["nan"], r["nan"]
    assert all(torch.equal(a, b) for a, b in zip(r0["4bit"][0][0], r1["4bit"][0][0], strict=True))
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(r0["4bit"][0][0], ref_anchor, strict=True))
    assert err < 0.12, err
    unmixed = _reference(2, frags, steps=2 * H, overlap=1, mixing=0.0)  # so the mixing shows in the anchor
    assert any(not torch.equal(a, b) for a, b in zip(r0["fp32"][0][0], unmixed, strict=True))
    # keep_local: the replicas move onto each landing anchor with their inner steps since it was sent
    kept_anchor, kept_replicas = _reference(2, frags, steps=2 * H, overlap=2, keep_local=True, replicas=True)
    replaced = _reference(2, frags, steps=2 * H, overlap=2)
    for rank, r in enumerate((r0, r1)):
        full, resumed = r["keep_local"][:2]
        assert all(torch.equal(a, b) for a, b in zip(full[0], kept_anchor, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(full[1], kept_replicas[rank], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(full[0] + full[1], resumed[0] + resumed[1], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(kept_anchor, replaced, strict=True))


def _local_sgd(rank: int, world: int):
    """DiLoCo with SGD inside and plain averaging outside (local SGD), exact and 4-bit."""
    out = {}
    for compression in ("fp32", "4bit"):
        net = _model()
        opt = DiLoCo(net.parameters(), lr=0.05, inner=torch.optim.SGD, inner_kwargs={"momentum": 0.9},
                     sync_every=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False, compression=compression)
        for t in range(H * OUTER):
            _backward(net, rank, t)
            opt.step()
        out[compression] = ([p.detach().clone() for p in net.parameters()], type(opt._inner).__name__,
                            sorted(opt.state[next(net.parameters())]))
    return out


def test_local_sgd_is_diloco_with_sgd_inside_and_averaging_outside():
    """Every H steps of SGD with momentum on its own replica, the ranks average their models: the plain-torch
    local SGD below, to rounding (the outer step subtracts the mean difference from the anchor); its SGD's
    momentum buffers stay per rank; 4-bit outer updates stay close and identical on every rank."""
    r0, r1 = values(run_ranks(_local_sgd, 2))
    replicas = [_model() for _ in range(2)]
    inner = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in replicas]
    for t in range(H * OUTER):
        for rank, (net, opt) in enumerate(zip(replicas, inner, strict=True)):
            _backward(net, rank, t)
            opt.step()
        if (t + 1) % H == 0:
            with torch.no_grad():
                for ps in zip(*(r.parameters() for r in replicas), strict=True):
                    mean = (ps[0] + ps[1]) / 2
                    for p in ps:
                        p.copy_(mean)
    ref = [p.detach() for p in replicas[0].parameters()]
    exact, name, state = r0["fp32"]
    assert name == "SGD" and state == ["momentum_buffer"]
    assert all(torch.equal(a, b) for a, b in zip(exact, r1["fp32"][0], strict=True))
    for a, b in zip(exact, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    coded = r0["4bit"][0]
    assert all(torch.equal(a, b) for a, b in zip(coded, r1["4bit"][0], strict=True))
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(coded, ref, strict=True))
    assert 0 < err < 0.1, err


def test_inner_optimizer_arguments_go_to_one_place():
    """AdamW's own arguments with another inner optimizer, an argument given twice, an inner lr in
    inner_kwargs, a class that is not an optimizer: each fails at construction, naming it."""
    ps = list(_model().parameters())
    with pytest.raises(ValueError, match=r"\['betas'\] are the inner AdamW's arguments, but inner is SGD"):
        DiLoCo(ps, inner=torch.optim.SGD, betas=(0.8, 0.9))
    with pytest.raises(ValueError, match=r"\['eps'\] given both as arguments and in inner_kwargs"):
        DiLoCo(ps, eps=1e-6, inner_kwargs={"eps": 1e-7})
    with pytest.raises(ValueError, match="inner learning rate is lr"):
        DiLoCo(ps, inner=torch.optim.SGD, inner_kwargs={"lr": 0.1})
    with pytest.raises(ValueError, match="inner must be a torch.optim.Optimizer class"):
        DiLoCo(ps, inner=torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="SGD does not take"):
        DiLoCo(ps, inner=torch.optim.SGD, inner_kwargs={"betas": (0.9, 0.99)})
    adamw = DiLoCo(ps, inner_kwargs={"amsgrad": True})  # AdamW's other options go through inner_kwargs
    assert [(g["betas"], g["eps"], g["weight_decay"], g["amsgrad"]) for g in adamw.param_groups] == [
        ((0.9, 0.999), 1e-8, 1e-2, True)]

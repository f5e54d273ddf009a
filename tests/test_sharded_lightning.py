"""``strategy="diloco_fsdp"`` through Lightning: FSDP2 inside each node, DiLoCo between nodes (4 gloo ranks as
2 emulated nodes of 2, the trainer's ``devices=4`` with ``ranks_per_node=2``).

One 4-rank job runs every fit the tests need: a 2-epoch fit of a transformer (embeddings, LayerNorm,
attention, biases next to a wider layer) sharded by ``auto_wrap_policy``, with a checkpoint directory after
each epoch (mid-interval); its resume on the same mesh (bit for bit); resumes on other meshes (1x4 and,
from a 4x1 save, 2x2) that start every rank from the anchor; a lost rank file; the same for
``onebit_adam_fsdp`` (exact resume, 2x2 -> 1x4); ``onebit_lamb_fsdp``, ``cd_adam_fsdp`` and ``zero_one_adam_fsdp``
(exact resume); and the setup errors.
A 2-rank job resumes the 2x2 checkpoint on 2x1.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from test_sharded import SEQ, VOCAB, Block, TinyLM
from torch import nn

from dist_utils import run_ranks, values

SAVED = "epoch=0-step=4.ckpt"  # after epoch 1 of 4 steps: inside an interval of 3


class _Lit(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyLM()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return nn.functional.cross_entropy(self.lm(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (64, SEQ), generator=g))  # 4 batches of 4 per rank and epoch


def _fit(out: str, world: int, *, per_node: int, ckpt: str | None = None, epochs: int = 2, strict: bool = False,
         policy: bool = True, onebit: bool = False, configure: bool = False, lamb: bool = False, cd: bool = False,
         zero_one: bool = False):
    """One fit on this rank: (what it saw, its trainer). ``out``: its root dir, checkpoints in ``out/ckpt``."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_onebit import (
        CDAdamStrategy,
        CommunicationMonitor,
        DiLoCoStrategy,
        OnebitAdamStrategy,
        OnebitLambStrategy,
        ZeroOneAdamStrategy,
    )

    class Configured(_Lit):  # sharded by the user, as the docs show
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            for block in (self.lm.tok, self.lm.pos, self.lm.block, self.lm.head):
                fully_shard(block, mesh=self.device_mesh["shard"])
            fully_shard(self.lm, mesh=self.device_mesh["shard"])

    def full(m) -> torch.Tensor:  # every rank of a node gathers its node's model
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in m.parameters()])

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.seen: dict = {}

        def on_train_start(self, trainer, m) -> None:  # after a resume restored everything
            self.seen["start"] = full(m)

        def on_validation_epoch_start(self, trainer, m) -> None:  # after the strategy put the anchor in
            if trainer.global_step:
                self.seen.setdefault("validated", full(m))

    data = _data()
    probe = Probe()
    layout = dict(sharding="fsdp", ranks_per_node=per_node,
                  auto_wrap_policy={Block} if policy and not configure else None,
                  strict_resume=strict)
    onebit = onebit or cd or zero_one
    schedule = dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
    strategy = CDAdamStrategy(**layout) if cd else ZeroOneAdamStrategy(optimizer_kwargs=schedule, **layout) \
        if zero_one else (OnebitLambStrategy if lamb else OnebitAdamStrategy)(warmup=2, **layout) if onebit else \
        DiLoCoStrategy(sync_every=3, compression="4bit", **layout)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
                        limit_val_batches=1, num_sanity_val_steps=0, log_every_n_steps=1,
                        callbacks=[probe, CommunicationMonitor(prog_bar=False),
                                   ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), save_top_k=-1, every_n_epochs=1)])
    model = Configured() if configure else _Lit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4), ckpt_path=ckpt)
    seen = dict(probe.seen, end=full(model), step=trainer.global_step,
                warnings=[str(w.message) for w in caught if "resum" in str(w.message) or "own state" in str(w.message)])
    opt = trainer.strategy.optimizers[0]
    seen["kind"], seen["mesh"] = type(trainer.strategy).__name__, (opt.sharding.nodes, opt.sharding.ranks_per_node)
    if not onebit:
        seen["state_numel"] = opt._outer["anchor"].numel()
    else:
        seen["compressing"], seen["bytes"] = opt.compressing, opt.comm_counter.total.bytes_sent
        seen["rounds"], seen["local_steps"] = opt.comm_counter.rounds, getattr(opt, "step_counts", {}).get("local")
    seen["model_numel"] = sum(p.numel() for p in model.parameters())
    seen["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    seen["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("comm/", "mem/"))}
    seen["intra_steps"] = opt.intra_node_counter.steps
    seen["intra_total"] = opt.intra_node_counter.total.bytes_sent  # FSDP's all-gathers and reduce-scatters
    return seen


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _anchor_of(ckpt: str, tmp: str) -> torch.Tensor:
    """The checkpoint's model (the anchor) turned into one file by torch's converter, in parameter order."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = os.path.join(tmp, os.path.basename(ckpt) + ".pt")
    if dist.get_rank() == 0:
        dcp_to_torch_save(ckpt, whole)
    dist.barrier()
    sd = torch.load(whole, weights_only=False)["state_dict"]
    return torch.cat([sd[f"lm.{n}"].reshape(-1) for n, _ in TinyLM().named_parameters()])


def _four_rank_job(rank, world_size, tmp):
    from lightning_onebit import CDAdamStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    out = {}
    a = os.path.join(tmp, "a")
    out["full"] = _fit(a, world_size, per_node=2)
    out["configured"] = _fit(os.path.join(tmp, "configured"), world_size, per_node=2, configure=True)
    ckpt = os.path.join(a, "ckpt", SAVED)
    out["files"] = sorted(os.listdir(ckpt))
    out["file_sizes"] = {n: os.path.getsize(os.path.join(ckpt, n)) for n in out["files"]}
    out["anchor"] = _anchor_of(ckpt, tmp)
    out["resumed"] = _fit(os.path.join(tmp, "b"), world_size, per_node=2, ckpt=ckpt)
    out["1x4"] = _fit(os.path.join(tmp, "c"), world_size, per_node=4, ckpt=ckpt)
    out["strict"] = _error(lambda: _fit(os.path.join(tmp, "d"), world_size, per_node=4, ckpt=ckpt, strict=True))
    # 4x1 (FSDP over one rank per node) -> 2x2
    f = os.path.join(tmp, "f")
    _fit(f, world_size, per_node=1, epochs=1)
    out["4x1 anchor"] = _anchor_of(os.path.join(f, "ckpt", SAVED), tmp)
    out["4x1->2x2"] = _fit(os.path.join(tmp, "g"), world_size, per_node=2, ckpt=os.path.join(f, "ckpt", SAVED))
    # rank 3 lost its file: its node (ranks 2, 3) starts from the anchor, node 0 continues exactly
    import torch.distributed as dist

    lost = os.path.join(tmp, "lost")
    if rank == 0:
        import shutil

        shutil.copytree(ckpt, lost)
        os.remove(os.path.join(lost, "onebit-rank00003-of-00004.pt"))
    dist.barrier()
    out["lost"] = _fit(os.path.join(tmp, "h"), world_size, per_node=2, ckpt=lost)
    # 1-bit Adam on the shards: warm-up 2 steps, then compressed; exact resume on 2x2, reshard to 1x4
    o = os.path.join(tmp, "onebit")
    out["onebit"] = _fit(o, world_size, per_node=2, onebit=True)
    ockpt = os.path.join(o, "ckpt", SAVED)
    out["onebit model"] = _anchor_of(ockpt, tmp)
    out["onebit resumed"] = _fit(os.path.join(tmp, "onebit_b"), world_size, per_node=2, ckpt=ockpt, onebit=True)
    out["onebit 1x4"] = _fit(os.path.join(tmp, "onebit_c"), world_size, per_node=4, ckpt=ockpt, onebit=True)
    # 1-bit LAMB on the shards (whole-tensor norms over the node): compressed, exact resume on 2x2
    lamb = os.path.join(tmp, "lamb")
    out["lamb"] = _fit(lamb, world_size, per_node=2, onebit=True, lamb=True)
    out["lamb resumed"] = _fit(os.path.join(tmp, "lamb_b"), world_size, per_node=2, onebit=True, lamb=True,
                               ckpt=os.path.join(lamb, "ckpt", SAVED))
    # CD-Adam on the shards (its Markov estimates per shard, compressed from the first step): exact resume on 2x2
    cd = os.path.join(tmp, "cd")
    out["cd"] = _fit(cd, world_size, per_node=2, cd=True)
    out["cd resumed"] = _fit(os.path.join(tmp, "cd_b"), world_size, per_node=2, cd=True,
                             ckpt=os.path.join(cd, "ckpt", SAVED))
    # 0/1 Adam on the shards: local steps between rounds, the nodes synchronised before validation, a checkpoint
    # and the end; exact resume on 2x2
    zo = os.path.join(tmp, "zero_one")
    out["zero_one"] = _fit(zo, world_size, per_node=2, zero_one=True)
    out["zero_one resumed"] = _fit(os.path.join(tmp, "zero_one_b"), world_size, per_node=2, zero_one=True,
                                   ckpt=os.path.join(zo, "ckpt", SAVED))
    out["errors"] = {
        "per node": _error(lambda: _fit(os.path.join(tmp, "e1"), world_size, per_node=3)),
        "nothing sharded": _error(lambda: _fit(os.path.join(tmp, "e2"), world_size, per_node=2, policy=False)),
        "cd warmup": _error(lambda: CDAdamStrategy(sharding="fsdp", warmup=2)),
        "other strategy's": _error(lambda: _fit(os.path.join(tmp, "e4"), world_size, per_node=2, ckpt=ockpt)),
        "a file": _error(lambda: _fit(os.path.join(tmp, "e3"), world_size, per_node=2,
                                      ckpt=os.path.join(ckpt, "meta.pt"))),
    }
    return out


def _two_rank_job(rank, world_size, ckpt):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size), RANK=str(rank))
    return _fit(os.path.join(os.path.dirname(os.path.dirname(ckpt)), "two"), world_size, per_node=1, ckpt=ckpt)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diloco_fsdp")
    return tmp, values(run_ranks(_four_rank_job, 4, str(tmp), timeout_s=300))


@pytest.mark.budget(120)  # about 10 Lightning fits on 4 ranks
def test_diloco_fsdp_fits_validates_the_anchor_and_resumes_bit_for_bit(four_ranks):
    _, out = four_ranks
    for r in out:
        full = r["full"]
        assert full["kind"] == "DiLoCoFSDPStrategy" and full["mesh"] == (2, 2) and full["step"] == 8
        assert full["state_numel"] <= full["model_numel"] / 2 + 4 * 16 * 4  # DiLoCo state of this rank's shard
        # CommunicationMonitor: the outer all-reduces' bytes, and state bytes of this rank's shards
        assert full["logged"]["comm/bytes_total"] > 0 and full["logged"]["comm/rounds"] == 3
        assert 16 * full["local_numel"] <= full["logged"]["mem/optimizer_state_bytes"] <= 64 * full["local_numel"]
        _fsdp_bytes_inside_the_node(full)
        # validation at step 4 (mid-interval) sees the anchor on every rank; the fit ends on one model
        assert torch.equal(full["validated"], out[0]["full"]["validated"])
        assert torch.equal(full["end"], out[0]["full"]["end"])
        # sharded in configure_model (other FSDP groups, the same arithmetic with 2 ranks a node): the same fit
        assert torch.equal(r["configured"]["end"], full["end"])
        # the resume from the epoch-1 directory on the same mesh goes on bit for bit, with no warning
        assert torch.equal(r["resumed"]["end"], full["end"]) and r["resumed"]["warnings"] == []
    assert torch.equal(out[0]["full"]["validated"], out[0]["anchor"])
    # the directory: DCP's files (one per rank), a file per rank of its own state, the metadata
    files = out[0]["files"]
    assert {".metadata", "meta.pt"} <= set(files)
    assert sorted(n for n in files if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert sorted(n for n in files if n.startswith("onebit-rank")) == [f"onebit-rank0000{r}-of-00004.pt"
                                                                      for r in range(4)]
    sizes = [s for n, s in out[0]["file_sizes"].items() if n.endswith(".distcp")]
    assert max(sizes) < 0.5 * sum(sizes)  # nothing gathered: no rank wrote most of it


def _fsdp_bytes_inside_the_node(fit: dict) -> None:
    """CommunicationMonitor's ``comm/intra_node_bytes_step``: FSDP's own all-gathers and reduce-scatters inside the
    node, counted as a rank sends them (2 ranks a node: its shard once per all-gather, half its reduce-scatter's
    input): every step the same, between one all-gather and reduce-scatter of the model's shard and three passes
    (forward's all-gather, backward's, the reduce-scatter; FSDP2 keeps the root's gathered into backward)."""
    per_step = fit["logged"]["comm/intra_node_bytes_step"]
    assert fit["intra_total"] == per_step * fit["intra_steps"] and fit["intra_steps"] == fit["step"], fit
    shard = 4 * fit["model_numel"] / 2
    assert 2 * shard <= per_step <= 3 * shard * 1.1, (per_step, shard)


@pytest.mark.budget(120)  # and a 2-rank fit
def test_diloco_fsdp_reshards_on_another_mesh_from_the_anchor(four_ranks):
    tmp, out = four_ranks
    for r in out:
        # 2x2 -> 1x4: every rank starts from the saved anchor (resharded), warns, and trains on
        c = r["1x4"]
        assert c["mesh"] == (1, 4) and torch.equal(c["start"], out[0]["anchor"]) and c["step"] == 8
        assert any("resharded" in w for w in c["warnings"]) or r is not out[0]
        assert torch.isfinite(c["end"]).all() and not torch.equal(c["end"], c["start"])
        assert "strict_resume=True" in r["strict"]
        # 4x1 -> 2x2
        g = r["4x1->2x2"]
        assert g["mesh"] == (2, 2) and torch.equal(g["start"], out[0]["4x1 anchor"]) and g["step"] == 8
    # rank 3's file lost: node 1 starts from the anchor, node 0 where it was (as the exact resume did)
    assert all(torch.equal(out[r]["lost"]["start"], out[0]["anchor"]) for r in (2, 3))
    assert all(torch.equal(out[r]["lost"]["start"], out[r]["resumed"]["start"]) for r in (0, 1))
    assert not torch.equal(out[0]["lost"]["start"], out[0]["anchor"])
    assert any("ranks [3]" in w for w in out[0]["lost"]["warnings"]), out[0]["lost"]["warnings"]
    # 2x2 -> 2x1 on 2 ranks
    two = values(run_ranks(_two_rank_job, 2, str(tmp / "a" / "ckpt" / SAVED), timeout_s=120))
    for r in two:
        # (8 steps per epoch on 2 ranks: from step 4, the rest of epoch 1)
        assert r["mesh"] == (2, 1) and torch.equal(r["start"], out[0]["anchor"]) and r["step"] == 12


@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone)
def test_diloco_fsdp_setup_errors_name_the_problem(four_ranks):
    _, out = four_ranks
    for r in out:
        err = r["errors"]
        assert "ranks_per_node=3 does not divide the world of 4 ranks" in err["per node"], err["per node"]
        assert "no parameter is sharded" in err["nothing sharded"] and "auto_wrap_policy" in err["nothing sharded"]
        assert "single file" in err["a file"], err["a file"]
        assert "checkpoint of strategy 'onebit_adam_fsdp'" in err["other strategy's"], err["other strategy's"]


@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone)
def test_onebit_adam_fsdp_compresses_resumes_exactly_and_reshards(four_ranks):
    _, out = four_ranks
    for r in out:
        fit = r["onebit"]
        assert fit["kind"] == "CompressedFSDPStrategy" and fit["mesh"] == (2, 2) and fit["compressing"]
        assert fit["step"] == 8 and fit["bytes"] > 0 and fit["logged"]["comm/bytes_total"] == fit["bytes"]
        assert fit["logged"]["comm/compressing"] == 1.0
        _fsdp_bytes_inside_the_node(fit)
        assert fit["intra_total"] == r["full"]["intra_total"]  # the same model, the same FSDP traffic
        assert 8 * fit["local_numel"] <= fit["logged"]["mem/optimizer_state_bytes"] <= 64 * fit["local_numel"]
        assert torch.equal(fit["end"], out[0]["onebit"]["end"])  # every rank holds the same model after each step
        resumed = r["onebit resumed"]
        assert torch.equal(resumed["end"], fit["end"]) and resumed["warnings"] == []
        c = r["onebit 1x4"]  # the model, moments, frozen variance and phase resharded; the error state reset
        assert c["mesh"] == (1, 4) and torch.equal(c["start"], out[0]["onebit model"]) and c["compressing"]
        assert torch.isfinite(c["end"]).all() and not torch.equal(c["end"], c["start"])
    assert any("error state starts at zero" in w for w in out[0]["onebit 1x4"]["warnings"])


@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone)
def test_onebit_lamb_fsdp_compresses_and_resumes_exactly(four_ranks):
    _, out = four_ranks
    for r in out:
        fit, resumed = r["lamb"], r["lamb resumed"]
        assert fit["kind"] == "CompressedFSDPStrategy" and fit["compressing"] and fit["step"] == 8
        assert torch.equal(fit["end"], out[0]["lamb"]["end"]) and not torch.equal(fit["end"], out[0]["onebit"]["end"])
        assert torch.equal(resumed["end"], fit["end"]) and resumed["warnings"] == []


@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone)
def test_cd_adam_fsdp_compresses_from_the_start_and_resumes_exactly(four_ranks):
    _, out = four_ranks
    for r in out:
        fit, resumed = r["cd"], r["cd resumed"]
        assert fit["kind"] == "CompressedFSDPStrategy" and fit["compressing"] and fit["step"] == 8
        assert fit["bytes"] > 0 and fit["logged"]["comm/bytes_total"] == fit["bytes"]
        assert torch.equal(fit["end"], out[0]["cd"]["end"])  # every rank holds the same model after each step
        assert not torch.equal(fit["end"], out[0]["onebit"]["end"])
        assert torch.equal(resumed["end"], fit["end"]) and resumed["warnings"] == []
        assert "has no uncompressed warm-up" in r["errors"]["cd warmup"], r["errors"]["cd warmup"]


@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone)
def test_zero_one_adam_fsdp_takes_local_steps_and_resumes_exactly(four_ranks):
    _, out = four_ranks
    for r in out:
        fit, resumed = r["zero_one"], r["zero_one resumed"]
        assert fit["kind"] == "CompressedFSDPStrategy" and fit["step"] == 8
        assert fit["local_steps"] and fit["rounds"] < fit["step"], fit  # local steps sent nothing
        # the nodes meet before a checkpoint, validation and the end: one model on every rank
        assert torch.equal(fit["end"], out[0]["zero_one"]["end"])
        assert torch.equal(resumed["end"], fit["end"]) and resumed["warnings"] == []


class _SaveWhole(L.Callback):
    """Rank 0 saves the model whole at the end of the fit (every rank gathers its node's shards)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, m) -> None:
        whole = torch.cat([p.full_tensor().detach().reshape(-1) for p in m.parameters()])
        if trainer.global_rank == 0:
            torch.save(whole, self.path)


@pytest.mark.usefixtures("fresh_process_group")
@pytest.mark.budget(120)  # (the module's 4-rank job, when run alone) and a forkserver launch of 4 ranks
def test_diloco_fsdp_forkserver_launch_gives_the_launching_process_the_whole_model(four_ranks, tmp_path):
    """Trainer(devices=4, start_method="forkserver") from this process, as the recipes launch: the ranks train
    the sharded model and this process's unsharded module ends with their final model, bit for bit (and with
    the 4-rank job's fit of the same settings, to rounding: another process)."""
    from torch.utils.data import DataLoader

    from lightning_onebit import DiLoCoStrategy

    _, out = four_ranks
    model = _Lit()
    strategy = DiLoCoStrategy(sync_every=3, compression="4bit", sharding="fsdp", ranks_per_node=2,
                              auto_wrap_policy={Block}, start_method="forkserver")
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[_SaveWhole(str(tmp_path / "whole.pt"))])
    trainer.fit(model, DataLoader(_data(), batch_size=4))
    whole = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(whole, torch.load(tmp_path / "whole.pt"))
    sizes = [p.numel() for p in model.parameters()]
    for (name, _), a, b in zip(model.named_parameters(), torch.split(whole, sizes),
                               torch.split(out[0]["full"]["end"], sizes), strict=True):
        # (the attention's key bias aside: zero gradient in exact arithmetic, AdamW makes rounding noise ~lr)
        if not name.endswith("in_proj_bias"):
            assert float((a - b).abs().max()) < 1e-5, name

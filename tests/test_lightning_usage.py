"""What a Lightning user meets when adding ``strategy="onebit_adam"`` to a working script: LR
schedulers, several optimizers (a GAN), and the warnings for runs that cannot save anything.
Multi-rank behaviour is checked through ``Trainer`` on 2 processes."""


import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lit_models import DigitsGAN, DigitsMLP, ScheduledDigitsMLP, Trace

import lightning_onebit  # noqa: F401  (registers the strategy names)
from lightning_onebit import CompressedDDPStrategy, OnebitAdamStrategy
from lightning_onebit.strategies.compressed import shard_path
from lightning_onebit.strategies.launch import BaseDDPStrategy

pytestmark = pytest.mark.usefixtures("fresh_process_group")


def _fit(out, strategy, model, devices=2, max_epochs=2, ckpt_path=None, callbacks=(), **kw):
    """Fit; return each rank's Trace record."""
    out.mkdir(parents=True, exist_ok=True)
    kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
                        callbacks=[Trace(str(out)), *callbacks], **kw)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def _onebit(**kw):
    return CompressedDDPStrategy("onebit_adam", start_method="forkserver", **kw)


def _ddp(**kw):
    return BaseDDPStrategy(start_method="forkserver", **kw)  # plain DDP (launched as spawn would)


def _phase_switch_missing(warnings):
    """Lightning's "add the callbacks used to create the checkpoint" naming the strategy's own PhaseSwitch."""
    return [w for w in warnings if "callbacks used to create the checkpoint" in w and "PhaseSwitch" in w]


# -- LR schedulers -------------------------------------------------------------------------
@pytest.mark.budget(40)  # three 2-rank fits
@pytest.mark.parametrize("schedule", ["sequential+plateau", "onecycle"])
def test_lr_schedulers_give_ddp_lr_sequence_through_a_resume(tmp_path, schedule):
    """AdamW + schedulers in Lightning's dict form, 2 processes: the converted optimizer gets, before
    every one of 16 steps, the lr (and beta1) that plain DDP's AdamW gets - with a checkpoint after
    the first epoch and a resume from it in a new fit (schedulers nested in SequentialLR, OneCycleLR's
    own group keys, ReduceLROnPlateau on a monitored metric). The resume adds no callback warning."""
    ref = _fit(tmp_path / "ddp", _ddp(), ScheduledDigitsMLP(schedule))
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
    first = _fit(tmp_path / "first", _onebit(warmup=3), ScheduledDigitsMLP(schedule), max_epochs=1, callbacks=[ck],
                 enable_checkpointing=True)
    path = next((tmp_path / "ck").glob("epoch=0*.ckpt"))
    resumed = _fit(tmp_path / "resumed", _onebit(warmup=3), ScheduledDigitsMLP(schedule), ckpt_path=str(path))
    assert first[0]["optimizers"] == ["OnebitAdam"] and resumed[0]["compressing"] == [True]
    lrs = [step[0][0] for step in ref[0]["lrs"]]
    assert len(lrs) == 16 and len(set(lrs)) > 8, lrs  # the schedule moves
    assert [step[0][0] for step in first[0]["lrs"] + resumed[0]["lrs"]] == lrs
    for rank in (first, resumed):
        assert rank[0]["lrs"] == rank[1]["lrs"]
    assert not _phase_switch_missing(resumed[0]["warnings"])


# -- several optimizers --------------------------------------------------------------------
@pytest.mark.budget(40)
def test_gan_in_warmup_is_ddp_adamw_bit_for_bit_and_says_it_never_compressed(tmp_path):
    """A GAN (manual optimization, generator and discriminator optimizers, toggle_optimizer) runs
    with each AdamW converted; while warming up it is DDP + AdamW to the bit. A warm-up as long as
    the run is reported at setup, and the end of fit says compression never started."""
    ref = _fit(tmp_path / "ddp", _ddp(find_unused_parameters=True), DigitsGAN())
    got = _fit(tmp_path / "onebit", _onebit(warmup=100, find_unused_parameters=True), DigitsGAN())
    assert got[0]["optimizers"] == ["OnebitAdam", "OnebitAdam"] and got[0]["compressing"] == [False, False]
    for p, q in zip(ref[0]["params"], got[0]["params"], strict=True):
        assert torch.equal(p, q)
    warned = got[0]["warnings"]
    assert any("warm-up (100 steps) is as long as the run or longer (8 optimizer steps)" in w for w in warned), warned
    assert any("compression never started in this fit" in w for w in warned), warned
    assert not any("never" in w or "warm-up (" in w for w in got[1]["warnings"])  # rank 0 only


@pytest.mark.budget(40)
def test_gan_compresses_each_optimizer_and_resumes_bit_for_bit(tmp_path):
    """Each optimizer has its own buckets, phase and error state: both compress (~30x) after their
    own 3 warm-up steps, the replicas agree, each rank's shard holds the error state of both, and a
    resume from the first epoch's checkpoint ends where the uninterrupted run ends."""
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
    full = _fit(tmp_path / "full", _onebit(warmup=3, find_unused_parameters=True), DigitsGAN(), callbacks=[ck],
                enable_checkpointing=True)
    assert full[0]["compressing"] == [True, True] and full[0]["global_step"] == 16  # Lightning counts both
    assert all(r > 25 for r in full[0]["ratio"]), full[0]["ratio"]
    for p, q in zip(full[0]["params"], full[1]["params"], strict=True):
        assert torch.equal(p, q)
    path = next((tmp_path / "ck").glob("epoch=0*.ckpt"))
    shard = torch.load(shard_path(path, 1, 2), weights_only=True)
    assert sorted(shard["optimizers"]) == [0, 1]
    resumed = _fit(tmp_path / "resumed", _onebit(warmup=3, find_unused_parameters=True), DigitsGAN(),
                   ckpt_path=str(path))
    for p, q in zip(full[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(p, q)
    assert not _phase_switch_missing(resumed[0]["warnings"])


def test_several_optimizers_that_cannot_all_convert_say_which(tmp_path):
    with pytest.raises(ValueError, match=r"optimizer 1 of 2 \(SGD\).*needs an Adam-family optimizer"):
        _fit(tmp_path, OnebitAdamStrategy(), DigitsGAN(optimizer="adamw+sgd"), devices=1, max_epochs=1)


# -- runs that cannot save anything ----------------------------------------------------------
def test_one_process_says_compression_saves_nothing(tmp_path):
    (rank,) = _fit(tmp_path, OnebitAdamStrategy(warmup=2), DigitsMLP(), devices=1, max_epochs=1)
    assert sum("runs on one process: there is no communication to compress" in w for w in rank["warnings"]) == 1


@pytest.mark.parametrize("name", ["cd_adam", "ef_amsgrad", "naive_amsgrad"])
def test_amsgrad_style_algorithms_warn_about_an_adamw_learning_rate(name):
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.warns(UserWarning, match=r"with the same lr \(0.002\).*without a full-precision warm-up.*1e-4"):
        CompressedDDPStrategy(name)._convert(torch.optim.AdamW(params, lr=2e-3))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompressedDDPStrategy(name)._convert(torch.optim.AdamW(params, lr=2e-4))  # in range: silent


class _ClipProbe(DigitsMLP):
    """Records the gradient norm before and after Lightning's clipping, and the phase."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, float, float]] = []

    def _norm(self) -> float:
        return float(torch.norm(torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None])))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = self._norm()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.seen.append((getattr(optimizer, "compressing", False), before, self._norm()))


@pytest.mark.parametrize("clip_when_compressing", [None, False])
def test_clipping_in_the_compression_phase_warns_or_is_left_to_the_warmup(tmp_path, clip_when_compressing):
    """Clipping with a frozen variance shrinks compressed steps (benchmarks/clipping_study.py): by
    default it clips in both phases and warns; clip_when_compressing=False clips during warm-up only."""
    model = _ClipProbe()
    (rank,) = _fit(tmp_path, OnebitAdamStrategy(warmup=3, clip_when_compressing=clip_when_compressing), model,
                   devices=1, max_epochs=1, gradient_clip_val=0.01)
    warm = [(b, a) for c, b, a in model.seen if not c]
    comp = [(b, a) for c, b, a in model.seen if c]
    assert len(warm) == 3 and len(comp) == 13
    assert all(b > 0.01 and a == pytest.approx(0.01, rel=1e-3) for b, a in warm)  # clipped
    if clip_when_compressing is None:
        assert all(a == pytest.approx(0.01, rel=1e-3) for _, a in comp)
        assert any("clip_when_compressing=False" in w for w in rank["warnings"])
    else:
        assert all(a == b > 0.01 for b, a in comp)  # left alone
        assert not any("clip_when_compressing" in w for w in rank["warnings"])


def test_a_scheduler_that_hides_the_optimizer_fails_at_setup_with_a_message(tmp_path):
    class Hiding(torch.optim.lr_scheduler.LRScheduler):
        def __init__(self, optimizer):
            self.kept = optimizer  # a second reference the strategy cannot know about
            super().__init__(optimizer)

        def get_lr(self):
            return [g["lr"] * 0.9 for g in self.kept.param_groups]

    class Model(DigitsMLP):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters())
            return {"optimizer": opt, "lr_scheduler": Hiding(opt)}

    with pytest.raises(ValueError, match=r"scheduler Hiding keeps the AdamW it was built on in 'kept'"):
        _fit(tmp_path, OnebitAdamStrategy(), Model(), devices=1, max_epochs=1)

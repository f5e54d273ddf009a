"""The recipes' loggers (recipes/loggers.py) and progress display (recipes/progress.py), on tiny
in-process fits."""

import csv
import io
import itertools
import logging
import os
import pickle
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_onebit  # noqa: F401  (registers the strategy names)
from lightning_onebit import CommunicationMonitor, OnebitAdam, OnebitAdamStrategy
from recipes import loggers as recipe_loggers
from recipes.loggers import ResumableCSVLogger, build_loggers
from recipes.progress import PhaseProgressBar, ProgressLog, progress_callbacks


class TinyClassifier(L.LightningModule):
    """A linear classifier on 64 random points (8 batches of 8) with a validation set."""

    def __init__(self, warmup_steps: int | None = None) -> None:
        super().__init__()
        self.warmup_steps = warmup_steps  # None: AdamW (uncompressed)
        torch.manual_seed(0)
        self.net = nn.Linear(8, 3)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(80, 8, generator=g), torch.randint(0, 3, (80,), generator=g)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        if self.warmup_steps is None:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return OnebitAdam(self.parameters(), lr=1e-2, warmup_steps=self.warmup_steps)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x[:64], self.y[:64]), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[64:], self.y[64:]), batch_size=16)


def _fit(root, model, loggers, callbacks=(), strategy="auto", ckpt_path=None, **trainer_kw):
    saved = dict(os.environ)
    trainer_kw.setdefault("enable_progress_bar", False)
    trainer_kw.setdefault("enable_checkpointing", False)
    trainer_kw.setdefault("max_epochs", 2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=loggers or False,
                        callbacks=list(callbacks), log_every_n_steps=1, enable_model_summary=False,
                        default_root_dir=str(root), **trainer_kw)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    finally:  # a compressed strategy leaves a process group and MASTER_PORT behind
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    return trainer


def _rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


class _BarProbe(L.Callback):
    """What the progress bar shows after each batch (the bar itself writes to stdout)."""

    def __init__(self) -> None:
        self.shown: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = trainer.progress_bar_callback or PhaseProgressBar()
        self.shown.append(bar.get_metrics(trainer, pl_module))


class _CommBits(L.Callback):
    """Logs the comm keys as DDPCommCounter/CommunicationMonitor do, with a value a 2-rank 1-bit run logs."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log_dict({"comm/bits_per_param": 1.03125, "comm/bytes_step": 100.0}, on_step=True, on_epoch=False,
                           prog_bar=True)


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory):
    """1-bit Adam, 3 warm-up steps then compression, 2 epochs of 8 steps, logging to CSV and
    TensorBoard, with the log lines (every step) and the bar."""
    out = tmp_path_factory.mktemp("compressed")
    loggers = build_loggers({"csv": {}, "tensorboard": {}}, out, "onebit_adam", need_csv=True)
    stream, probe = io.StringIO(), _BarProbe()
    callbacks = [CommunicationMonitor(prog_bar=False), ProgressLog(0, stream=stream), PhaseProgressBar(), probe]
    trainer = _fit(out, TinyClassifier(warmup_steps=3), loggers, callbacks, strategy=OnebitAdamStrategy(),
                   enable_progress_bar=True)
    return out, trainer, stream.getvalue().splitlines(), probe.shown


# -- loggers ---------------------------------------------------------------------------------
def test_csv_and_tensorboard_are_both_written(compressed_run):
    out, trainer, _, _ = compressed_run
    assert [type(lg).__name__ for lg in trainer.loggers] == ["ResumableCSVLogger", "TensorBoardLogger"]
    header, rows = _rows(out / "metrics" / "onebit_adam" / "metrics.csv")
    assert {"comm/bits_per_param", "comm/ratio_vs_fp32", "comm/compressing", "train_loss", "val_acc"} <= set(header)
    assert sorted(int(r["step"]) for r in rows if r["train_loss"]) == list(range(16))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = out / "tensorboard" / "onebit_adam"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert {"comm/bits_per_param", "train_loss", "val_loss"} <= set(acc.Tags()["scalars"])
    steps = [e.step for e in acc.Scalars("comm/compressing")]
    assert steps == list(range(16))
    assert [e.value for e in acc.Scalars("comm/compressing")][-1] == 1.0


def test_none_with_need_csv_still_writes_the_csv(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="recipes.loggers"):
        loggers = build_loggers(OmegaConf.create({}), tmp_path, "adam", need_csv=True)
    assert len(loggers) == 1 and isinstance(loggers[0], ResumableCSVLogger)
    assert loggers[0].log_dir == str(tmp_path / "metrics" / "adam")
    assert "run report reads it" in caplog.text
    assert build_loggers({}, tmp_path, "adam", need_csv=False) == []
    assert build_loggers(None, tmp_path, "adam", need_csv=False) == []


def test_logger_options_are_passed_on(tmp_path):
    (csv_logger, tb) = build_loggers(OmegaConf.create({"csv": {"flush_logs_every_n_steps": 7},
                                                       "tensorboard": {"default_hp_metric": False}}),
                                     tmp_path, "adam", need_csv=False, resume_step=12)
    assert csv_logger._flush_logs_every_n_steps == 7
    assert tb.log_dir == str(tmp_path / "tensorboard" / "adam")
    assert tb._default_hp_metric is False and tb._kwargs["purge_step"] == 12
    (tb,) = build_loggers({"tensorboard": {"purge_step": 3}}, tmp_path, "adam", need_csv=False, resume_step=12)
    assert tb._kwargs["purge_step"] == 3  # the user's setting wins
    (tb,) = build_loggers({"tensorboard": None}, tmp_path, "adam", need_csv=False)
    assert "purge_step" not in tb._kwargs


def test_bad_logger_selections(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown logger 'wandb'; choose from csv, tensorboard"):
        build_loggers({"csv": {}, "wandb": {}}, tmp_path, "adam", need_csv=True)
    with pytest.raises(ValueError, match=r"cannot set \['version'\]"):
        build_loggers({"csv": {"version": "x"}}, tmp_path, "adam", need_csv=True)
    monkeypatch.setattr(recipe_loggers, "_tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        build_loggers({"tensorboard": {}}, tmp_path, "adam", need_csv=False)


OLD = [  # a metrics.csv as an interrupted fit left it; its checkpoint was taken at step 2
    {"epoch": "0", "step": "0", "train_loss": "1.0", "val_loss": ""},
    {"epoch": "0", "step": "1", "train_loss": "0.9", "val_loss": ""},
    {"epoch": "0", "step": "1", "train_loss": "", "val_loss": "0.8"},
    {"epoch": "1", "step": "2", "train_loss": "0.7", "val_loss": ""},
    {"epoch": "1", "step": "3", "train_loss": "0.6", "val_loss": ""},
]


def _write_old(tmp_path):
    path = tmp_path / "metrics" / "adam" / "metrics.csv"
    path.parent.mkdir(parents=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(OLD[0]))
        writer.writeheader()
        writer.writerows(OLD)
    return path


def test_resume_keeps_the_rows_before_the_checkpoint_and_appends(tmp_path):
    path = _write_old(tmp_path)
    (logger,) = build_loggers({"csv": {}}, tmp_path, "adam", need_csv=True, resume_step=2)
    logger.log_metrics({"train_loss": 0.75, "epoch": 1}, step=2)  # known columns: appended
    logger.save()
    logger.log_metrics({"train_loss": 0.65, "epoch": 1, "comm/bits_per_param": 1.0}, step=3)  # a new column:
    logger.save()                                                                              # Lightning rewrites
    header, rows = _rows(path)
    assert header == ["comm/bits_per_param", "epoch", "step", "train_loss", "val_loss"]
    assert rows == [{"comm/bits_per_param": "", **r} for r in OLD[:3]] + [
        {"comm/bits_per_param": "", "epoch": "1", "step": "2", "train_loss": "0.75", "val_loss": ""},
        {"comm/bits_per_param": "1.0", "epoch": "1", "step": "3", "train_loss": "0.65", "val_loss": ""}]


def test_without_resume_step_the_csv_starts_afresh(tmp_path):
    path = _write_old(tmp_path)
    (logger,) = build_loggers({"csv": {}}, tmp_path, "adam", need_csv=True)
    with pytest.warns(UserWarning, match="will be deleted"):
        logger.log_metrics({"train_loss": 0.5}, step=0)
    logger.save()
    assert _rows(path) == (["step", "train_loss"], [{"step": "0", "train_loss": "0.5"}])


def test_ranks_above_zero_leave_the_csv_alone(tmp_path, monkeypatch):
    path = _write_old(tmp_path)
    before = path.read_bytes()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    for resume_step in (2, None):
        (logger,) = build_loggers({}, tmp_path, "adam", need_csv=True, resume_step=resume_step)
        logger.experiment.log_metrics({"train_loss": 0.1}, 0)  # the dummy experiment of ranks > 0
        logger.log_metrics({"train_loss": 0.1}, step=0)
        logger.save()
        logger.finalize("success")
    assert path.read_bytes() == before


def test_resumed_fit_continues_the_csv(tmp_path):
    """A fit of 3 epochs saving a checkpoint per epoch, then a fit resumed from the end of epoch 1:
    the rows before the checkpoint are the first fit's, and every later step is logged once."""
    first = tmp_path / "first"
    ck = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    _fit(first, TinyClassifier(), build_loggers({"csv": {}}, first, "adam", need_csv=True), [ck],
         enable_checkpointing=True, max_epochs=3)
    path = first / "metrics" / "adam" / "metrics.csv"
    _, rows_first = _rows(path)
    ckpt = next((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    resume_step = torch.load(ckpt, weights_only=False)["global_step"]
    assert resume_step == 8

    _fit(first, TinyClassifier(), build_loggers({"csv": {}}, first, "adam", need_csv=True, resume_step=resume_step),
         ckpt_path=str(ckpt), max_epochs=3)
    _, rows = _rows(path)
    assert [r for r in rows if int(r["step"]) < resume_step] == [r for r in rows_first if int(r["step"]) < 8]
    train_steps = [int(r["step"]) for r in rows if r["train_loss"]]
    assert train_steps == list(range(24))  # in order, none twice
    assert [int(r["step"]) for r in rows if r["val_acc"]] == [7, 15, 23]


# -- progress --------------------------------------------------------------------------------
def test_log_lines_show_the_phase_switch_and_bits(compressed_run):
    _, _, lines, _ = compressed_run
    step_lines = [ln for ln in lines if ln.startswith("epoch")]
    phases = [ln.split("  phase ")[1].split("  ")[0] for ln in step_lines]
    assert phases[0] == "warm-up" and phases[-1] == "compressing"
    assert phases == sorted(phases, key=lambda p: p == "compressing")  # one switch, no way back
    # one device sends nothing: CommunicationMonitor logs 0 bits per parameter
    assert all("  bits/param 0" in ln for ln in step_lines)
    assert step_lines[0].startswith("epoch 1/2  step 1/16 (6%)  train_loss ")
    assert "steps/s" not in step_lines[0]  # the first interval includes the start-up
    assert "steps/s  eta 0:00:" in step_lines[1]
    epoch_ends = [ln for ln in step_lines if "val_acc" in ln]
    assert len(epoch_ends) == 2 and epoch_ends[-1].startswith("epoch 2/2  step 16/16 (100%)")
    assert "val_loss" in epoch_ends[-1]
    assert lines[-1].startswith("done  step 16/16  ") and "took 0:00:" in lines[-1]


def test_bar_shows_phase_and_bits_instead_of_the_comm_metrics(compressed_run):
    _, _, _, shown = compressed_run
    assert [m["phase"] for m in shown[:2]] == ["warm-up", "warm-up"] and shown[-1]["phase"] == "compressing"
    assert all(m["bits/param"] == "0" for m in shown)
    assert not any(k.startswith("comm/") for m in shown for k in m)


def test_log_lines_of_an_uncompressed_open_ended_fit_with_accumulation(tmp_path):
    """AdamW, 2 batches per optimizer step, max_steps=6 with max_epochs=-1 (4 steps per epoch), on a
    fake clock that advances 1 s per reading and a line at most every 2 s."""
    stream, probe = io.StringIO(), _BarProbe()
    callbacks, bar = progress_callbacks({"mode": "log", "log_every_s": 2}, stream=stream)
    assert bar is False and isinstance(callbacks[0], ProgressLog)
    clock = itertools.count()
    callbacks[0]._clock = lambda: float(next(clock))
    _fit(tmp_path, TinyClassifier(), [], [_CommBits(), *callbacks, probe], max_epochs=-1, max_steps=6,
         accumulate_grad_batches=2)
    lines = stream.getvalue().splitlines()
    assert not any("phase" in ln for ln in lines)
    assert all("  bits/param 1.03" in ln for ln in lines)
    heads = [ln.split("  train_loss")[0] for ln in lines]
    # the clock is read only after batches that step the optimizer: at steps 1..6, epoch ends, fit end
    assert heads == ["epoch 1  step 1/6 (16%)", "epoch 1  step 3/6 (50%)", "epoch 1  step 4/6 (66%)",
                     "epoch 2  step 6/6 (100%)", "epoch 2  step 6/6 (100%)", "done  step 6/6"]
    assert lines[1].endswith("1 steps/s  eta 0:00:03")  # 2 steps in 2 s, 3 to go
    assert lines[2].endswith("0.5 steps/s  eta 0:00:04") and "val_acc " in lines[2]  # epoch end
    assert lines[3].endswith("1 steps/s  eta 0:00:00")
    assert lines[4].endswith("bits/param 1.03")  # nothing stepped since the previous line: no rate
    assert lines[-1].endswith("took 0:00:09 (0.667 steps/s)")
    # the bar of an uncompressed run: bits/param to 3 digits, no phase, no raw comm/ keys
    assert probe.shown[-1]["bits/param"] == "1.03" and "phase" not in probe.shown[-1]
    assert not any(k.startswith("comm/") for k in probe.shown[-1])


def test_auto_mode_picks_log_for_a_file_and_the_bar_for_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    callbacks, bar = progress_callbacks({"mode": "auto", "log_every_s": 30}, stream=io.StringIO())
    assert bar is False and [type(c) for c in callbacks] == [ProgressLog] and callbacks[0].every_s == 30
    callbacks, bar = progress_callbacks(OmegaConf.create({"mode": "auto"}), stream=Terminal())
    assert bar is True and [type(c) for c in callbacks] == [PhaseProgressBar]
    assert progress_callbacks({"mode": "none"}) == ([], False)
    assert progress_callbacks({"mode": "bar"}, stream=io.StringIO())[1] is True


def test_bad_progress_settings():
    with pytest.raises(ValueError, match=r"unknown progress.mode 'fancy'; choose one of auto, bar, log, none"):
        progress_callbacks({"mode": "fancy"})
    with pytest.raises(ValueError, match=r"unknown progress settings \['log_every'\]"):
        progress_callbacks({"mode": "log", "log_every": 5})
    with pytest.raises(ValueError, match="log_every_s must be >= 0"):
        progress_callbacks({"mode": "log", "log_every_s": -1})
    with pytest.raises(ValueError, match="log_every_s must be >= 0"):
        progress_callbacks({"mode": "log", "log_every_s": None})


def test_log_callback_pickles_for_spawned_ranks():
    cb = pickle.loads(pickle.dumps(ProgressLog(5, stream=sys.stdout)))
    assert cb._stream is None and cb.every_s == 5  # the spawned rank writes to its own stdout
    assert pickle.loads(pickle.dumps(ProgressLog(stream=sys.stderr)))._stream is sys.stderr

"""What a person watching a recipe fit sees, from the ``progress`` config block.

``mode``: ``bar`` (Lightning's tqdm bar with the algorithm's phase and bits per parameter),
``log`` (a plain line every ``log_every_s`` seconds and at every epoch end: readable in a
file, a multirun's job log or a cluster's output, where a bar is a wall of carriage returns),
``none``, or ``auto``: the bar on a terminal, the lines otherwise.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TextIO

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from lightning_onebit.callbacks import find_compressed_optimizer

from .common import plain

__all__ = ["MODES", "PhaseProgressBar", "ProgressLog", "progress_callbacks"]

MODES = ("auto", "bar", "log", "none")
_KEYS = ("mode", "log_every_s")


def _phase(trainer: L.Trainer) -> str | None:
    """``warm-up`` or ``compressing`` for a compressed optimizer, None for the others."""
    opt = find_compressed_optimizer(trainer)
    return None if opt is None else ("compressing" if opt.compressing else "warm-up")


def _scalar(trainer: L.Trainer, key: str) -> float | None:
    v = trainer.callback_metrics.get(key)
    if isinstance(v, torch.Tensor):
        return float(v) if v.numel() == 1 else None
    return None if v is None else float(v)


class PhaseProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar showing ``phase`` and ``bits/param`` (3 significant digits, from
    ``comm/bits_per_param`` that the communication callbacks log) instead of the raw ``comm/*``
    metrics, so the bar stays one short line."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float | dict]:
        items = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if not k.startswith("comm/")}
        phase = _phase(trainer)
        if phase is not None:
            items["phase"] = phase
        bits = _scalar(trainer, "comm/bits_per_param")
        if bits is not None:
            items["bits/param"] = f"{bits:.3g}"
        return items


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class ProgressLog(Callback):
    """Plain progress lines on global rank 0: one at the first optimizer step of the fit, then at
    most one every ``every_s`` seconds (checked after each batch), one at every training epoch end
    (with the validation metrics) and one at the end of the fit, e.g.

    ``epoch 3/10  step 46/230 (20%)  train_loss 0.312  phase compressing  bits/param 1.03  12.4 steps/s  eta 0:00:15``

    Steps are optimizer steps (``trainer.global_step``); steps/s is over the interval since the
    previous line. What is unknown (no compressed optimizer, an open-ended fit) is left out.
    ``stream``: None writes to the current ``sys.stdout``; ``clock``: seconds, for tests.
    """

    def __init__(self, every_s: float = 30.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(every_s, bool) or not isinstance(every_s, int | float) or not every_s >= 0:
            raise ValueError(f"progress.log_every_s must be >= 0, got {every_s!r}")
        self.every_s = float(every_s)
        self._stream = stream
        self._clock = clock
        self._total: int | None = None
        self._t0 = self._last_t = 0.0
        self._step0 = self._last_step = self._seen_step = 0
        self._rate_known = False  # the first interval includes the start-up: no rate from it

    def __getstate__(self) -> dict[str, Any]:
        # spawned ranks get a pickled copy: the process's own stdout/stderr cannot travel
        state = dict(self.__dict__)
        if self._stream is sys.stdout:
            state["_stream"] = None
        elif self._stream is sys.stderr:
            state["_stream"] = "<stderr>"
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("_stream") == "<stderr>":
            state["_stream"] = sys.stderr
        self.__dict__.update(state)

    def _write(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        print(line, file=stream, flush=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        self._total = None if math.isinf(total) else int(total)
        self._t0 = self._last_t = self._clock()
        self._step0 = self._last_step = self._seen_step = trainer.global_step
        self._rate_known = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # only after a batch that stepped the optimizer (not while accumulating gradients)
        if not trainer.is_global_zero or trainer.global_step == self._seen_step:
            return
        self._seen_step = trainer.global_step
        now = self._clock()
        if self._last_step == self._step0 or now - self._last_t >= self.every_s:
            self._write(self._line(trainer, now))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write(self._line(trainer, self._clock(), epoch_end=True))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        now = self._clock()
        steps, took = trainer.global_step - self._step0, now - self._t0
        parts = [f"done  step {trainer.global_step}" + (f"/{self._total}" if self._total else "")]
        parts += self._metrics(trainer, epoch_end=True)
        parts.append(f"took {_duration(took)}" + (f" ({steps / took:.3g} steps/s)" if steps and took > 0 else ""))
        self._write("  ".join(parts))

    def _metrics(self, trainer: L.Trainer, epoch_end: bool) -> list[str]:
        parts = []
        keys = ("train_loss_epoch", "train_loss") if epoch_end else ("train_loss", "train_loss_step")
        loss = next((v for v in (_scalar(trainer, k) for k in keys) if v is not None), None)
        if loss is not None:
            parts.append(f"train_loss {loss:.3g}")
        if epoch_end:
            for k in sorted(trainer.callback_metrics):
                v = _scalar(trainer, k) if k.startswith("val") else None
                if v is not None:
                    parts.append(f"{k} {v:.4g}")
        phase = _phase(trainer)
        if phase is not None:
            parts.append(f"phase {phase}")
        bits = _scalar(trainer, "comm/bits_per_param")
        if bits is not None:
            parts.append(f"bits/param {bits:.3g}")
        return parts

    def _line(self, trainer: L.Trainer, now: float, epoch_end: bool = False) -> str:
        step = trainer.global_step
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        parts = [f"epoch {trainer.current_epoch + 1}" + (f"/{epochs}" if epochs else "")]
        parts.append(f"step {step}" + (f"/{self._total} ({100 * step // self._total}%)" if self._total else ""))
        parts += self._metrics(trainer, epoch_end)
        dt, done = now - self._last_t, step - self._last_step
        if self._rate_known and dt > 0 and done > 0:
            rate = done / dt
            parts.append(f"{rate:.3g} steps/s")
            if self._total:
                parts.append(f"eta {_duration(max(self._total - step, 0) / rate)}")
        if done > 0:  # an epoch end right after a line: keep that line's interval going
            self._last_t, self._last_step, self._rate_known = now, step, True
        return "  ".join(parts)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def progress_callbacks(cfg_progress: Mapping | None, *, stream: TextIO | None = None) -> tuple[list[Callback], bool]:
    """The progress callbacks for ``cfg_progress`` (``{"mode": ..., "log_every_s": ...}``) and the value
    for ``L.Trainer(enable_progress_bar=...)``. ``stream``: what ``auto`` tests for a terminal and
    ``log`` writes to (default: ``sys.stdout``)."""
    cfg = dict(plain(cfg_progress) or {})
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown:
        raise ValueError(f"unknown progress settings {unknown}; known: {', '.join(_KEYS)}")
    mode = cfg.get("mode", "auto")
    if mode not in MODES:
        raise ValueError(f"unknown progress.mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "bar" if _isatty(stream if stream is not None else sys.stdout) else "log"
    if mode == "bar":
        return [PhaseProgressBar()], True
    if mode == "log":
        return [ProgressLog(cfg.get("log_every_s", 30), stream=stream)], False
    return [], False

"""Lightning loggers of the recipes, from the ``logger`` config group.

``logger=csv`` (the default), ``logger=tensorboard``, ``logger=none`` or several at once
(``logger=[csv,tensorboard]``) compose to a mapping ``{name: {keyword arguments}}`` that
:func:`build_loggers` turns into Lightning loggers. The CSV file stays where the run reports
read it, ``<run dir>/metrics/<algorithm>/metrics.csv``, and is written whenever a report needs
it, selected or not.

A resumed fit (``ckpt_path``) keeps the CSV rows logged before its checkpoint: Lightning's
CSVLogger would delete the file, so the reports would lose the curve up to the checkpoint.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from .common import plain

__all__ = ["LOGGERS", "ResumableCSVLogger", "build_loggers"]

log = logging.getLogger(__name__)

LOGGERS = ("csv", "tensorboard")
# where the reports read the CSV: the caller does not get to move it
_CSV_FIXED = ("save_dir", "name", "version")


def _row_step(row: Mapping[str, str | None]) -> float:
    """A CSV row's ``step``; rows without a readable one sort after every checkpoint (dropped)."""
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return math.nan


class _ResumedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing metrics.csv is cut back to the rows
    logged before the checkpoint (``step < resume_step``) instead of being deleted. Its header
    becomes the writer's known columns, so Lightning's rewrite on new keys (which re-reads the
    file) keeps those rows under the union of old and new columns."""

    def __init__(self, log_dir: str, resume_step: int) -> None:
        self.resume_step = resume_step
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:
        # ranks > 0 never get a writer (rank_zero_experiment); this guard keeps it that way
        if rank_zero_only.rank != 0 or not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            # rows at or after the checkpoint's step are logged again by the resumed fit
            kept = [row for row in reader if _row_step(row) < self.resume_step]
        if not kept:
            self._fs.rm_file(self.metrics_file_path)
            return
        tmp = self.metrics_file_path + ".tmp"
        with self._fs.open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)
        self._fs.mv(tmp, self.metrics_file_path)  # a crash here leaves the old file or the new one
        self.metrics_keys = header


class ResumableCSVLogger(CSVLogger):
    """Lightning's CSVLogger that, given ``resume_step`` (the checkpoint's global step), keeps
    the rows of an existing metrics.csv logged before that step and appends the resumed fit's
    rows after them under one header. With ``resume_step=None`` it is Lightning's CSVLogger
    (which deletes an existing metrics.csv of the same version).

    Nothing happens on disk until the first write, and only on global rank 0 (Lightning's
    ``rank_zero_experiment``), so every rank may create one.
    """

    def __init__(self, save_dir: str | Path, name: str | None = "lightning_logs", version: int | str | None = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100, *, resume_step: int | None = None) -> None:
        super().__init__(save_dir=save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self.resume_step is not None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ResumedExperimentWriter(log_dir=self.log_dir, resume_step=self.resume_step)
        return super().experiment


def _tensorboard_available() -> bool:
    # Lightning's TensorBoardLogger writes with either package
    return any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX"))


def _options(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"logger.{name} must be a mapping of keyword arguments, got {value!r}")
    return dict(value)


def build_loggers(cfg_logger: Mapping[str, Mapping] | None, out_dir: Path, label: str, *, need_csv: bool,
                  resume_step: int | None = None) -> list[Logger]:
    """The loggers selected by ``cfg_logger`` (``{"csv": {...}, "tensorboard": {...}}``, each
    value: extra keyword arguments of that logger) for the fit ``label`` under ``out_dir``.

    * ``csv``: ``<out_dir>/metrics/<label>/metrics.csv`` (:class:`ResumableCSVLogger`); added
      even when not selected if ``need_csv`` (the run report reads it).
    * ``tensorboard``: ``<out_dir>/tensorboard/<label>/`` (Lightning's TensorBoardLogger).

    ``resume_step``: the global step of the checkpoint the fit resumes from. The CSV keeps its
    rows before it, TensorBoard gets ``purge_step=resume_step`` (unless set) so the events
    after it are hidden. Returns ``[]`` for no logger (pass ``logger=False`` to the Trainer).
    """
    selected = plain(cfg_logger) or {}
    if not isinstance(selected, Mapping):
        raise ValueError(f"logger must be a mapping {{name: options}}, got {selected!r}")
    for name in selected:
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}; choose from {', '.join(LOGGERS)} or none "
                             f"(several: logger=[csv,tensorboard])")
    out_dir = Path(out_dir)
    loggers: list[Logger] = []
    if "csv" in selected or need_csv:
        kwargs = _options("csv", selected.get("csv"))
        fixed = sorted(set(kwargs) & set(_CSV_FIXED))
        if fixed:
            raise ValueError(f"logger.csv cannot set {fixed}: the reports read "
                             "<run dir>/metrics/<algorithm>/metrics.csv")
        if "csv" not in selected and rank_zero_only.rank == 0:
            log.info("logger: writing %s as well, the run report reads it", out_dir / "metrics" / label / "metrics.csv")
        loggers.append(ResumableCSVLogger(save_dir=str(out_dir), name="metrics", version=label,
                                          resume_step=resume_step, **kwargs))
    if "tensorboard" in selected:
        if not _tensorboard_available():
            raise ImportError("logger=tensorboard needs TensorBoard: pip install tensorboard")
        kwargs = _options("tensorboard", selected.get("tensorboard"))
        if resume_step is not None:
            kwargs.setdefault("purge_step", resume_step)
        loggers.append(TensorBoardLogger(**{"save_dir": str(out_dir), "name": "tensorboard", "version": label,
                                            **kwargs}))
    return loggers

"""Helpers shared by the recipe modules. A leaf: it imports no other recipe module, so every
recipe module can import it without a cycle."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from omegaconf import OmegaConf

from lightning_onebit.optim import NonFiniteGradientError

__all__ = ["DatasetMissingError", "StopOnDivergence", "optional_import", "plain", "require"]


def optional_import(name: str, missing: str | None = None) -> ModuleType:
    """Import a dependency of the recipes that the library itself does not need (scikit-learn,
    matplotlib, torchvision, transformers), raising ImportError with ``missing`` (by default: which
    extra installs it) when it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(missing or f"the recipes need {name.split('.')[0]}: pip install -e '.[recipes]'") from exc


class DatasetMissingError(FileNotFoundError):
    """A dataset is not where the config says and ``data.download`` is off."""


def require(path: Path, how_to_get: str) -> Path:
    """``path`` if it exists, else a :class:`DatasetMissingError` naming it and the remedy."""
    if not path.exists():
        raise DatasetMissingError(f"dataset not found: {path.resolve()}\n{how_to_get}")
    return path


class StopOnDivergence:
    """LightningModule mixin (list it before ``L.LightningModule``): a divergence is a result,
    not a crash. Sets ``status`` and stops the fit, keeping what was logged, so the report says
    so and a multirun goes on to the other algorithms.

    A compressed algorithm that diverges raises NonFiniteGradientError on every rank at the
    same step (the library agrees on it), from the DDP backward hook (compression phase) or
    from step() (warm-up).
    """

    status: str = "ok"

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(loss, *args, **kwargs)
        except NonFiniteGradientError as exc:
            self._diverged(exc)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        # After a divergence caught in backward, step() finds the same non-finite bucket and
        # raises again on every rank: no rank changes its parameters.
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        except NonFiniteGradientError as exc:
            self._diverged(exc)

    def _diverged(self, exc: Exception) -> None:
        if self.status == "ok":
            self.status = f"diverged at step {self.trainer.global_step + 1} ({type(exc).__name__})"
        self.trainer.should_stop = True


def plain(node: Any) -> Any:
    """A config node (mapping or list) as plain, resolved Python containers; anything else as it is.
    Config objects must not reach checkpoints: they only load with weights_only=False."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

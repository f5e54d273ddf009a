"""Helpers shared by the recipe modules. A leaf: it imports no other recipe module, so every
recipe module can import it without a cycle."""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from omegaconf import OmegaConf

from lightning_onebit.optim import NonFiniteGradientError

__all__ = ["WORKER_START_METHODS", "DatasetMissingError", "StopOnDivergence", "loader_workers", "optional_import",
           "plain", "preload_fork_server", "require"]

#: how ``data.worker_start_method`` may start DataLoader workers
WORKER_START_METHODS = ("forkserver", "spawn", "fork")


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


def loader_workers(num_workers: int, start_method: str = "forkserver") -> dict[str, Any]:
    """DataLoader keywords for ``num_workers`` worker processes started by ``start_method``.

    ``forkserver`` (the default, and Python's own from 3.14): a rank that forks its workers
    forks a process in which gloo's/NCCL's and OpenMP's threads are running, and a C-level lock
    one of them holds at that instant (glibc resets only some of its own at fork) stays held in
    the child, which can then block forever before its first batch. A fork server is a
    single-threaded process that each rank starts once (:func:`preload_fork_server` makes it
    import what the dataset needs, so a worker only forks); the price is the server's start, once,
    and the dataset pickled to each epoch's workers (CIFAR-10's images go as a shared-memory handle,
    :class:`recipes.vision.SharedImages`; ``benchmarks/loader_start.py`` measures it). ``fork``
    starts workers fastest and keeps that hazard; ``spawn`` also imports everything in every worker.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"data.num_workers must be an integer >= 0, not {num_workers!r}")
    if start_method not in WORKER_START_METHODS:
        raise ValueError(f"data.worker_start_method={start_method!r}: expected one of {WORKER_START_METHODS}")
    if start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"data.worker_start_method={start_method!r} is not available on this platform "
                         f"(available: {multiprocessing.get_all_start_methods()})")
    # DataLoader refuses a start method without workers
    return {"num_workers": num_workers, "multiprocessing_context": start_method if num_workers else None}


def preload_fork_server(workers: dict[str, Any], modules: tuple[str, ...]) -> None:
    """Make this process's fork server (if ``workers`` start from one and it has not started)
    import ``modules`` as well as the main script: a worker forked from it then unpickles its
    dataset without importing torch, torchvision etc. again (seconds per worker and epoch). Call it
    in the process that iterates the loader (the rank), e.g. from ``train_dataloader``."""
    server = multiprocessing.forkserver._forkserver
    if workers.get("multiprocessing_context") != "forkserver" or getattr(server, "_forkserver_pid", 1) is not None:
        return  # not used, or already running with what it imported
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    multiprocessing.forkserver.set_forkserver_preload(preload + [m for m in modules if m not in preload])
    # Python 3.11 starts the server with the interpreter's default sys.path, not this process's, and
    # drops a module it cannot import: one found through a path added at run time (recipes/train.py
    # adds the repository) would be imported again by every worker of every epoch. Start it now,
    # with this process's path in its PYTHONPATH.
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + ([old] if old else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


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

"""Data for the recipes: the digits datamodule and the LibSVM loader.

Every dataset honours ``data.root`` (where it lives) and ``data.download``. A dataset that
is missing while ``download`` is off fails at once with
:class:`~recipes.common.DatasetMissingError`, which names the path and says how to get the
data, before any process is started or any step is taken. Datamodules are looked up by
``data.name`` in :data:`recipes.registry.DATAMODULES`.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .common import loader_workers, optional_import, preload_fork_server, require

__all__ = ["BUNDLED_BINARY", "LIBSVM_DATASETS", "LIBSVM_URL", "DigitsDataModule", "InMemoryDataModule",
           "libsvm_path", "load_libsvm"]

#: the LibSVM binary-classification collection (CD-Adam paper, section 7.1)
LIBSVM_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary"
LIBSVM_DATASETS = ("phishing", "mushrooms", "a9a", "w8a")
#: binary problems made from data bundled with scikit-learn (offline), see :func:`_bundled_binary`
BUNDLED_BINARY = ("breast_cancer", "digits")


# -- Lightning datamodules ------------------------------------------------------------------
class InMemoryDataModule(L.LightningDataModule):
    """Base of the small datamodules whose ``setup`` builds both splits in memory
    (``train_set``, ``val_set``): training batches of ``batch_size``, shuffled; validation
    batches of 256, in order; ``num_workers`` processes started by ``worker_start_method``
    (:func:`recipes.common.loader_workers`)."""

    def __init__(self, batch_size: int, num_workers: int = 0, seed: int = 0,
                 worker_start_method: str = "forkserver") -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.workers = loader_workers(num_workers, worker_start_method)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def train_dataloader(self) -> DataLoader:
        preload_fork_server(self.workers, ("torch",))
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, **self.workers)

    def val_dataloader(self) -> DataLoader:
        preload_fork_server(self.workers, ("torch",))
        return DataLoader(self.val_set, batch_size=256, shuffle=False, **self.workers)


class DigitsDataModule(InMemoryDataModule):
    """scikit-learn's digits (1797 8x8 images, 10 classes), scaled to [0, 1], with a
    stratified validation split. It ships inside scikit-learn, so it is always available
    offline; ``root``/``download`` are accepted for a uniform interface and unused."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, num_workers: int = 0, seed: int = 0,
                 root: str | None = None, download: bool = False, worker_start_method: str = "forkserver") -> None:
        super().__init__(batch_size, num_workers, seed, worker_start_method)
        self.val_fraction = val_fraction

    def setup(self, stage: str | None = None) -> None:
        X, y = optional_import("sklearn.datasets").load_digits(return_X_y=True)
        split = optional_import("sklearn.model_selection").train_test_split
        Xtr, Xva, ytr, yva = split(X / 16.0, y, test_size=self.val_fraction, stratify=y, random_state=self.seed)
        self.train_set = TensorDataset(torch.tensor(Xtr, dtype=torch.float32), torch.tensor(ytr))
        self.val_set = TensorDataset(torch.tensor(Xva, dtype=torch.float32), torch.tensor(yva))


# -- LibSVM files (logreg_nonconvex) ---------------------------------------------------------
def _bundled_binary(source: str) -> tuple[np.ndarray, np.ndarray]:
    """Binary problems from data that ships with scikit-learn, scaled like the LibSVM
    collection's files: ``breast_cancer`` (569 x 30, standardised per feature) and ``digits``
    (1797 x 64 pixels in [0, 1], label: digit >= 5). Labels are +-1."""
    datasets = optional_import("sklearn.datasets")
    if source == "breast_cancer":
        X, y = datasets.load_breast_cancer(return_X_y=True)
        return (X - X.mean(0)) / X.std(0), 2 * y - 1
    X, y = datasets.load_digits(return_X_y=True)
    return X / 16.0, np.where(y >= 5, 1, -1)


def _write_bundled(source: str, path: Path) -> None:
    X, y = _bundled_binary(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    optional_import("sklearn.datasets").dump_svmlight_file(X, y, str(tmp), zero_based=False)
    tmp.replace(path)


def libsvm_path(data_cfg: Mapping[str, Any]) -> Path:
    """The LibSVM file ``data`` points at, making or fetching it where the config allows.

    ``data.path`` wins. Otherwise ``data.source``: ``breast_cancer`` or ``digits`` is written
    from scikit-learn's bundled data under ``data.root`` (offline); a LibSVM collection name (``phishing``,
    ``mushrooms``, ``a9a``, ``w8a``) is ``<data.root>/libsvm/<name>``, fetched from the LibSVM
    site with ``data.download=true``.
    """
    root = Path(data_cfg.get("root") or "data")
    if data_cfg.get("path"):
        path = Path(data_cfg["path"])
        return require(path, f"data.path must be a LibSVM-format text file. The CD-Adam paper's sets are at "
                             f"{LIBSVM_URL}/ (e.g. {LIBSVM_URL}/a9a); or run offline with "
                             f"data.source=breast_cancer and no data.path.")
    source = data_cfg.get("source") or "breast_cancer"
    if source in BUNDLED_BINARY:
        path = root / "libsvm" / f"{source}.svm"
        if not path.exists():
            _write_bundled(source, path)
        return path
    if source not in LIBSVM_DATASETS:
        raise ValueError(f"unknown data.source {source!r}: one of {[*BUNDLED_BINARY, *LIBSVM_DATASETS]}, "
                         "or give a file with data.path")
    path = root / "libsvm" / source
    url = f"{LIBSVM_URL}/{source}"
    if not path.exists() and data_cfg.get("download"):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        urllib.request.urlretrieve(url, tmp)
        tmp.replace(path)
    return require(path, f"Get it from {url} (the LibSVM binary collection, {LIBSVM_URL}/) and save it as that "
                         f"file, or rerun with data.download=true, or data.path=<your file>.")


def load_libsvm(path: Path, shuffle: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(X dense fp32, y in {-1, +1}) from a LibSVM file read by scikit-learn's svmlight reader.

    Two-class labels of any coding (0/1, 1/2, -1/+1) map to -1/+1 (the larger is +1).
    """
    X, y = optional_import("sklearn.datasets").load_svmlight_file(str(path))
    classes = np.unique(y)
    if len(classes) != 2:
        raise ValueError(f"{path}: expected a binary-classification file, found labels {classes[:10]}")
    y = np.where(y == classes[1], 1.0, -1.0)
    X = X.toarray()
    if shuffle:
        perm = np.random.default_rng(seed).permutation(len(y))
        X, y = X[perm], y[perm]
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)

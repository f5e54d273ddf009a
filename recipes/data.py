"""Data for the recipes: Lightning datamodules and the LibSVM loader.

Every dataset honours ``data.root`` (where it lives) and ``data.download``. A dataset that
is missing while ``download`` is off fails at once with :class:`DatasetMissingError`, which
names the path and says how to get the data, before any process is started or any step
is taken. New datamodules (CIFAR-10, GLUE, SQuAD) register in :data:`DATAMODULES`.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from . import optional_import

__all__ = ["BUNDLED_BINARY", "DATAMODULES", "LIBSVM_DATASETS", "LIBSVM_URL", "DatasetMissingError", "DigitsDataModule",
           "build_datamodule", "libsvm_path", "load_libsvm"]

#: the LibSVM binary-classification collection (CD-Adam paper, section 7.1)
LIBSVM_URL = "https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/binary"
LIBSVM_DATASETS = ("phishing", "mushrooms", "a9a", "w8a")
#: binary problems made from data bundled with scikit-learn (offline), see :func:`_bundled_binary`
BUNDLED_BINARY = ("breast_cancer", "digits")


class DatasetMissingError(FileNotFoundError):
    """A dataset is not where the config says and ``data.download`` is off."""


def require(path: Path, how_to_get: str) -> Path:
    """``path`` if it exists, else a :class:`DatasetMissingError` naming it and the remedy."""
    if not path.exists():
        raise DatasetMissingError(f"dataset not found: {path.resolve()}\n{how_to_get}")
    return path


# -- Lightning datamodules ------------------------------------------------------------------
class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's digits (1797 8x8 images, 10 classes), scaled to [0, 1], with a
    stratified validation split. It ships inside scikit-learn, so it is always available
    offline; ``root``/``download`` are accepted for a uniform interface and unused."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, num_workers: int = 0, seed: int = 0,
                 root: str | None = None, download: bool = False) -> None:
        super().__init__()
        self.batch_size, self.val_fraction, self.num_workers, self.seed = batch_size, val_fraction, num_workers, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        X, y = optional_import("sklearn.datasets").load_digits(return_X_y=True)
        split = optional_import("sklearn.model_selection").train_test_split
        Xtr, Xva, ytr, yva = split(X / 16.0, y, test_size=self.val_fraction, stratify=y, random_state=self.seed)
        self.train_set = TensorDataset(torch.tensor(Xtr, dtype=torch.float32), torch.tensor(ytr))
        self.val_set = TensorDataset(torch.tensor(Xva, dtype=torch.float32), torch.tensor(yva))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, shuffle=False, num_workers=self.num_workers)


def cifar10(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.vision.CIFAR10DataModule`, imported here so that torchvision is needed
    only by the CIFAR-10 experiments."""
    from .vision import CIFAR10DataModule

    return CIFAR10DataModule(**kwargs)


def glue(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.nlp.GlueDataModule`, imported here so that transformers and datasets are
    needed only by the BERT experiments."""
    from .nlp import GlueDataModule

    return GlueDataModule(**kwargs)


def squad(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.nlp.SquadDataModule` (imported on use, like :func:`glue`)."""
    from .nlp import SquadDataModule

    return SquadDataModule(**kwargs)


def markov(**kwargs: Any) -> L.LightningDataModule:
    """:class:`recipes.lm.MarkovTextDataModule` (imported on use, like :func:`glue`)."""
    from .lm import MarkovTextDataModule

    return MarkovTextDataModule(**kwargs)


#: data.name -> datamodule class; its constructor takes the rest of the ``data`` config + ``seed``
DATAMODULES: dict[str, Callable[..., L.LightningDataModule]] = {"digits": DigitsDataModule, "cifar10": cifar10,
                                                                "glue": glue, "squad": squad, "markov": markov}


def build_datamodule(data_cfg: Mapping[str, Any], seed: int = 0) -> L.LightningDataModule:
    cfg = dict(data_cfg)
    name = cfg.pop("name")
    if name not in DATAMODULES:
        raise ValueError(f"unknown data.name {name!r}; choose one of {sorted(DATAMODULES)}")
    return DATAMODULES[name](seed=seed, **cfg)


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

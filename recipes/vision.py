"""CIFAR-10 for the recipes: the datamodule (torchvision's reader) and the CIFAR variants of
ResNet-18 and VGG-16 used by the CD-Adam and 1-bit Adam papers.

torchvision is imported on first use of the data, so the networks (and every recipe that does
not read CIFAR-10) work without it. The networks are written here rather than taken from
``torchvision.models``, whose ResNet/VGG are the ImageNet variants (7x7 stride-2 stem and
max-pool; 4096-wide classifier) and do not fit 32x32 images.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from .common import loader_workers, optional_import, preload_fork_server, require

__all__ = ["CIFAR10_DIR", "CIFAR10_FILES", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_URL", "CIFAR10DataModule",
           "ResNetCIFAR", "SharedImages", "VGGCIFAR", "resnet18_cifar", "vgg16_cifar"]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
#: what the archive extracts to (``cifar-10-batches-py/`` under ``data.root``)
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
                 "batches.meta")
#: per-channel mean and standard deviation of the 50000 training images (in [0, 1])
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _torchvision() -> ModuleType:
    return optional_import("torchvision", "the CIFAR-10 recipes need torchvision built for your torch, e.g. pip "
                           "install torch==2.14.1 torchvision==0.29.1, then pip install -e '.[vision]'")


@functools.cache
def _unverified_class() -> type:
    """torchvision's CIFAR10 that checks the files exist instead of their md5 sums.

    For data in the real format that is not the published archive (the tests' generated
    batches, a re-pickled copy): torchvision compares every batch file and ``batches.meta``
    with the archive's md5 and refuses anything else. ``data.verify=false`` selects it.
    """
    base = _torchvision().datasets.CIFAR10

    class UnverifiedCIFAR10(base):
        meta = {**base.meta, "md5": None}  # _load_meta checks this file itself

        def _check_integrity(self) -> bool:
            return all((Path(self.root) / self.base_folder / name).is_file()
                       for name, _ in self.train_list + self.test_list)

    # resolvable as recipes.vision.UnverifiedCIFAR10 (see __getattr__), so that the datasets
    # pickle (DataLoader workers started by spawn or forkserver)
    UnverifiedCIFAR10.__module__, UnverifiedCIFAR10.__qualname__ = __name__, "UnverifiedCIFAR10"
    return UnverifiedCIFAR10


def __getattr__(name: str) -> Any:  # PEP 562: the torchvision subclass is made on first use
    if name == "UnverifiedCIFAR10":
        return _unverified_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CIFAR10DataModule(L.LightningDataModule):
    """CIFAR-10 (torchvision's reader of the python batches under ``<root>/cifar-10-batches-py``).

    Training: 4-pixel zero-padded random 32x32 crop, random horizontal flip, normalised per
    channel with the training set's mean/std; validation: the 10000-image test split,
    normalised only. ``batch_size`` is per process.

    Args:
        root: the directory holding ``cifar-10-batches-py/`` (``data.root``).
        download: fetch and extract the archive into ``root`` if it is missing (once per
            node, in ``prepare_data``). Off and missing: :class:`~recipes.common.DatasetMissingError`
            from the constructor, i.e. before any process is started.
        verify: check the files' md5 against the published archive (torchvision's check);
            ``False`` only checks that they exist.
        train_subset, val_subset: use only the first N images of a split (short runs);
            ``None`` for all.
        seed: accepted for the datamodules' common interface; shuffling is seeded by
            ``seed_everything`` and Lightning's distributed sampler.
        num_workers, worker_start_method: DataLoader processes per rank and how they start
            (:func:`recipes.common.loader_workers`: a fork server by default, never a fork of
            the threaded rank).
    """

    def __init__(self, batch_size: int = 128, num_workers: int = 4, root: str | Path = "data", download: bool = False,
                 seed: int = 0, verify: bool = True, train_subset: int | None = None,
                 val_subset: int | None = None, worker_start_method: str = "forkserver") -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.workers = loader_workers(num_workers, worker_start_method)
        self.root, self.download, self.verify = Path(root), download, verify
        self.train_subset, self.val_subset = train_subset, val_subset
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        _torchvision()  # fail here, in the launching process, rather than in every rank
        if not download:
            how = (f"Download {CIFAR10_URL} and extract it under data.root ({self.root}), which creates "
                   f"{CIFAR10_DIR}/ there; or rerun with data.download=true, or point data.root at the "
                   f"directory that holds {CIFAR10_DIR}/.")
            require(self.root / CIFAR10_DIR, how)
            for name in CIFAR10_FILES:
                require(self.root / CIFAR10_DIR / name, f"The extracted archive is incomplete. {how}")

    def _dataset_class(self) -> type:
        return _torchvision().datasets.CIFAR10 if self.verify else _unverified_class()

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node, before setup() on every rank
        if self.download:
            self._dataset_class()(str(self.root), train=True, download=True)

    def setup(self, stage: str | None = None) -> None:
        T = _torchvision().transforms
        norm = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        cls = self._dataset_class()
        train = cls(str(self.root), train=True, transform=T.Compose([T.RandomCrop(32, padding=4),
                                                                      T.RandomHorizontalFlip(), *norm]))
        val = cls(str(self.root), train=False, transform=T.Compose(norm))
        if self.workers["multiprocessing_context"] in ("forkserver", "spawn"):
            train, val = SharedImages(train), SharedImages(val)
        self.train_set = _first(train, self.train_subset)
        self.val_set = _first(val, self.val_subset)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        # Workers start again every epoch, seeded from torch's generator: an epoch's crops and flips
        # then depend only on the generator's state at its start, which checkpoints carry
        # (recipes.callbacks.RNGStates). Persistent workers carry their streams across epochs, which a
        # resumed run cannot reproduce; the price is one worker start-up per epoch.
        preload_fork_server(self.workers, (__name__, "torchvision"))
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, pin_memory=torch.cuda.is_available(),
                          **self.workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


class SharedImages(Dataset):
    """A torchvision image dataset (``data``: uint8 images, ``targets``, its transforms) whose
    images live in shared memory: a DataLoader worker started by a fork server or spawn then
    receives a handle to them instead of a pickled copy (CIFAR-10's training set: 150 MB per
    worker and epoch). Items are the source's, bit for bit.

    Where shared memory is too small for them (a container's default 64 MB ``/dev/shm``), the
    images stay private and are pickled to every worker, with a warning.
    """

    def __init__(self, source: Any) -> None:
        self.images = torch.from_numpy(source.data)
        try:
            self.images.share_memory_()
        except RuntimeError as exc:
            warnings.warn(f"{self.images.nbytes / 2**20:.0f} MB of images do not fit in shared memory ({exc}); "
                          "every DataLoader worker gets a pickled copy instead. Give the container more "
                          "(docker run --shm-size=...) or use data.worker_start_method=fork", stacklevel=2)
        self.targets = list(source.targets)
        self.transform, self.target_transform = source.transform, source.target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        from PIL import Image  # torchvision's dependency

        img, target = Image.fromarray(self.images[index].numpy()), self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


def _first(dataset: Dataset, n: int | None) -> Dataset:
    if n is None:
        return dataset
    if not 0 < n <= len(dataset):
        raise ValueError(f"a subset of {n} images of a {len(dataset)}-image split")
    return Subset(dataset, range(n))


# -- networks --------------------------------------------------------------------------------
def _init(module: nn.Module) -> None:
    """He initialisation for the ReLU convolutions (as torchvision's ResNet/VGG do); the
    default (a=sqrt(5)) shrinks the signal layer by layer, which hurts the plain VGG-16."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    """ResNet for 32x32 inputs: 3x3 stride-1 stem without max-pool, four stages of
    BasicBlocks (the first at stride 1, the others halving the resolution), global average
    pool and a linear classifier."""

    def __init__(self, blocks: Sequence[int] = (2, 2, 2, 2), widths: Sequence[int] = (64, 128, 256, 512),
                 num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        stages, in_planes = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths, strict=True)):
            stages.append(nn.Sequential(*[BasicBlock(in_planes if j == 0 else w, w, 2 if i > 0 and j == 0 else 1)
                                          for j in range(n)]))
            in_planes = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def resnet18_cifar(num_classes: int = 10) -> ResNetCIFAR:
    """ResNet-18 for CIFAR (11.17M parameters with 10 classes)."""
    return ResNetCIFAR((2, 2, 2, 2), (64, 128, 256, 512), num_classes)


#: VGG-16's convolutions (configuration D): output channels, "M" = 2x2 max-pool
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGGCIFAR(nn.Module):
    """VGG for 32x32 inputs: the 3x3 convolutions (+ batch norm) + ReLU of ``config``; after
    five max-pools the map is 512 x 1 x 1, classified by a single linear layer."""

    def __init__(self, config: Sequence[int | str] = VGG16, num_classes: int = 10, batch_norm: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for c in config:
            if c == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            layers.append(nn.Conv2d(in_ch, int(c), 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(int(c)))
            layers.append(nn.ReLU(inplace=True))
            in_ch = int(c)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(in_ch, num_classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def vgg16_cifar(num_classes: int = 10, batch_norm: bool = False) -> VGGCIFAR:
    """VGG-16 for CIFAR (14.72M parameters with 10 classes; batch norm adds 8448).

    The plain one (no batch norm) is where 1-bit Adam with DeepSpeed's ``sqrt(v) + eps``
    is reported to diverge once compression starts (Tarasov & Ershov 2022)."""
    return VGGCIFAR(VGG16, num_classes, batch_norm)

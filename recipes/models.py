"""Models of the recipes: the MLP and a LightningModule for the Lightning experiments, and the
closed-form objectives of the simulated studies (CD-Adam's eq. 7.1, Tarasov-Ershov's quadratic).

Networks are looked up by ``model.name`` in :data:`recipes.registry.NETWORKS` (the CIFAR ones
live in :mod:`recipes.vision`, the language model in :mod:`recipes.lm`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from .algorithms import build_optimizer
from .common import StopOnDivergence

__all__ = ["Classifier", "NonconvexLogReg", "Quadratic", "mlp"]


def mlp(in_features: int, hidden: Sequence[int], num_classes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class Classifier(StopOnDivergence, L.LightningModule):
    """Cross-entropy classification whose optimizer comes from the algorithm config entry.

    Logs ``train_loss`` per step and ``val_loss``/``val_acc`` per epoch (accuracy from
    torchmetrics, synchronised over ranks). ``milestones`` gives a MultiStepLR by epoch, the
    CIFAR recipes' schedule.
    """

    def __init__(self, net: nn.Module, num_classes: int, algorithm: Mapping[str, Any],
                 milestones: Sequence[int] | None = None, gamma: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = build_optimizer(dict(self.hparams.algorithm), self.parameters())
        if not self.hparams.milestones:
            return opt
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(self.hparams.milestones), self.hparams.gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class NonconvexLogReg:
    r"""CD-Adam paper eq. (7.1) over ``workers`` equal shards of the data:

    .. math:: f(x) = \frac1W \sum_w \frac1{n_w} \sum_{i \in w} \log(1 + e^{-y_i a_i^\top x})
              + \lambda \sum_j \frac{x_j^2}{1 + x_j^2}

    Gradients are closed-form (one matrix product for all workers), so 20 simulated workers
    cost about as much as one.
    """

    def __init__(self, X: torch.Tensor, y: torch.Tensor, workers: int, lam: float = 0.1,
                 batch_size: int | None = None, seed: int = 0) -> None:
        if X.shape[0] < workers:
            raise ValueError(f"{X.shape[0]} samples cannot be split over {workers} workers")
        self.X, self.y, self.workers, self.lam = X, y, workers, lam
        self.batch_size = batch_size
        n = X.shape[0]
        # np.array_split semantics: the first n % W shards get one sample more
        sizes = [n // workers + (1 if w < n % workers else 0) for w in range(workers)]
        self.wid = torch.repeat_interleave(torch.arange(workers), torch.tensor(sizes))
        self.count = torch.tensor(sizes, dtype=X.dtype)
        self.bounds = torch.tensor([0, *sizes]).cumsum(0)
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def dim(self) -> int:
        return self.X.shape[1]

    def _reg_grad(self, x: torch.Tensor) -> torch.Tensor:
        return self.lam * 2 * x / (1 + x * x) ** 2

    def _full_worker_grads(self, x: torch.Tensor) -> torch.Tensor:
        coef = -self.y * torch.sigmoid(-self.y * (self.X @ x))
        g = torch.zeros(self.workers, self.dim, dtype=x.dtype).index_add_(0, self.wid, coef[:, None] * self.X)
        return g / self.count[:, None]

    def worker_grads(self, x: torch.Tensor) -> torch.Tensor:
        """(workers, dim): each worker's (stochastic, with ``batch_size``) gradient at ``x``."""
        x = x.detach()
        if self.batch_size is None:
            return self._full_worker_grads(x) + self._reg_grad(x)
        lo, cnt = self.bounds[:-1], self.count.long()
        pick = (torch.rand(self.workers, self.batch_size, generator=self.gen) * cnt[:, None]).long() + lo[:, None]
        Xb, yb = self.X[pick], self.y[pick]  # (W, B, d), (W, B)
        coef = -yb * torch.sigmoid(-yb * torch.einsum("wbd,d->wb", Xb, x))
        return torch.einsum("wb,wbd->wd", coef, Xb) / self.batch_size + self._reg_grad(x)

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        """Gradient of f (the mean of the workers' full local objectives)."""
        return self._full_worker_grads(x.detach()).mean(0) + self._reg_grad(x.detach())

    def loss(self, x: torch.Tensor) -> float:
        x = x.detach()
        per = nn.functional.softplus(-self.y * (self.X @ x))
        local = torch.zeros(self.workers, dtype=x.dtype).index_add_(0, self.wid, per) / self.count
        return float(local.mean() + self.lam * (x * x / (1 + x * x)).sum())


class Quadratic:
    r"""Tarasov-Ershov's study: :math:`f(x) = \sum_k a_k x_k^2`, :math:`a = \mathrm{logspace}(lo, 0, d)`."""

    def __init__(self, dim: int, log10_min_curvature: float) -> None:
        self.a = torch.logspace(log10_min_curvature, 0, dim, dtype=torch.float32)

    def init(self) -> torch.Tensor:
        return torch.ones_like(self.a)

    def loss(self, x: torch.Tensor) -> float:
        return float((self.a * x.detach() ** 2).sum())

    def grad(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.a * x.detach()

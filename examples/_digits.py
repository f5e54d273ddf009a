"""The small task the examples share: scikit-learn's bundled digits (offline), an MLP."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits_dataset() -> TensorDataset:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # Plain AdamW: the strategy converts it to its algorithm with the same hyperparameters.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(digits_dataset(), batch_size=32, shuffle=True)

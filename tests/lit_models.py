"""Small LightningModules for the strategy tests (importable by spawned ranks)."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits_loaders(batch_size: int = 32, n: int = 512):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:n] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[:n])
    return DataLoader(TensorDataset(X, y), batch_size=batch_size, shuffle=False)


class DigitsMLP(L.LightningModule):
    def __init__(self, optimizer: str = "adamw", lr: float = 3e-3, weight_decay: float = 0.01,
                 scheduler: bool = False, opt_kwargs: dict | None = None, rank_kwargs: dict | None = None,
                 nan_at: list | None = None) -> None:
        """``rank_kwargs``: optimizer arguments that differ by rank, ``{name: [value of rank 0, ...]}``;
        ``nan_at``: ``[rank, global step]`` pairs whose loss (so gradient) is NaN on that rank only."""
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.automatic_optimization = optimizer != "two"  # Lightning needs manual mode for several

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if [self.global_rank, self.global_step] in [list(p) for p in self.hparams.nan_at or []]:
            loss = loss * float("nan")
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        params = self.parameters()
        if hp.optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
        elif hp.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay)
        elif hp.optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=hp.lr)
        elif hp.optimizer == "two":
            return [torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[2].parameters())]
        else:
            import lightning_onebit

            kwargs = dict(hp.opt_kwargs or {})
            kwargs.update({k: v[self.global_rank] for k, v in (hp.rank_kwargs or {}).items()})
            opt = getattr(lightning_onebit, hp.optimizer)(params, lr=hp.lr, **kwargs)
        if hp.scheduler:
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        return opt

    def train_dataloader(self):
        return digits_loaders()


class DigitsMLPWithValidation(DigitsMLP):
    """DigitsMLP with a validation loop (the last 256 digits)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def val_dataloader(self):
        from sklearn.datasets import load_digits

        X, y = load_digits(return_X_y=True)
        return DataLoader(TensorDataset(torch.tensor(X[-256:] / 16.0, dtype=torch.float32), torch.tensor(y[-256:])),
                          batch_size=64)


class SaveParams(L.Callback):
    """Every rank writes its final parameters and comm figures (spawned ranks cannot return them)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir
        self.steps: list[tuple[int, float, bool]] = []
        self.validated: list[tuple[int, list[torch.Tensor]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opt = trainer.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)
        if hasattr(opt, "comm_counter"):
            self.steps.append((trainer.global_step, opt.comm_counter.last.bytes_sent, opt.compressing,
                               getattr(opt, "activated", 0)))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # the parameters each rank evaluates
            self.validated.append((trainer.global_step, [p.detach().clone() for p in pl_module.parameters()]))

    def on_train_end(self, trainer, pl_module) -> None:
        import os

        params = [p.detach().clone() for p in pl_module.parameters()]
        opt = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        counter = getattr(opt, "comm_counter", None)
        # what one compressed sync of every bucket sends (codes + per-tensor scales)
        payload = sum(b.comm.bytes_per_call(b.numel) for b in getattr(opt, "_buckets", []) if b.comm is not None)
        torch.save({"params": params, "steps": self.steps, "global_step": trainer.global_step, "payload": payload,
                    "comm_steps": counter.steps if counter else None,
                    "bytes_total": counter.total.bytes_sent if counter else None,
                    "skipped_steps": getattr(opt, "skipped_steps", None), "validated": self.validated,
                    "probe": os.environ.get("LIGHTNING_ONEBIT_PROBE"), "rng": torch.random.initial_seed(),
                    "start_method": __import__("multiprocessing").get_start_method(),
                    "rounds": counter.rounds if counter else None},
                   os.path.join(self.outdir, f"rank{trainer.global_rank}.pt"))

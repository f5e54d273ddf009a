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


class DigitsBNWithValidation(DigitsMLPWithValidation):
    """With a BatchNorm layer: buffers (running statistics) that each rank updates from its own batches."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


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
            self.steps.append((trainer.global_step, opt.comm_counter.last.bytes_sent, getattr(opt, "compressing", None),
                               getattr(opt, "activated", 0)))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # the parameters (and buffers) each rank evaluates
            self.validated.append((trainer.global_step, [p.detach().clone() for p in pl_module.parameters()],
                                   [b.detach().clone() for b in pl_module.buffers()]))

    def on_train_end(self, trainer, pl_module) -> None:
        import os

        params = [p.detach().clone() for p in pl_module.parameters()]
        opt = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        counter = getattr(opt, "comm_counter", None)
        # what one compressed sync of every bucket sends (codes + per-tensor scales)
        synced = [(b.numel, b.sync.comm) for b in getattr(opt, "_buckets", []) if b.sync.comm is not None]
        payload = sum(c.bytes_per_call(n) for n, c in synced)
        # whether every bucket's collective sends each direction of a pair on its own connection
        duplex = [getattr(c, "_twin", None) is not None for _, c in synced]
        torch.save({"params": params, "buffers": [b.detach().clone() for b in pl_module.buffers()],
                    "broadcast_buffers": getattr(trainer.strategy.model, "broadcast_buffers", None),
                    "steps": self.steps, "global_step": trainer.global_step, "payload": payload,
                    "comm_steps": counter.steps if counter else None,
                    "bytes_total": counter.total.bytes_sent if counter else None,
                    "skipped_steps": getattr(opt, "skipped_steps", None), "validated": self.validated,
                    "probe": os.environ.get("LIGHTNING_ONEBIT_PROBE"), "rng": torch.random.initial_seed(),
                    "start_method": __import__("multiprocessing").get_start_method(),
                    "rounds": counter.rounds if counter else None, "duplex": duplex},
                   os.path.join(self.outdir, f"rank{trainer.global_rank}.pt"))


class DigitsGAN(L.LightningModule):
    """A small GAN on the digits as Lightning's GAN example writes one: manual optimization, one
    optimizer for the generator and one for the discriminator, ``toggle_optimizer`` around each
    step. The noise is a function of (rank, step), so a resumed run draws what an uninterrupted one does."""

    def __init__(self, lr: float = 2e-3, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64),
                                       nn.Sigmoid())
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.Generator().manual_seed(10_000 * self.global_rank + self.global_step)
        fake = self.generator(torch.randn(x.shape[0], 16, generator=noise))
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1)

        self.toggle_optimizer(opt_d)
        d_loss = bce(self.discriminator(x), ones) + bce(self.discriminator(fake.detach()), zeros)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr = self.hparams.lr
        if self.hparams.optimizer == "adamw":
            return [torch.optim.AdamW(self.generator.parameters(), lr=lr, betas=(0.5, 0.999)),
                    torch.optim.AdamW(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))]
        return [torch.optim.AdamW(self.generator.parameters(), lr=lr),
                torch.optim.SGD(self.discriminator.parameters(), lr=lr)]

    def train_dataloader(self):
        return digits_loaders(n=256)


class ScheduledDigitsMLP(DigitsMLP):
    """DigitsMLP with an AdamW and LR schedulers in Lightning's dict form: ``"sequential+plateau"``
    (SequentialLR(LinearLR, CosineAnnealingLR) every step, and ReduceLROnPlateau every epoch on a
    logged metric that does not depend on training, so that every run sees the same values) or
    ``"onecycle"`` (OneCycleLR every step; it also cycles Adam's beta1)."""

    def __init__(self, schedule: str = "sequential+plateau", lr: float = 3e-3, total_steps: int = 16) -> None:
        super().__init__(lr=lr)
        self.schedule, self.total_steps = schedule, total_steps  # the full run's steps (a resume's too)

    def training_step(self, batch, batch_idx):
        self.log("plateau_metric", 1.0, on_step=False, on_epoch=True)  # never improves: plateau after patience
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        S = torch.optim.lr_scheduler
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if self.schedule == "onecycle":
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": S.OneCycleLR(opt, max_lr=1e-2, total_steps=self.total_steps), "interval": "step"}}
        seq = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=4),
                                   S.CosineAnnealingLR(opt, T_max=20)], milestones=[4])
        plateau = S.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return [opt], [{"scheduler": seq, "interval": "step"},
                       {"scheduler": plateau, "interval": "epoch", "monitor": "plateau_metric"}]


class Trace(L.Callback):
    """Every rank writes, at the end of fit: the lr and beta1 of each param group of each optimizer
    before every training batch, the parameters, and the warnings this rank raised from setup on
    (spawned ranks cannot hand them to pytest)."""

    def __init__(self, outdir: str) -> None:
        self.outdir = outdir
        self.lrs: list[list] = []
        self._warnings = None
        self._log: list = []

    def setup(self, trainer, pl_module, stage) -> None:
        import warnings

        self._warnings = warnings.catch_warnings(record=True)
        self._log = self._warnings.__enter__()
        warnings.simplefilter("always")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        self.lrs.append([[(g["lr"], g["betas"][0]) for g in o.param_groups] for o in opts])

    def teardown(self, trainer, pl_module, stage) -> None:
        import os

        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        torch.save({"lrs": self.lrs, "params": [p.detach().clone() for p in pl_module.parameters()],
                    "warnings": [str(w.message) for w in self._log],
                    "optimizers": [type(o).__name__ for o in opts],
                    "compressing": [getattr(o, "compressing", None) for o in opts],
                    "ratio": [o.comm_counter.last.ratio_vs_fp32 if hasattr(o, "comm_counter") else None for o in opts],
                    "global_step": trainer.global_step},
                   os.path.join(self.outdir, f"rank{trainer.global_rank}.pt"))

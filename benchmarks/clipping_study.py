"""Gradient clipping and 1-bit Adam's frozen variance: final loss against DDP + AdamW.

A small BatchNorm ResNet on the 8x8 digits (sklearn's copy), 2 processes, ``bf16-mixed``,
``accumulate_grad_batches=2``, ``gradient_clip_val=1.0``, CosineAnnealingLR over 60 optimizer
steps, warm-up 20: plain DDP + AdamW, ``onebit_adam`` clipping in both phases (the default), and
``onebit_adam`` with ``clip_when_compressing=False`` (clipping during warm-up only); also each
without clipping. Prints, per configuration and seed, the training-set and held-out loss of the
final model (eval mode) and the mean gradient norm Lightning clips: the averaged one in warm-up
(as DDP's), the local one in the compression phase.

Why: in the compression phase the strategies clip each rank's local gradient before compression
(its norm exceeds the averaged gradient's), and with the variance frozen since the switch a clip
that triggers shrinks every compressed step; DDP + AdamW is invariant to a constant scale.

    python benchmarks/clipping_study.py [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS, WARMUP, BATCH, TRAIN = 60, 20, 16, 1280


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def _digits(part: slice) -> TensorDataset:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(X / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)[part], torch.tensor(y)[part])


class ResNet(L.LightningModule):
    def __init__(self, seed: int, out: str) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.seed, self.out, self.norms = seed, out, []
        self.net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                                 Block(32), Block(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
        opt = getattr(optimizer, "_optimizer", optimizer)
        norm = torch.norm(torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))
        self.norms.append((bool(getattr(opt, "compressing", False)), float(norm)))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS), "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(_digits(slice(0, TRAIN)), batch_size=BATCH, shuffle=True)

    def on_train_end(self) -> None:
        if self.global_rank:
            return
        self.eval()
        with torch.no_grad():
            loss = {name: float(nn.functional.cross_entropy(self.net(ds.tensors[0]), ds.tensors[1]))
                    for name, ds in (("train", _digits(slice(0, TRAIN))), ("heldout", _digits(slice(TRAIN, None))))}
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        loss["norm_warmup"] = mean([n for c, n in self.norms if not c])
        loss["norm_compressing"] = mean([n for c, n in self.norms if c])
        with open(self.out, "w") as f:
            json.dump(loss, f)


def fit(config: str, seed: int, clip: float | None, out: str) -> None:
    from lightning_onebit import CompressedDDPStrategy
    from lightning_onebit.strategies.launch import BaseDDPStrategy

    L.seed_everything(seed, verbose=False)
    if config == "ddp":
        strategy = BaseDDPStrategy(start_method="forkserver")
    else:
        strategy = CompressedDDPStrategy("onebit_adam", warmup=WARMUP, start_method="forkserver",
                                         clip_when_compressing=config != "onebit_adam clip in warm-up only")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, max_epochs=-1,
                        precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ResNet(seed, out))


CONFIGS = ("ddp", "onebit_adam", "onebit_adam clip in warm-up only")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # config seed clip out: one fit, in a fresh process
    args = ap.parse_args()
    if args.one:
        config, seed, clip, out = args.one
        fit(config, int(seed), None if clip == "none" else float(clip), out)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for clip in ("1.0", "none"):
            for config in CONFIGS if clip != "none" else CONFIGS[:2]:
                for seed in args.seeds:
                    out = os.path.join(tmp, "out.json")
                    subprocess.run([sys.executable, __file__, "--one", config, str(seed), clip, out], check=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    with open(out) as f:
                        r = json.load(f)
                    rows.append((config, clip, seed, r))
                    print(f"{config:34s} clip={clip:4s} seed={seed}  train {r['train']:.4f}  heldout {r['heldout']:.4f}"
                          f"  |g| warm-up {r['norm_warmup']:.3f}  compressing {r['norm_compressing']:.3f}", flush=True)
    print("\n| configuration | gradient_clip_val | train loss (mean of seeds) | held-out loss "
          "| |g| before clipping, warm-up / compression |\n|---|---|---|---|---|")
    for clip in ("1.0", "none"):
        for config in CONFIGS:
            rs = [r for c, k, _, r in rows if c == config and k == clip]
            if not rs:
                continue
            m = {k: sum(r[k] for r in rs) / len(rs) for k in rs[0]}
            spread = max(r["train"] for r in rs) - min(r["train"] for r in rs)
            print(f"| {config} | {clip} | {m['train']:.3f} (spread {spread:.3f}) | {m['heldout']:.3f} | "
                  f"{m['norm_warmup']:.2f} / {m['norm_compressing']:.2f} |")


if __name__ == "__main__":
    main()

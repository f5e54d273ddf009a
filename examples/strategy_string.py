"""Way 1: a strategy name. ``import lightning_onebit`` registers it with Lightning.

    python examples/strategy_string.py --epochs 3
    torchrun --nproc-per-node=2 --max-restarts=3 examples/strategy_string.py --ckpt-dir ckpt  # restarts resume
"""

import argparse

import lightning as L
from _digits import DigitsClassifier
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_onebit  # registers "onebit_adam", "qadam", "cd_adam", ... with Lightning

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ckpt-dir", help="write last.ckpt there every epoch and resume from it if it exists: "
                    "run again (or under torchrun --max-restarts) and the fit goes on where it stopped")
    args = ap.parse_args()
    L.seed_everything(0)
    checkpoints = [ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)] if args.ckpt_dir else []
    # 15% of the steps are exact AdamW warm-up, then 1-bit compressed momentum.
    trainer = L.Trainer(strategy="onebit_adam", accelerator="cpu", devices=2, max_epochs=args.epochs,
                        callbacks=[lightning_onebit.CommunicationMonitor(),
                                   *checkpoints],
                        logger=False,
                        enable_checkpointing=bool(args.ckpt_dir))
    trainer.fit(DigitsClassifier(), ckpt_path="last" if args.ckpt_dir else None)
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(f"final loss {float(m['train_loss']):.3f}, bytes sent {int(m['comm/bytes_total'])}, "
              f"last step {float(m['comm/ratio_vs_fp32']):.1f}x fewer than fp32 DDP")

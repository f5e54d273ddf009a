"""Way 2: a strategy object with explicit settings.

    python examples/strategy_object.py --epochs 3
    torchrun --nproc-per-node=2 --max-restarts=3 examples/strategy_object.py --ckpt-dir ckpt  # restarts resume
"""

import argparse

import lightning as L
from _digits import DigitsClassifier
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_onebit import CommunicationMonitor, OnebitAdamStrategy, PhaseSwitch

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ckpt-dir", help="write last.ckpt there every epoch and resume from it if it exists: "
                    "run again (or under torchrun --max-restarts) and the fit goes on where it stopped")
    args = ap.parse_args()
    L.seed_everything(0)
    checkpoints = [ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True)] if args.ckpt_dir else []
    strategy = OnebitAdamStrategy(
        optimizer_kwargs={"eps_inside_sqrt": True, "block_size": None, "bucket_cap_mb": 25},
        process_group_backend="gloo",  # any DDPStrategy argument works: timeout, find_unused_parameters, ...
    )
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=bool(args.ckpt_dir),
                        callbacks=[PhaseSwitch("auto", min_steps=10), CommunicationMonitor(),
                                   *checkpoints])
    trainer.fit(DigitsClassifier(), ckpt_path="last" if args.ckpt_dir else None)
    m = trainer.callback_metrics
    print(f"final loss {float(m['train_loss']):.3f}, compressing: {bool(m['comm/compressing'])}")

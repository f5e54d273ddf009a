"""Way 2: a strategy object with explicit settings.

    python examples/strategy_object.py --epochs 3
"""

import argparse

import lightning as L
from _digits import DigitsClassifier

from lightning_onebit import CommunicationMonitor, OnebitAdamStrategy, PhaseSwitch

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    L.seed_everything(0)
    strategy = OnebitAdamStrategy(
        optimizer_kwargs={"eps_inside_sqrt": True, "block_size": None, "bucket_cap_mb": 25},
        process_group_backend="gloo",
        start_method="spawn",  # any DDPStrategy argument works: timeout, find_unused_parameters, ...
    )
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False,
                        callbacks=[PhaseSwitch("auto", min_steps=10), CommunicationMonitor()])
    trainer.fit(DigitsClassifier())
    m = trainer.callback_metrics
    print(f"final loss {float(m['train_loss']):.3f}, compressing: {bool(m['comm/compressing'])}")

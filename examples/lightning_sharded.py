"""Lightning, a sharded model: FSDP2 inside each node, the package's compressed mean between nodes.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:29500 examples/lightning_sharded.py   # 2 nodes
    torchrun --nproc-per-node 4 examples/lightning_sharded.py --ranks-per-node 2   # one host as 2 nodes of 2
    torchrun --max-restarts 1 ... examples/lightning_sharded.py --ckpt-dir ckpt    # resumes after a lost rank
    ... --algorithm onebit_adam                                                     # strategy="onebit_adam_fsdp"

``strategy="diloco_fsdp"`` shards every ``Block`` and the rest of the model with FSDP2 over the ranks of a node
(``auto_wrap_policy``) and converts the AdamW of ``configure_optimizers`` to a DiLoCo on the mesh: the ranks that
hold the same shard on every node average its pseudo-gradient, 4-bit, every ``sync_every`` steps. With
``--ckpt-dir`` a checkpoint directory is written after every epoch (every rank its shards, nothing gathered), and
a restarted job goes on from the newest complete one.
"""

import argparse
import os
from pathlib import Path

import lightning as L
import torch
from _digits import digits_dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_onebit import DiLoCoStrategy, OnebitAdamStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                                nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Classifier(L.LightningModule):
    def __init__(self, die_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 96), Block(96), Block(96), nn.LayerNorm(96), nn.Linear(96, 10))
        self.die_at = die_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.global_step == self.die_at and self.global_rank == 1 and first_attempt:
            os._exit(1)  # (testing) as a lost node would: no cleanup, its peers see the connection drop

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def newest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint directory (its ``meta.pt`` is written last), or None."""
    done = [p for p in Path(ckpt_dir).glob("*.ckpt") if (p / "meta.pt").is_file()] if ckpt_dir else []
    return str(max(done, key=lambda p: (p / "meta.pt").stat().st_mtime)) if done else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", choices=("diloco", "onebit_adam"), default="diloco")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks per node (default: the trainer's devices, torchrun's --nproc-per-node)")
    ap.add_argument("--ckpt-dir", help="a checkpoint directory here after every epoch; resume from the newest")
    ap.add_argument("--die-at", type=int, help="(testing) rank 1 of the first attempt dies after this step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layout = dict(sharding="fsdp", ranks_per_node=args.ranks_per_node, auto_wrap_policy={Block})
    strategy = (OnebitAdamStrategy(warmup=0.2, **layout) if args.algorithm == "onebit_adam" else
                DiLoCoStrategy(sync_every=4, compression="4bit", **layout))
    callbacks = [ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1, every_n_epochs=1)] if args.ckpt_dir else []
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy=strategy,
                        max_epochs=args.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks)
    model = Classifier(args.die_at)
    resume = newest_checkpoint(args.ckpt_dir)
    if resume and trainer.global_rank == 0:
        print(f"resuming from {Path(resume).name}")
    trainer.fit(model, DataLoader(digits_dataset(), batch_size=32), ckpt_path=resume)
    # every rank of a node gathers its node's model; after the fit's last outer step every node holds the same
    whole = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    opt = trainer.strategy.optimizers[0]
    if trainer.global_rank == 0:
        mine = sum(p.to_local().numel() for p in model.parameters())
        print(f"{trainer.strategy.mesh_shape[0]} nodes x {trainer.strategy.mesh_shape[1]} ranks; steps "
              f"{trainer.global_step}; state for {mine} of {whole.numel()} parameters on this rank; bytes sent by "
              f"rank 0 {opt.comm_counter.total.bytes_sent}; parameter sum {whole.double().sum().item()!r}")


if __name__ == "__main__":
    main()

"""One rank of a Lightning fit on N nodes x L ranks, started by torchrun (``tests/test_multinode.py``).

A small attention model (embedding, LayerNorm, self-attention, biases next to a wide layer) learns to
name the first token of a sequence. Every rank writes what it saw to ``<out>/rank<R>.pt``: its
parameters, its losses, the collective of each bucket, the bytes its optimizer counted, and the
warnings of the fit (a resume on another layout warns that the error state was reset).
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_onebit  # noqa: F401  (registers the strategy names)
from lightning_onebit import OnebitAdamStrategy

VOCAB, SEQ, WIDTH = 40, 6, 32


class FirstToken(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.head = nn.Sequential(nn.Linear(WIDTH * SEQ, 256), nn.ReLU(), nn.Linear(256, VOCAB))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (1024, SEQ), generator=g)
    return DataLoader(TensorDataset(x, x[:, 0].clone()), batch_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hierarchical", choices=("auto", "true", "false"), default="auto")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hier = {"auto": None, "true": True, "false": False}[args.hierarchical]
    model = FirstToken()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=args.nodes,
                        strategy=OnebitAdamStrategy(warmup=args.warmup, hierarchical=hier), max_steps=args.steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=args.out, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader(), ckpt_path=args.resume)
    if args.resume is None:
        trainer.save_checkpoint(os.path.join(args.out, "last.ckpt"))  # collective: every rank calls it
    opt = trainer.strategy.optimizers[0]
    torch.save({
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "losses": model.losses,
        "kinds": sorted({type(b.sync.comm).__name__ for b in opt._buckets}),
        "compressing": opt.compressing,
        "inter_bytes": opt.comm_counter.total.bytes_sent,
        "intra_bytes": opt.intra_node_counter.total.bytes_sent,
        "warnings": [str(w.message) for w in caught],
        "world": trainer.world_size,
        "node_rank": trainer.node_rank,
    }, os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()

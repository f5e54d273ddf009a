"""Sharded DiLoCo's quality on lm_markov: ``strategy="diloco_fsdp"`` against unsharded DiLoCo, in one run.

    python benchmarks/sharded_quality.py                       # 4-bit, H = 16, 3 seeds
    python benchmarks/sharded_quality.py --compression fp32 --seeds 0 --out q.md

The experiment ``lm_markov``'s data and model (``recipes/lm.py``: a 0.1M-parameter transformer with
embeddings, pre-norm attention blocks, LayerNorm; next-token loss on a random Markov chain of 64 tokens) and
its settings (AdamW lr 3e-3, weight decay 0.01, 16 sequences per rank, 2 epochs), DiLoCo with ``sync_every``
16 and the chosen compression, Lightning on this host under ``torchrun`` (gloo), in three layouts:

* ``sharded 2x2``: 4 ranks as 2 nodes of 2 (``ranks_per_node=2``), FSDP2 over each node's ranks
  (``auto_wrap_policy`` the encoder layers), the outer all-reduce between the two nodes: 2 replicas, each on
  its node's 32 sequences a step;
* ``unsharded, a replica per node``: 2 ranks, each a whole replica on 32 sequences a step: the same
  algorithm, the model whole on each rank;
* ``unsharded, a replica per rank``: 4 ranks of 16 sequences, two-level outer all-reduce (the same devices).

Each reports the validation loss of the final model (the anchor every rank ends on), over the whole
validation set; the verdict compares the sharded layout with the unsharded replica per node (the target:
within 1%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

from _common import add_out_argument, header, repo_on_path, write_out

repo_on_path()

MARK = "SHARDED_QUALITY "


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch import nn

    from lightning_onebit import DiLoCoStrategy
    from recipes.lm import MarkovTextDataModule, TinyLM, lm_loss

    torch.set_num_threads(1)

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(args.seed)
            self.net = TinyLM(vocab=64, d_model=64, heads=4, layers=2, ff=256, context=32)

        def training_step(self, batch, batch_idx):
            return lm_loss(self.net, batch[0])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", lm_loss(self.net, batch[0]), on_epoch=True, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    world = int(os.environ["WORLD_SIZE"])
    per_rank = 32 if args.layout == "replica-per-node" else 16
    kw = dict(sync_every=16, compression=args.compression)
    strategy = (DiLoCoStrategy(**kw, sharding="fsdp", ranks_per_node=2, auto_wrap_policy={nn.TransformerEncoderLayer})
                if args.layout == "sharded" else DiLoCoStrategy(**kw))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0)
    data = MarkovTextDataModule(vocab=64, branching=3, source_seed=0, length=33, train_size=4800, val_size=512,
                                batch_size=per_rank, seed=args.seed)
    model = LM()
    trainer.fit(model, datamodule=data)
    (res,) = trainer.validate(model, datamodule=data, verbose=False)  # the final model: the anchor on every rank
    if trainer.global_rank == 0:
        print(MARK + json.dumps({"val_loss": res["val_loss"], "steps": trainer.global_step,
                                 "entropy_rate": data.source.entropy_rate()}), flush=True)


def _run(layout: str, seed: int, compression: str, port: int, timeout: float) -> dict:
    nproc = 2 if layout == "replica-per-node" else 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           __file__, "--worker", "--layout", layout, "--seed", str(seed), "--compression", compression]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{layout}, seed {seed}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(line[len(MARK):])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compression", default="4bit")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=("sharded", "replica-per-node", "replica-per-rank"), help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    layouts = ("sharded", "replica-per-node", "replica-per-rank")
    results: dict[str, list[dict]] = {k: [] for k in layouts}
    port = 29811
    for seed in seeds:  # the layouts of a seed one after another, on the same machine state
        for layout in layouts:
            port += 1
            results[layout].append(_run(layout, seed, args.compression, port, args.timeout))
            print(f"{layout} seed {seed}: {results[layout][-1]}", file=sys.stderr)
    names = {"sharded": "sharded 2x2 (FSDP2 in the node)",
             "replica-per-node": "unsharded, a replica per node (2 ranks)",
             "replica-per-rank": "unsharded, a replica per rank (4 ranks, two-level)"}
    rate = results["sharded"][0]["entropy_rate"]
    lines = [f"lm_markov, DiLoCo compression={args.compression}, sync_every=16, 2 epochs, seeds {seeds}; the "
             f"source's entropy rate {rate:.4f} nats", "",
             "| layout | val loss per seed | mean | steps |", "|---|---|---|---|"]
    for layout in layouts:
        vals = [r["val_loss"] for r in results[layout]]
        lines.append(f"| {names[layout]} | {', '.join(f'{v:.4f}' for v in vals)} | {statistics.mean(vals):.4f} "
                     f"| {results[layout][0]['steps']} |")
    ratios = [s["val_loss"] / u["val_loss"] for s, u in zip(results["sharded"], results["replica-per-node"],
                                                              strict=True)]
    worst = max(abs(r - 1) for r in ratios)
    per_seed = ", ".join(f"{r:.4f}" for r in ratios)
    lines += ["", f"- sharded / unsharded (a replica per node) val loss per seed: {per_seed} (target within 1%: "
              f"{'met' if worst <= 0.01 else 'MISSED'})"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_out(args.out, header("sharded_quality.py", argv) + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

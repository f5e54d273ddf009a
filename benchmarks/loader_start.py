"""What starting the CIFAR-10 recipe's DataLoader workers costs, per start method.

The recipes start a rank's workers from a fork server (``data.worker_start_method``, see
``recipes.common.loader_workers``) rather than forking the rank, whose gloo/NCCL and OpenMP
threads make a fork able to hang. The price: the rank starts its server once (it imports the
dataset's modules), and every epoch's workers receive the dataset again (the recipe's loaders do
not keep workers across epochs, so that a resumed run draws the same augmentations; the images go
as a shared-memory handle, ``recipes.vision.SharedImages``). This
measures it on full-size data in the real format (50000 + 10000 random images, written as the
python batches torchvision reads; nothing is downloaded): for each method, in a fresh process
(so a server start is counted), the wait from ``iter(loader)`` to the first batch and the time of
each epoch.

Run: ``python benchmarks/loader_start.py [--methods fork forkserver spawn] [--workers 4]
[--epochs 3] [--batches N] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import ROOT, add_out_argument, emit_tagged, header, parse_tagged, repo_on_path, tee_stdout

TAG = "LOADER "
PER_BATCH = 10000  # images per batch file, as in the archive
TRAIN = 5 * PER_BATCH


def write_cifar10(root: Path, seed: int = 0) -> None:
    """``<root>/cifar-10-batches-py``: five training batches of 10000 images and a test batch,
    random pixels, in the published archive's layout (what ``recipes.vision`` reads)."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        labels = rng.integers(0, 10, PER_BATCH)
        # str keys: what torchvision's reader (latin1) makes of the archive's Python 2 pickles
        d = {"batch_label": name, "labels": [int(y) for y in labels],
             "data": rng.integers(0, 256, (PER_BATCH, 3072), dtype=np.uint8),
             "filenames": [f"{i}.png" for i in range(PER_BATCH)]}
        with open(base / name, "wb") as f:
            pickle.dump(d, f, protocol=2)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": PER_BATCH,
                     "num_vis": 3072},
                    f, protocol=2)


def child(root: str, method: str, workers: int, epochs: int, batches: int | None, batch_size: int) -> None:
    repo_on_path()
    from recipes.vision import CIFAR10DataModule

    dm = CIFAR10DataModule(root=root, verify=False, num_workers=workers, batch_size=batch_size,
                           worker_start_method=method)
    dm.setup("fit")
    for epoch in range(epochs):
        loader = dm.train_dataloader()  # a fresh loader per epoch, as Lightning's loop makes iterators
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        first = time.perf_counter() - t0
        n = 1
        for _ in it:
            n += 1
            if batches is not None and n >= batches:
                break
        del it  # shuts the workers down inside the epoch's time
        emit_tagged(TAG, {"method": method, "epoch": epoch, "first": first, "epoch_s": time.perf_counter() - t0,
                          "batches": n})


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["fork", "forkserver", "spawn"],
                    choices=["fork", "forkserver", "spawn"])
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers (the recipes' default: 4)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batches", type=int, default=None, help="stop an epoch after N batches (default: all)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--root", help="a directory with cifar-10-batches-py/ (default: generated in a temp dir)")
    ap.add_argument("--child", nargs=1, metavar="METHOD", help=argparse.SUPPRESS)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.child:
        child(args.root, args.child[0], args.workers, args.epochs, args.batches, args.batch_size)
        return
    with tempfile.TemporaryDirectory() as tmp, tee_stdout(args.out, header("loader_start.py", argv)):
        root = args.root
        if root is None:
            root = tmp
            write_cifar10(Path(tmp))
        rows = []
        for method in args.methods:
            cmd = [sys.executable, __file__, "--child", method, "--root", root, "--workers", str(args.workers),
                   "--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
            if args.batches is not None:
                cmd += ["--batches", str(args.batches)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{method}: exit {out.returncode}\n{out.stderr[-3000:]}")
            rows.append(parse_tagged(out.stdout, TAG))
        print(f"CIFAR-10 recipe loader, {TRAIN} training images, {args.workers} workers, batch {args.batch_size}, "
              f"{args.epochs} epochs{'' if args.batches is None else f' of {args.batches} batches'}; "
              "each method in a fresh process\n")
        print("| start method | first batch, epoch 1 | first batch, later epochs (median) | "
              "epoch (median of later) | batches per epoch |")
        print("|---|---|---|---|---|")
        for r in rows:
            later = r[1:] or r
            first, epoch = (statistics.median(x[k] for x in later) for k in ("first", "epoch_s"))
            print(f"| {r[0]['method']} | {r[0]['first']:.2f} s | {first:.2f} s | {epoch:.2f} s | {r[0]['batches']} |")


if __name__ == "__main__":
    main()

"""What per-tensor scales cost on the wire: bytes per compressed step of real model shapes.

Every parameter tensor of a bucket gets its own scale in each rank's chunk (both stages), and every
row carries as many scales as the busiest chunk needs. This prints, for each model and world size,
the bytes one rank sends per compressed step (1-bit, 25 MB buckets, the optimizer's own bucketing)
with per-tensor scales and with one scale per chunk (a rank's chunk of a bucket shares one scale
across all its tensors), and the difference. Nothing is trained: the numbers follow from the shapes
(``bytes_per_call``).

    python benchmarks/scale_overhead.py [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Callable, Sequence

import torch
from _common import add_out_argument, header, repo_on_path, tee_stdout
from torch import nn

from lightning_onebit import OnebitAdam
from lightning_onebit.comm import TwoStageRank, ring_allreduce_bytes
from lightning_onebit.compress import SignCodec


def _e2e_mlp() -> nn.Module:  # benchmarks/e2e.py's communication-bound workload
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                         nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 10))


def _transformer(d: int, layers: int, ff: int, vocab: int) -> nn.Module:
    block = nn.TransformerEncoderLayer(d, 8 if d % 8 == 0 else 4, ff, batch_first=True, norm_first=True)
    return nn.ModuleList([nn.Embedding(vocab, d), nn.TransformerEncoder(block, layers, enable_nested_tensor=False),
                          nn.LayerNorm(d), nn.Linear(d, vocab)])


def _resnet18() -> nn.Module:
    repo_on_path()
    from recipes.vision import resnet18_cifar

    return resnet18_cifar()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "e2e mlp (25.2M)": _e2e_mlp,
    "e2e transformer (3.7M)": lambda: _transformer(256, 4, 1024, 1000),
    "BERT-base shapes (12 x 768, vocab 30522)": lambda: _transformer(768, 12, 3072, 30522),
    "ResNet-18 CIFAR (11.2M)": _resnet18,
}


def step_bytes(model: nn.Module, world: int, per_tensor: bool) -> tuple[int, int, int, int]:
    """(bytes per compressed step, fp32 ring bytes, buckets, tensors) for one rank."""
    opt = OnebitAdam(model.parameters(), simulate_workers=world)
    total = fp32 = tensors = 0
    buckets = opt._build_buckets()
    for b in buckets:
        car = TwoStageRank(SignCodec(), "error_feedback", 0, world, groups=b.offsets if per_tensor else None)
        total += car.bytes_per_call(b.numel)
        fp32 += ring_allreduce_bytes(b.numel, world)
        tensors += len(b.params)
    return total, fp32, len(buckets), tensors


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worlds", default="2,8,64")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    with tee_stdout(args.out, header("scale_overhead.py", argv)):
        run(args)


def run(args: argparse.Namespace) -> None:
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"# per-tensor scale overhead, {datetime.date.today()}, {platform.node()}, torch {torch.__version__}")
    print("| model | tensors | buckets | ranks | one scale per chunk B/step | per-tensor scales B/step | "
          "extra | fp32 / per-tensor |")
    print("|---|---|---|---|---|---|---|---|")
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        for world in worlds:
            old, _, _, _ = step_bytes(model, world, per_tensor=False)
            new, fp32, nb, nt = step_bytes(model, world, per_tensor=True)
            print(f"| {name} | {nt} | {nb} | {world} | {old:,} | {new:,} | +{new - old:,} "
                  f"({100 * (new - old) / old:.2f}%) | {fp32 / new:.1f}x |", flush=True)


if __name__ == "__main__":
    main()

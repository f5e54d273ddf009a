"""Which SignCodec block size should OnebitAdam default to, and where should eps go?

Two measurements, single process (world size 1: both compression stages still run), for block sizes
None (the default: no blocks) and 4096 .. 64, with eps inside and outside the square root:
1. the Tarasov-Ershov quadratic sum_k a_k x_k^2, a_k = logspace(-10, 0, d): loss after the
   switch relative to the loss at the switch (jump) and at the end;
2. an MLP on scikit-learn's digits: final training loss after warm-up + compression.
Prints a markdown table. ``python benchmarks/block_size_study.py [--out PATH]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from _common import add_out_argument, header, tee_stdout
from sklearn.datasets import load_digits
from torch import nn

from lightning_onebit import OnebitAdam
from lightning_onebit.optim import NonFiniteGradientError


def quadratic(block_size, eps_inside_sqrt, d=4096, warmup=100, steps=300):
    a = torch.logspace(-10, 0, d)
    x = torch.ones(d, requires_grad=True)
    opt = OnebitAdam([x], lr=1e-2, warmup_steps=warmup, eps_inside_sqrt=eps_inside_sqrt, block_size=block_size)
    hist = []
    for _ in range(warmup + steps):
        opt.zero_grad()
        loss = (a * x * x).sum()
        loss.backward()
        try:
            opt.step()
        except NonFiniteGradientError:  # diverged to inf
            return float("inf"), float("inf")
        hist.append(loss.item())
    return max(hist[warmup:]) / hist[warmup - 1], hist[-1]


def digits(block_size, eps_inside_sqrt, epochs=15):
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X / 16.0, dtype=torch.float32), torch.tensor(y)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = OnebitAdam(net.parameters(), lr=3e-3, warmup_steps=100, eps_inside_sqrt=eps_inside_sqrt,
                     block_size=block_size)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=g)
        for i in range(0, len(X), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(X[idx]), y[idx])
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError:
                return float("inf")
    with torch.no_grad():
        return nn.functional.cross_entropy(net(X), y).item()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_argument(ap)
    args = ap.parse_args(argv)
    with tee_stdout(args.out, header("block_size_study.py", argv)):
        study()


def study() -> None:
    print("| block_size | eps_inside_sqrt | quadratic: max loss after switch / at switch | quadratic: final loss "
          "| digits MLP: final train loss |")
    print("|---|---|---|---|---|")
    for eps_inside in (True, False):
        for bs in (None, 4096, 1024, 256, 64):
            jump, end = quadratic(bs, eps_inside)
            print(f"| {bs} | {eps_inside} | {jump:.3g} | {end:.3g} | {digits(bs, eps_inside):.4f} |", flush=True)


if __name__ == "__main__":
    main()

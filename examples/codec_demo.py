"""Offline demo of the codecs: 1-bit sign compression with error feedback.

Compresses a stream of gradient-like vectors three ways and shows what the package is
built on: the wire shrinks ~32x (1-bit) or ~4x (8-bit), and with error feedback the sum
of what was sent tracks the sum of the true vectors with a gap that does not grow.
Runs on a CPU: ``python examples/codec_demo.py`` (``--numel``, ``--steps`` to change the size).
"""

from __future__ import annotations

import argparse

import torch

from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    # a persistent direction plus noise, with coordinates of very different magnitudes
    direction = torch.randn(args.numel, generator=g) * torch.logspace(-3, 0, args.numel)
    sign, u8 = SignCodec("l2"), MinMaxUInt8Codec(block_size=4096)
    err = torch.zeros(args.numel)
    true_sum = torch.zeros(args.numel)
    sent_ef, sent_naive, sent_u8 = (torch.zeros(args.numel) for _ in range(3))
    print(f"{'step':>5} {'gap with EF':>12} {'gap no EF':>12} {'gap 8-bit':>12}")
    for step in range(1, args.steps + 1):
        x = direction + 0.5 * torch.randn(args.numel, generator=g) * direction.abs()
        true_sum += x
        enc = sign.encode_error_feedback(x, err)
        sent_ef += sign.decode(enc)
        sent_naive += sign.decode(sign.encode(x))
        sent_u8 += u8.decode(u8.encode(x))
        if step in (1, 10, 50, 100, 200) or step == args.steps:
            ref = true_sum.norm().item()
            gaps = [(s - true_sum).norm().item() / ref for s in (sent_ef, sent_naive, sent_u8)]
            print(f"{step:>5} {gaps[0]:>12.4f} {gaps[1]:>12.4f} {gaps[2]:>12.4f}")
    fp32 = 4 * args.numel
    print(f"bytes per vector: fp32 {fp32}, 1-bit {enc.nbytes} ({fp32 / enc.nbytes:.1f}x smaller), "
          f"8-bit {u8.encoded_nbytes(args.numel)} ({fp32 / u8.encoded_nbytes(args.numel):.1f}x smaller)")


if __name__ == "__main__":
    main()

"""Coordinates without gradient on an embedding model: what each algorithm does to embedding rows of
tokens that appear only after the switch, and to rows of tokens that never appear.

A small transformer LM (recipes.lm.TinyLM, vocabulary 64) is trained on 2 simulated workers
(bit-identical to 2 ranks) on text from a Markov source over tokens 0..47 for the first half of the
run; in the second half tokens 48..55 appear too (every 4th position is one of them), so they
were never seen during the warm-up. Tokens 56..63 never appear. Reported per algorithm:

* late rows moved: mean |change| of the late tokens' embedding rows over the second half;
* loss: next-token loss on held-out text of the second half;
* unused-row drift: max |change| of the never-used rows over the whole run (AdamW: 0 without
  weight decay, which is off here).

``OnebitAdam (masked forever)`` switches off the agreement that lets a coordinate masked at the
switch (zero variance) start to train when a gradient reaches it, for comparison.

    python benchmarks/embedding_study.py [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Sequence

import torch
from _common import add_out_argument, header, repo_on_path, tee_stdout

repo_on_path()
from lightning_onebit import CDAdam, OnebitAdam  # noqa: E402
from recipes.lm import MarkovSource, TinyLM  # noqa: E402

VOCAB, LATE, UNUSED = 64, range(48, 56), range(56, 64)


def _text(source: MarkovSource, n: int, late: bool, g: torch.Generator) -> torch.Tensor:
    seqs = source.sample(n, 33, g)
    if late:  # every 4th position: a late token, drawn uniformly
        seqs[:, 3::4] = LATE.start + torch.randint(0, len(LATE), seqs[:, 3::4].shape, generator=g)
    return seqs


def _loss(net: TinyLM, seqs: torch.Tensor) -> float:
    with torch.no_grad():
        logits = net(seqs[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1)))


def run(name: str, make, steps: int, warmup: int) -> dict[str, float]:
    source = MarkovSource(48, 3, seed=0)
    torch.manual_seed(0)
    net = TinyLM(vocab=VOCAB)
    params = list(net.parameters())
    opt = make(net)
    g = torch.Generator().manual_seed(1)
    start = net.tok.weight.detach().clone()
    half = None
    for step in range(steps):
        late = step >= steps // 2
        if late and half is None:
            half = net.tok.weight.detach().clone()
        grads = []
        for _ in range(2):
            seqs = _text(source, 16, late, g)
            net.zero_grad()
            logits = net(seqs[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1)).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in params])
        if isinstance(opt, torch.optim.AdamW):
            for p, g0, g1 in zip(params, *grads, strict=True):
                p.grad = g0 / 2 + g1 / 2
            opt.step()
        else:
            opt.step_workers(grads)
    w = net.tok.weight.detach()
    return {"late rows moved": float((w[LATE.start:LATE.stop] - half[LATE.start:LATE.stop]).abs().mean()),
            "loss": _loss(net, _text(source, 256, True, torch.Generator().manual_seed(9))),
            "unused-row drift": float((w[UNUSED.start:] - start[UNUSED.start:]).abs().max())}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=60)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    with tee_stdout(args.out, header("embedding_study.py", argv)):
        study(args)


def study(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    w, lr = args.warmup, 3e-3

    def masked_forever(net):
        opt = OnebitAdam(net.parameters(), lr=lr, warmup_steps=w, simulate_workers=2)
        opt._flag = lambda b, grad: None  # no agreement bit: masked coordinates never start to train
        return opt

    def row_blocks(net):
        emb = [net.tok.weight]
        rest = [p for p in net.parameters() if p is not net.tok.weight]
        return CDAdam([{"params": emb, "block_size": net.tok.embedding_dim}, {"params": rest}], lr=lr,
                      simulate_workers=2)

    makers = {
        "AdamW (uncompressed)": lambda net: torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0),
        "OnebitAdam": lambda net: OnebitAdam(net.parameters(), lr=lr, warmup_steps=w, simulate_workers=2),
        "OnebitAdam (masked forever)": masked_forever,
        "CDAdam, block_size=None": lambda net: CDAdam(net.parameters(), lr=lr, simulate_workers=2),
        "CDAdam, embedding block_size=64 (its rows)": row_blocks,
    }
    print(f"# embedding study, {datetime.date.today()}, {platform.node()}, torch {torch.__version__}, "
          f"{args.steps} steps, warm-up {w}, 2 simulated workers")
    print("| algorithm | late rows moved | loss | unused-row drift |")
    print("|---|---|---|---|")
    for name, make in makers.items():
        r = run(name, make, args.steps, w)
        print(f"| {name} | {r['late rows moved']:.4f} | {r['loss']:.3f} | {r['unused-row drift']:.2e} |", flush=True)


if __name__ == "__main__":
    main()

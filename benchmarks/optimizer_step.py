"""The optimizer step alone against ``torch.optim.AdamW(fused=True)``: what a rank's local work costs.

One process, gradients fixed in advance (no forward or backward), a 3-layer MLP of ``--params``
(17M: 1024-4096-2048-2048; 100M: 2.5x wider). For each optimizer, the median time of a step of each
kind over ``--steps`` steps, with 1 and 2 threads (torch's and the numba kernels' thread count):

* ``AdamW(fused=True)`` (the reference), ``AdamW`` (torch's default, foreach);
* ``OnebitAdam`` (also with ``fused=True``: the warm-up on torch's fused AdamW kernel) / ``QAdam`` /
  ``OnebitLamb``: a warm-up step and a compression-phase step, at world
  size 1 (the same encode / error feedback / server / decode work a rank does, without the network)
  and with ``simulate_workers=2`` (``step_workers``: both workers' encoding in one process);
* ``ZeroOneAdam`` after the variance freeze: local steps and synchronising steps.

``--embedding`` adds a BERT word embedding (30522 x 384, all-MiniLM-L6-v2's) whose gradient reaches
rows 0..3999 during the warm-up and, in each step after it, those and 32 rows never seen before (a
fine-tune's batches keep bringing new tokens): the rest of its 11.7M coordinates have zero variance at
the switch, so 1-bit Adam, QAdam and 1-bit LAMB mask them, check them every step and start the new rows.

``ratio`` is the step time over ``AdamW(fused=True)``'s with the same threads, measured in this run.
``--profile NAME`` prints where that optimizer's compression-phase step spends its time instead
(cProfile, by function, own time).

    python benchmarks/optimizer_step.py [--params 17M 100M] [--threads 1 2] [--steps 20] [--embedding]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

import lightning_onebit as lo
from lightning_onebit.compress.kernels import set_thread_budget

SIZES = {"17M": (1024, 4096, 2048, 2048), "100M": (2560, 10240, 5120, 5120)}


def mlp(size: str) -> list[nn.Parameter]:
    a, b, c, d = SIZES[size]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d))
    return list(net.parameters())


def _grads(params: list[nn.Parameter], workers: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=g) * 1e-3 for p in params] for _ in range(workers)]
    # no exact zeros (randn gives a couple in 17M): a zero variance at the switch adds masking passes
    return [[t.masked_fill_(t == 0, 1e-6) for t in w] for w in grads]


VOCAB, WIDTH, SEEN, NEW_ROWS = 30522, 384, 4000, 32  # see --embedding


def _with_embedding(params: list[nn.Parameter], grads: list[list[torch.Tensor]]) -> Callable[[int], None]:
    """Adds the embedding to ``params`` and its gradient to each worker's; returns ``new_rows(k)``,
    which puts a gradient on the k-th compression step's unseen rows (every worker's, in place)."""
    torch.manual_seed(0)
    params.append(nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02))
    g = torch.Generator().manual_seed(2)
    for w in grads:
        w.append(torch.zeros(VOCAB, WIDTH))
        w[-1][:SEEN] = torch.randn(SEEN, WIDTH, generator=g) * 1e-3

    def new_rows(k: int) -> None:
        lo = SEEN + NEW_ROWS * k
        for w in grads:
            w[-1][lo : lo + NEW_ROWS] = torch.randn(NEW_ROWS, WIDTH, generator=g) * 1e-3

    return new_rows


def _timed(step: Callable[[], None], kind: Callable[[], str], steps: int) -> dict[str, float]:
    """Median ms per kind of step, the first of each kind left out (buckets, caches, first touch)."""
    seen: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        k = kind()
        t = time.perf_counter()
        step()
        seen[k].append(1e3 * (time.perf_counter() - t))
    return {k: statistics.median(v[1:] or v) for k, v in seen.items()}


def _setup(name: str, size: str, workers: int, warmup: int,
           embedding: bool = False) -> tuple[Callable[[], None], Callable[[], str]]:
    """An optimizer over a fresh MLP with fixed gradients, after the steps that must come first:
    ``(step, kind)``, ``kind()`` naming the kind of the coming step. ``warmup``: warm-up steps of the
    warm-up algorithms; ``embedding``: see ``--embedding``."""
    params = mlp(size)
    grads = _grads(params, workers)
    new_rows = _with_embedding(params, grads) if embedding else None
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    if name.startswith("AdamW"):
        adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=name == "AdamW(fused=True)")
        adamw.step()
        return adamw.step, lambda: "step"
    sim = {"simulate_workers": workers} if workers > 1 else {}
    if name == "ZeroOneAdam":
        opt = lo.ZeroOneAdam(params, lr=1e-3, weight_decay=0.01, var_freeze_step=2, var_update_scaler=1,
                             local_step_scaler=1, local_step_clipper=4, **sim)

        def kind() -> str:
            return opt.schedule().kind(opt.optimizer_steps + 1)
    else:
        fused = {"fused": True} if name.endswith("(fused=True)") else {}
        cls = getattr(lo, name.removesuffix("(fused=True)"))
        opt = cls(params, lr=1e-3, weight_decay=0.01, warmup_steps=warmup, **sim, **fused)

        def kind() -> str:
            return "compression" if opt.optimizer_steps >= warmup else "warm-up"

    plain = (lambda: opt.step_workers(grads)) if workers > 1 else opt.step
    if name == "ZeroOneAdam":
        for _ in range(2):  # the variance refreshes before the freeze
            plain()
    if new_rows is None:
        return plain, kind
    after = [0]  # steps after the warm-up so far

    def step() -> None:
        if kind() != "warm-up":
            new_rows(after[0])
            after[0] += 1
        plain()

    return step, kind


def run(name: str, size: str, workers: int, steps: int, embedding: bool = False) -> dict[str, float]:
    step, kind = _setup(name, size, workers, warmup=steps // 3, embedding=embedding)
    return _timed(step, kind, steps)


OPTIMIZERS = ("AdamW(fused=True)", "AdamW", "OnebitAdam", "OnebitAdam(fused=True)", "QAdam", "OnebitLamb",
              "ZeroOneAdam")


def profile(name: str, size: str, embedding: bool = False) -> None:
    """Own time by function over 10 steps after the warm-up (ZeroOneAdam: local and sync steps)."""
    step, _ = _setup(name, size, 1, warmup=1, embedding=embedding)
    for _ in range(3):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", nargs="+", default=["17M", "100M"], choices=list(SIZES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    ap.add_argument("--profile", choices=[o for o in OPTIMIZERS if not o.endswith(")")])
    ap.add_argument("--embedding", action="store_true", help="add a BERT word embedding with unseen rows")
    args = ap.parse_args()
    if args.profile:
        torch.set_num_threads(args.threads[0])
        set_thread_budget(args.threads[0])
        profile(args.profile, args.params[0], args.embedding)
        return
    print("| params | threads | optimizer | workers | step | ms (median) | ratio to AdamW(fused=True) |")
    print("|---|---|---|---|---|---|---|")
    for size in args.params:
        for threads in args.threads:
            torch.set_num_threads(threads)
            set_thread_budget(threads)
            ref = None
            for name in args.optimizers:
                for workers in ((1,) if name.startswith("AdamW") else (1, 2)):
                    for kind, ms in sorted(run(name, size, workers, args.steps, args.embedding).items()):
                        ref = ms if name == "AdamW(fused=True)" else ref
                        ratio = f"{ms / ref:.2f}" if ref else "-"
                        print(f"| {size} | {threads} | {name} | {workers} | {kind} | {ms:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()

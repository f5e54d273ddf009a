"""End-to-end training speed on emulated slow links: DDP, PyTorch comm hooks and the compressed strategies.

Every emulated node is a network namespace behind a ``tc tbf``-shaped veth (``benchmarks/netns_cluster.py``;
``docs/design/cluster.md``, "Emulated cluster benchmarks"); one ``torchrun`` per namespace runs a Lightning
``Trainer(accelerator="cpu", devices=L, num_nodes=N)`` (torchrun's environment makes Lightning pick
``TorchElasticEnvironment``); with ``--ranks-per-node L`` > 1 the L ranks of a node reach each other over
its loopback (unshaped) and the other nodes over the shaped link, and the ``*_hier`` methods run the
two-level collective (``hierarchical=True``) next to the flat one (the plain names, ``hierarchical=False``).
For each (nodes, rate, workload) *one* torchrun measures every method in turn,
each with a fresh model (same seed, same data), so the methods share the machine's conditions.

Methods (``methods.E2E_METHODS``: each a recipes algorithm entry plus overrides, built by
``recipes/algorithms.py`` as ``recipes/train.py`` builds it): DDP + AdamW (fp32 allreduce), DDP + fp16 / bf16
compress hooks, DDP + PowerSGD (rank 1 and 4), and the strategies ``onebit_adam``, ``onebit_lamb``, ``qadam``,
``cd_adam`` (``CompressedDDPStrategy`` with ``warmup=W``) and ``zero_one_adam`` (0/1 Adam with
``var_freeze_step=W``, kappa 2, and the local interval doubling every step up to H = 4: its phase 2 is the
steady state of 3 local steps and 1 synchronisation; its phase-2 time is the *mean* over whole intervals, not
the median, which would be a local step's). Every method has AdamW's hyperparameters (``--lr``, weight decay
0.01) and torch's fused kernel wherever its optimizer has one, what a user's ``AdamW(fused=True)`` gives: DDP +
AdamW and the hooks step with ``AdamW(fused=True)``, ``onebit_adam`` and ``qadam`` warm up with it. The
LightningModule's ``configure_optimizers`` returns the method's optimizer built with all its settings, which
the strategy keeps. PowerSGD gets ``start_powerSGD_iter=W`` so that it has the same warm-up.
Hooks are registered on CPU by a small ``DDPStrategy`` subclass (Lightning does so only on CUDA); the bf16 hook
is registered under another name (DDP refuses the name without NCCL) and PowerSGD with one bucket in flight at
a time (it deadlocks gloo's two worker threads otherwise). That strategy (``hook_strategy``) is the one the
recipes' ``ddp_fp16``/``ddp_bf16``/``powersgd_r*`` algorithms use: the same entries.

Measured per method: wall time of every training step (a callback; the interval between consecutive
``on_train_batch_end`` calls, so data fetch and Lightning's loop are included), the slowest rank per step,
median over phase 1 (steps ``skip .. switch-1``: the fp32 warm-up of the warm-up algorithms) and phase 2
(steps ``switch+skip .. end``: the compression phase); ``switch`` is the step the optimizer actually started
compressing (``W`` for the others; ``cd_adam`` compresses from step 0, and the hooks have one regime, so for
them both phases measure the same thing). Bytes on the link: each node's veth tx counter (frames incl.
TCP/IP headers, read from sysfs inside the node's namespace) diffed over the same windows, per step and node (the
ranks of a node share its link; with one rank per node that is per rank).

The ideal for a setting: the compute time of one worker alone + the fp32 communication time / 32.
Compute alone = the same model and batch under ``Trainer(devices=1)`` with ``AdamW(fused=True)`` and no DDP,
measured with N such processes running at the same time (the emulated nodes share the machine's cores, so that is
the compute a worker gets in the cluster run too). fp32 communication time = a measured gloo ``all_reduce`` of all
the model's parameters as one fp32 tensor, on the same link.

The targets it checks (``target_check``), on the communication-bound MLP, 2 nodes, 1 Gbit/s, compression
phase of ``onebit_adam``: at least 2.5x faster than DDP + fused AdamW (5x was the target against the default
foreach AdamW, whose own step DDP pays), within 1.3x of the ideal, faster than each PyTorch hook.

Usage (as root)::

    python benchmarks/e2e.py --quick                          # 2 nodes, 1gbit, the MLP only
    python benchmarks/e2e.py --out e2e.md --chart e2e.png     # full grid: tables to e2e.md, bar chart
    python benchmarks/e2e.py --quick --methods ddp_adamw onebit_adam --profile onebit_adam
    python benchmarks/e2e.py --quick --ranks-per-node 2 --methods ddp_adamw onebit_adam onebit_adam_hier
    python benchmarks/e2e.py --quick --nodes 4 --rates 100mbit --rtt 50 --workloads transformer \
        --methods onebit_adam qadam zero_one_adam           # what a step waits for on a long link

The same file is the worker (``--worker`` under torchrun, ``--local`` for the compute-alone runs). The parts:
``methods.py`` (the method table), ``workloads.py`` (models and data), ``e2e_runs.py`` (the runs, per rank and
on the cluster), ``e2e_report.py`` (tables, targets, chart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _common import add_out_argument, header, load_text, require_root, write_out
from e2e_report import chart, setup_text, tables
from e2e_runs import local_worker, run_grid, worker
from methods import E2E_METHODS  # puts this checkout on the path: its lightning_onebit and recipes
from workloads import E2E_WORKLOADS

METHODS = tuple(E2E_METHODS)
DEFAULT_METHODS = METHODS[:10]
FULL = {"nodes": [2, 4], "rates": ["1gbit", "10gbit"], "workloads": list(E2E_WORKLOADS), "warmup": 6,
        "compress_steps": 10, "skip": 2}
QUICK = {"nodes": [2], "rates": ["1gbit"], "workloads": ["mlp"], "warmup": 5, "compress_steps": 6, "skip": 2}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a few minutes: {QUICK} (explicit flags override)")
    ap.add_argument("--nodes", type=int, nargs="+", help=f"default {FULL['nodes']}")
    ap.add_argument("--rates", nargs="+", help=f"tc rates, default {FULL['rates']}")
    ap.add_argument("--workloads", nargs="+", choices=E2E_WORKLOADS, help=f"default {FULL['workloads']}")
    ap.add_argument("--methods", nargs="+", choices=METHODS, help=f"default {list(DEFAULT_METHODS)}")
    ap.add_argument("--rtt", type=float, default=0.0,
                    help="round-trip delay in ms between nodes (a delay line, as time_to_accuracy.py's)")
    ap.add_argument("--ranks-per-node", type=int, nargs="+", default=[1],
                    help="ranks per emulated node (default 1); the *_hier methods need >= 2")
    ap.add_argument("--warmup", type=int, help="warm-up steps before compression starts (default 6, quick 5)")
    ap.add_argument("--compress-steps", type=int, help="timed compression-phase steps (default 10, quick 6)")
    ap.add_argument("--skip", type=int, help="untimed steps at the start of each phase (default 2)")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (converted by the strategies)")
    ap.add_argument("--profile", nargs="+", choices=METHODS, metavar="METHOD",
                    help="afterwards, run METHOD again with rank 0 under cProfile + torch.profiler for "
                         "--profile-steps compression-phase steps; the breakdown is printed (and written to --out)")
    ap.add_argument("--profile-steps", type=int, default=4, help="steps in the profiled window (default 4)")
    ap.add_argument("--profile-phase", choices=("compress", "warmup"), default="compress",
                    help="profile the first steps after the switch (+ skip) or after the start (+ skip)")
    add_out_argument(ap)
    ap.add_argument("--chart", metavar="PNG", help="also draw a bar chart of the step times to PNG")
    ap.add_argument("--json", metavar="PATH", help="also write the raw rows as JSON")
    ap.add_argument("--timeout", type=float, help="seconds per torchrun (default: estimated)")
    ap.add_argument("--timeout-local", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--keep-going", action="store_true", help="continue after a failed torchrun")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=E2E_WORKLOADS, help=argparse.SUPPRESS)
    ap.add_argument("--rate", help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=int, default=1800, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in ("nodes", "rates", "workloads", "warmup", "compress_steps", "skip"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.methods = args.methods or list(DEFAULT_METHODS)
    args.skip = max(1, args.skip)
    args.warmup = max(2, args.warmup)
    if args.worker:
        worker(args)
        return 0
    if args.local:
        local_worker(args)
        return 0

    if not require_root():
        return 2
    load0 = os.getloadavg()
    t0 = time.monotonic()
    rows, refs, profiles = run_grid(args)
    load = f"{load_text(load0, os.getloadavg())}; {time.monotonic() - t0:.0f} s"
    print(load, file=sys.stderr)
    text = tables(rows, refs, args.rtt)
    print(text)
    for p in profiles:
        print(p)
    chart_path = Path(args.chart) if args.chart and rows else None
    if chart_path:
        chart(rows, refs, chart_path)
        print(f"chart: {chart_path}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "refs": refs, "profiles": profiles}, indent=1))
    if args.out:
        head = header("e2e.py", argv, f"{load}\n\n{setup_text(args, chart_path)}")
        write_out(args.out, "# End-to-end training, emulated links\n\n" + head + text + "\n"
                  + "".join("\n" + p for p in profiles))
    return 0

if __name__ == "__main__":
    sys.exit(main())

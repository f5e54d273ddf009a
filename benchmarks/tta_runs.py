"""time_to_accuracy.py's runs: on each rank every method (and learning rate) in turn to the step budget,
validated every ``--eval-every`` steps (worker side), and per link and seed one torchrun on the emulated
cluster, after compute alone and an untimed compile pass (driver side, as root)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import HERE, emit_tagged, parse_tagged
from cluster_runs import fit_method, gather, local_world, quiet, run_alone, start_worker, trainer
from methods import TTA_DILOCO_H, TTA_METHODS, TTA_OURS, algorithm
from netns_cluster import EmulatedCluster, cleanup_stale, report_failures, run_torchrun
from recorders import recorder
from workloads import LM_BATCH, tta_data, tta_module

__all__ = ["TAG", "compute_alone", "merge_ranks", "run_grid", "run_method", "worker"]

SCRIPT = str(HERE / "time_to_accuracy.py")  # the CLI, which is the worker too (--worker, --alone)
TAG = "LOBTTA "


def _entry(method: str, args: argparse.Namespace, lr: float) -> dict[str, Any]:
    return algorithm(TTA_METHODS, method, lr=lr, warmup=args.warmup, run={"overlap": args.overlap})


def run_method(method: str, args: argparse.Namespace, lr: float, rank: int, world: int, iface: str) -> Any:
    """Train ``method`` at ``lr`` for the step budget; rank 0 returns the run's row."""
    rec = recorder(iface)
    train, val = tta_data(args.workload, args.seed, rank, world, args.steps, args.batch)
    alg = _entry(method, args, lr)
    fit_method(alg, tta_module(args.workload, args.seed, alg, args.steps), args.steps, [rec], world, train, val,
               val_check_interval=args.eval_every)
    mine = {"points": rec.points, "step_tx": rec.step_tx, "step_sent": rec.step_sent, "train_s": rec.train_s}
    everyone = gather(mine, world)
    if rank != 0:
        return None
    local = local_world()
    return {"method": method, "lr": lr, "seed": args.seed, "nodes": world // local, "ranks_per_node": local,
            "rate": args.rate, "workload": args.workload, "steps": args.steps, **_batch(args), **_overlap(args),
            **merge_ranks(everyone, local)}


def _batch(args: argparse.Namespace) -> dict[str, int]:
    """The LM's sequences per rank and step, recorded where they differ from ``LM_BATCH``."""
    return {"batch": args.batch} if args.workload == "lm" and args.batch != LM_BATCH else {}


def _overlap(args: argparse.Namespace) -> dict[str, int]:
    """The overlapped DiLoCo's steps in flight, recorded where they differ from the default (H / 2)."""
    return {"overlap": args.overlap} if args.overlap != TTA_DILOCO_H // 2 else {}


def merge_ranks(everyone: Sequence[dict[str, Any]], local: int) -> dict[str, Any]:
    """Every rank's recording (``Recorder``'s points, step_tx, step_sent) as one run's: the slowest rank's clock
    and the mean node's bytes. Every rank of a node reads the node's one veth counter, so the mean over the
    ranks is the mean node's; a rank's sockets count its own writes only, so a node's are ``local`` ranks'."""
    points = [{**p, "train_s": max(r["points"][i]["train_s"] for r in everyone),
               "tx": statistics.mean(r["points"][i]["tx"] for r in everyone)}
              for i, p in enumerate(everyone[0]["points"])]
    steps = range(len(everyone[0]["step_tx"]))
    step_tx = [statistics.mean(r["step_tx"][i] for r in everyone) for i in steps]
    step_sent = [statistics.mean(r["step_sent"][i] for r in everyone) * local for i in steps]
    return {"points": points, "rounds_per_step": sum(b > 4096 for b in step_sent) / len(step_sent),
            "bytes_per_step": statistics.mean(step_tx)}


def worker(args: argparse.Namespace) -> None:
    """Under torchrun in a namespace: every method at each of its learning rates in turn."""
    import torch.distributed as dist

    rank, world, iface = start_worker(args.pg_timeout)
    chosen = dict(kv.split("=") for kv in args.lr_of)
    for method in args.methods:
        for lr in [float(chosen[method])] if method in chosen else args.lrs:
            row = run_method(method, args, lr, rank, world, iface)
            if row is not None:
                emit_tagged(TAG, row)
    dist.barrier()


def compute_alone(args: argparse.Namespace) -> None:
    """The same model, batch and AdamW(fused=True) (``ddp_adamw``'s optimizer) in one process without DDP:
    median step time."""
    import lightning as L
    import torch

    torch.set_num_threads(1)
    quiet()
    rec = recorder(None)
    times: list[float] = []

    class Steps(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            times.append(time.perf_counter() - self.t)

    train, _ = tta_data(args.workload, 0, 0, args.nodes * args.ranks_per_node, 30, args.batch)  # a rank's batch
    module = tta_module(args.workload, 0, _entry("ddp_adamw", args, args.lrs[0]), 30)
    trainer("auto", 30, [rec, Steps()], limit_val_batches=0).fit(module, train_dataloaders=train)
    emit_tagged(TAG, {"kind": "compute_alone", "median_s": statistics.median(times[5:])})


# -- driver side (root namespace, as root) ---------------------------------------------------------------------


def _workload_args(args: argparse.Namespace) -> list[str]:
    """What a worker or a compute-alone process needs to build the runs' model and data."""
    return ["--workload", args.workload, "--batch", str(args.batch), "--overlap", str(args.overlap)]


def _alone(cluster: EmulatedCluster, args: argparse.Namespace) -> float:
    """Compute alone in this layout: one process per rank of the runs, all at once (they share the machine's
    cores as the ranks do: 4 ranks on 2 cores take twice as long per step), no communication; the mean of
    their median step times."""
    argv = [sys.executable, SCRIPT, "--alone", "--lrs", str(args.lrs[0]), *_workload_args(args),
            "--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node)]
    return statistics.mean(r["median_s"] for r in run_alone(cluster, argv, args.ranks_per_node, TAG, 900))


def _compile_pass(cluster: EmulatedCluster, args: argparse.Namespace, port: int) -> int:
    """Untimed: the package's methods for a few steps in this layout, so numba compiles their kernels (and caches
    them on disk) before any clock runs. A fresh install's first compressed step otherwise compiles them on every
    rank at once, in the middle of a timed run: 37 s (1-bit Adam) and 137 s (DiLoCo 4-bit) with 4 ranks on 2
    cores. Returns the next free port."""
    methods = [m for m in args.methods if m in TTA_OURS]
    if not methods or args.no_compile_pass:
        return port
    wargs = ["--worker", *_workload_args(args), "--rate", "compile pass", "--seed", "0", "--steps", "4",
             "--warmup", "2", "--eval-every", "4", "--pg-timeout", str(args.timeout), "--lrs", str(args.lrs[0]),
             "--methods", *methods]
    t0 = time.monotonic()
    results = run_torchrun(cluster, SCRIPT, wargs, master_port=port, timeout=args.timeout,
                           nproc_per_node=args.ranks_per_node)
    report_failures(results, "compile pass", keep_going=False, stdout_tail=2000, stderr_tail=6000)
    print(f"compile pass ({', '.join(methods)}): {time.monotonic() - t0:.0f} s, untimed", file=sys.stderr, flush=True)
    return port + 1


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One cluster of the layout: compute alone, the compile pass, then a torchrun per (rate, seed); with
    ``--raw``, the rows so far are saved after each."""
    cleanup_stale()
    rows: list[dict[str, Any]] = []
    port = 29700
    with EmulatedCluster(args.nodes, rate=args.rates[0]) as cluster:
        if args.rtt:
            cluster.set_delay(args.rtt)
        alone = _alone(cluster, args)
        print(f"compute alone: {alone:.3f} s/step", file=sys.stderr, flush=True)
        port = _compile_pass(cluster, args, port)
        for rate in args.rates:
            cluster.set_rate(rate)
            link = rate + (f" + {args.rtt:g} ms RTT" if args.rtt else "")
            for seed in args.seeds:
                wargs = ["--worker", *_workload_args(args), "--rate", link, "--seed", str(seed), "--steps",
                         str(args.steps), "--warmup", str(args.warmup), "--eval-every", str(args.eval_every),
                         "--pg-timeout", str(args.timeout), "--lrs", *map(str, args.lrs), "--methods", *args.methods]
                if args.lr_of:
                    wargs += ["--lr-of", *args.lr_of]
                t0 = time.monotonic()
                results = run_torchrun(cluster, SCRIPT, wargs, master_port=port, timeout=args.timeout,
                                       nproc_per_node=args.ranks_per_node)
                port += 1
                got = parse_tagged(results[0].stdout, TAG)
                for r in got:
                    r["compute_alone_s"] = alone
                    print(f"  [{link}, seed {seed}] {r['method']:<14} lr {r['lr']:g}: final "
                          f"{r['points'][-1]['val_loss']:.4f} in {r['points'][-1]['train_s']:.0f} s",
                          file=sys.stderr, flush=True)
                rows.extend(got)
                if args.raw:  # what has finished survives a later failure
                    Path(args.raw).write_text(json.dumps(rows))
                print(f"[{link}, seed {seed}] {len(got)} runs in {time.monotonic() - t0:.0f} s", file=sys.stderr,
                      flush=True)
                report_failures(results, f"{link} seed {seed}", keep_going=args.keep_going, stdout_tail=2000,
                                stderr_tail=6000)
    return rows

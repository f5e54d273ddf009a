"""e2e.py's runs: on each rank every method in turn, timed step by step (worker side), and the grid of
(nodes, ranks per node, rate, workload) torchruns on the emulated cluster (driver side, as root).

Per method: the wall time of every training step (the interval between consecutive ``on_train_batch_end``
calls), the slowest rank per step, median over phase 1 (steps ``skip .. switch-1``) and phase 2 (steps
``switch+skip .. end``, the mean over whole intervals for the methods whose steps differ within one); the
link bytes from each node's veth counter over the same windows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from _common import HERE, emit_tagged, parse_tagged
from cluster_runs import fit_method, gather, local_world, quiet, run_alone, start_worker, trainer
from e2e_report import fmt_s, layout
from methods import E2E_METHODS, E2E_TWO_LEVEL, algorithm
from netns_cluster import EmulatedCluster, cleanup_stale, parse_rate, report_failures, run_torchrun
from recorders import step_timer
from workloads import e2e_batch_size, e2e_loader, e2e_module, e2e_numel

__all__ = ["PROFILE_TAG", "RESULT_TAG", "local_worker", "run_grid", "run_method", "whole_intervals", "worker"]

SCRIPT = str(HERE / "e2e.py")  # the CLI, which is the worker too (--worker under torchrun, --local)
RESULT_TAG = "LOBE2E "
PROFILE_TAG = "LOBPROF "
NOISE = (".*does not have many workers.*", ".*Total length of .* across ranks.*")  # warnings a worker drops
ZERO_ONE_SCHEDULE = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")


def _entry(method: str, args: argparse.Namespace) -> dict[str, Any]:
    return algorithm(E2E_METHODS, method, lr=args.lr, warmup=args.warmup)


def _packaged(alg: dict[str, Any]) -> bool:
    """The package's methods (the compressed strategies, DiLoCo): they switch phase and count their bytes."""
    return alg["strategy"] != "ddp"


def _in_intervals(alg: dict[str, Any]) -> bool:
    """Methods whose steps differ within an interval (0/1 Adam's local steps, DiLoCo's outer steps): their
    phase-2 step time is the mean over whole intervals."""
    return alg["strategy"] in ("zero_one_adam", "diloco")


def whole_intervals(alg: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
    """The phase-2 window of the resolved entry ``alg`` cut to whole intervals (from a step after a
    synchronisation to a synchronisation), so that its mean step time and bytes are the steady state's;
    others unchanged."""
    if alg["strategy"] == "diloco":  # an outer step after every sync_every-th step
        syncs = [i for i in range(lo - 1, hi) if (i + 1) % alg["sync_every"] == 0]
    elif alg["strategy"] == "zero_one_adam":
        from lightning_onebit.optim import ZeroOneSchedule

        kinds = ZeroOneSchedule(**{k: alg[k] for k in ZERO_ONE_SCHEDULE}).kinds(hi)  # kinds[i]: step index i
        syncs = [i for i in range(lo - 1, hi) if kinds[i] == "sync"]
    else:
        return lo, hi
    return (syncs[0] + 1, syncs[-1] + 1) if len(syncs) >= 2 else (lo, hi)


def _window(values: Sequence[float], lo: int, hi: int) -> list[float]:
    return list(values[lo:hi]) if hi > lo else []


def _med(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def measure_fp32_allreduce(numel: int, reps: int = 3) -> float:
    """Median (slowest rank) wall time of one fp32 gloo all_reduce of ``numel`` elements."""
    import torch
    import torch.distributed as dist

    x = torch.randn(numel)
    dist.all_reduce(x)  # connect / warm up
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    everyone = gather(times, dist.get_world_size())
    return statistics.median(max(r[i] for r in everyone) for i in range(reps))


def run_method(method: str, args: argparse.Namespace, rank: int, world: int, iface: str,
               profile: bool = False) -> dict[str, Any] | None:
    """Train ``method`` for ``warmup + skip + compress_steps`` steps; rank 0 returns the summary row."""
    W, skip, S = args.warmup, args.skip, args.warmup + args.skip + args.compress_steps
    start, stop = (W + skip, S) if args.profile_phase == "compress" else (skip, W)  # stay inside the phase
    window = (start, min(stop, start + args.profile_steps)) if profile and rank == 0 else None
    timer = step_timer(iface, window)
    alg = _entry(method, args)
    L = local_world()
    trainer, fit_s = fit_method(alg, e2e_module(args.workload, alg), S, [timer], world,
                                e2e_loader(args.workload, S, rank), limit_val_batches=0)
    if len(timer.ends) != S:
        raise RuntimeError(f"{method}: expected {S} steps, timed {len(timer.ends)}")
    mine = {"times": timer.step_times(), "tx": timer.tx, "rx": timer.rx, "loss": timer.loss,
            "compressing": timer.compressing, "counted": timer.counted, "intra": timer.intra, "tx0": timer.tx0,
            "profile": timer.profile_text}
    everyone = gather(mine, world)
    del trainer
    if rank != 0:
        return None
    if profile:
        return {"method": method, "profile": everyone[0]["profile"]}
    comp = everyone[0]["compressing"]
    switch = next((i for i, c in enumerate(comp) if c), None)  # first step that ended compressed
    if _packaged(alg) and switch is not None and switch > 0:
        boundary = switch
    else:
        boundary = W  # also 0/1 Adam's freeze (var_freeze_step = W)
    per_step = [max(r["times"][i] for r in everyone) for i in range(S)]
    phases = {"warmup": (skip, boundary), "compress": whole_intervals(alg, boundary + skip, S)}
    stat = statistics.mean if _in_intervals(alg) else _med
    row: dict[str, Any] = {
        "nodes": world // L, "ranks_per_node": L, "rate": args.rate, "workload": args.workload, "method": method,
        "batch_per_worker": e2e_batch_size(args.workload), "steps": S, "switch_step": switch,
        "boundary": boundary, "fit_s": fit_s, "step_times": per_step,
        "loss_first": statistics.mean(r["loss"][0] for r in everyone),
        "loss_last": statistics.mean(statistics.mean(r["loss"][-3:]) for r in everyone),
    }
    for name, (lo, hi) in phases.items():
        window = _window(per_step, lo, hi)
        row[f"{name}_median_s"] = (stat(window) if window else None) if name == "compress" else _med(window)
        row[f"{name}_steps"] = max(0, hi - lo)
        # rounds: steps in which this rank's optimizer (or DDP) sent anything
        sent = [everyone[0]["counted"][i] - (everyone[0]["counted"][i - 1] if i else 0) for i in range(lo, hi)]
        row[f"{name}_rounds_per_step"] = (sum(b > 0 for b in sent) / len(sent) if _packaged(alg) else 1.0) \
            if sent else None
        if hi > lo:  # counters at the end of step lo-1 and hi-1 (lo >= 1)
            n = hi - lo
            row[f"{name}_tx_per_step"] = statistics.mean(r["tx"][hi - 1] - r["tx"][lo - 1] for r in everyone) / n
            row[f"{name}_rx_per_step"] = statistics.mean(r["rx"][hi - 1] - r["rx"][lo - 1] for r in everyone) / n
            # counters are per rank; a node's L ranks share its link
            row[f"{name}_counted_per_step"] = statistics.mean(
                r["counted"][hi - 1] - r["counted"][lo - 1] for r in everyone) * L / n
            row[f"{name}_intra_per_step"] = statistics.mean(
                r["intra"][hi - 1] - r["intra"][lo - 1] for r in everyone) * L / n
    return row


def worker(args: argparse.Namespace) -> None:
    """Under torchrun in a namespace: the fp32 allreduce reference, then every method in turn."""
    import torch.distributed as dist

    rank, world, iface = start_worker(args.pg_timeout, NOISE)
    numel = e2e_numel(args.workload)
    t_fp32 = measure_fp32_allreduce(numel)
    L = local_world()
    if rank == 0:
        emit_tagged(RESULT_TAG, {"kind": "fp32_allreduce", "nodes": world // L, "ranks_per_node": L, "rate": args.rate,
                                 "workload": args.workload, "numel": numel, "seconds": t_fp32})
    for method in args.methods:
        row = run_method(method, args, rank, world, iface)
        if row is not None:
            emit_tagged(RESULT_TAG, row)
    if args.profile:
        for method in args.profile:
            row = run_method(method, args, rank, world, iface, profile=True)
            if row is not None:
                emit_tagged(PROFILE_TAG, row)
    dist.barrier()


def local_worker(args: argparse.Namespace) -> None:
    """Compute alone: the same model and batch, ``Trainer(devices=1)``, ``AdamW(fused=True)`` (``ddp_adamw``'s
    optimizer), no DDP, no communication."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    quiet(NOISE)
    S, skip = args.warmup + args.skip + args.compress_steps, args.skip
    timer = step_timer(None)
    trainer("auto", S, [timer], limit_val_batches=0).fit(e2e_module(args.workload, _entry("ddp_adamw", args)),
                                                         train_dataloaders=e2e_loader(args.workload, S, 0))
    times = timer.step_times()
    emit_tagged(RESULT_TAG, {"kind": "compute_alone", "workload": args.workload,
                             "median_s": statistics.median(times[skip:]), "times": times})


# -- driver side (root namespace, as root) ---------------------------------------------------------------------


def _worker_args(args: argparse.Namespace, workload: str) -> list[str]:
    return ["--workload", workload, "--warmup", str(args.warmup), "--compress-steps", str(args.compress_steps),
            "--skip", str(args.skip), "--lr", str(args.lr), "--profile-steps", str(args.profile_steps),
            "--profile-phase", args.profile_phase]


def run_compute_alone(cluster: EmulatedCluster, args: argparse.Namespace, workload: str,
                      ranks_per_node: int = 1) -> dict[str, Any]:
    """``nodes x ranks_per_node`` concurrent single-device Trainers (no torchrun): compute per worker."""
    argv = [sys.executable, SCRIPT, "--local", *_worker_args(args, workload)]
    meds = [r["median_s"] for r in run_alone(cluster, argv, ranks_per_node, RESULT_TAG, args.timeout_local)]
    return {"kind": "compute_alone", "workload": workload, "nodes": cluster.nodes, "ranks_per_node": ranks_per_node,
            "median_s": statistics.mean(meds), "per_process": meds}


def estimate_timeout(nodes: int, rate: str, workload: str, args: argparse.Namespace, ranks_per_node: int = 1) -> float:
    """Generous limit for one torchrun (only so that a wedged run gets killed)."""
    numel = 25.2e6 if workload == "mlp" else 3.7e6
    wire = 2 * (nodes - 1) / nodes * 4 * numel * 8 / parse_rate(rate)
    compute = {"mlp": 0.5, "transformer": 0.8}[workload] * max(1.0, nodes * ranks_per_node / 2)
    steps = args.warmup + args.skip + args.compress_steps + 4  # + DDP's initial broadcast etc.
    runs = len(args.methods) + len(args.profile or [])
    waits = 10 * args.rtt / 1000  # a step's round trips (DDP's ring: a few per bucket)
    return 180.0 + 3.0 * (runs * steps * (wire + 3 * compute + waits) + 5 * wire)


def run_grid(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """One cluster per node count; per ranks-per-node layout: compute alone per workload, one torchrun per
    (rate, workload). The two-level methods run only on nodes of several ranks."""
    cleanup_stale()
    rows: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    profiles: list[str] = []
    port = 29600
    for nodes in args.nodes:
        with EmulatedCluster(nodes, rate=args.rates[0]) as cluster:
            if args.rtt:
                cluster.set_delay(args.rtt)
            for L in args.ranks_per_node:
                methods = [m for m in args.methods if L > 1 or m not in E2E_TWO_LEVEL]
                if not methods:
                    continue
                what = layout(nodes, L)
                alone = {}
                for workload in args.workloads:
                    print(f"[{what}] compute alone, {workload} ...", file=sys.stderr, flush=True)
                    alone[workload] = run_compute_alone(cluster, args, workload, L)
                    refs.append(alone[workload])
                    print(f"[{what}] compute alone, {workload}: {alone[workload]['median_s']:.4f} s/step",
                          file=sys.stderr, flush=True)
                for rate in args.rates:
                    cluster.set_rate(rate)
                    for workload in args.workloads:
                        timeout = args.timeout or estimate_timeout(nodes, rate, workload, args, L)
                        wargs = ["--worker", "--rate", rate, "--pg-timeout", str(int(timeout)),
                                 *_worker_args(args, workload), "--methods", *methods]
                        if args.profile:
                            wargs += ["--profile", *args.profile]
                        print(f"[{what}, {rate}, {workload}] {len(methods)} methods (timeout "
                              f"{timeout:.0f} s) ...", file=sys.stderr, flush=True)
                        t0 = time.monotonic()
                        results = run_torchrun(cluster, SCRIPT, wargs, master_port=port, timeout=timeout,
                                               nproc_per_node=L)
                        port += 1
                        got = parse_tagged(results[0].stdout, RESULT_TAG)
                        for r in got:
                            if r.get("kind") == "fp32_allreduce":
                                r["compute_alone_s"] = alone[workload]["median_s"]
                                refs.append(r)
                            else:
                                rows.append(r)
                                print(f"  {r['method']:<16} phase1 {fmt_s(r['warmup_median_s'])} s  "
                                      f"phase2 {fmt_s(r['compress_median_s'])} s", file=sys.stderr, flush=True)
                        for p in parse_tagged(results[0].stdout, PROFILE_TAG):
                            profiles.append(f"### profile: {p['method']}, {args.profile_phase} phase, {what}, "
                                            f"{rate}, {workload}, rank 0\n\n"
                                            f"```\n{p['profile']}```\n")
                        print(f"[{what}, {rate}, {workload}] done in {time.monotonic() - t0:.0f} s",
                              file=sys.stderr, flush=True)
                        report_failures(results, f"{what} at {rate} ({workload})", keep_going=args.keep_going,
                                        stdout_tail=2000, stderr_tail=6000)
    return rows, refs, profiles


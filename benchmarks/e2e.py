"""End-to-end training speed on emulated slow links: DDP, PyTorch comm hooks and the compressed strategies.

Every emulated node is a network namespace behind a ``tc tbf``-shaped veth (``benchmarks/netns_cluster.py``;
``docs/design/cluster.md``, "Emulated cluster benchmarks"); one ``torchrun`` per namespace runs a Lightning
``Trainer(accelerator="cpu", devices=L, num_nodes=N)`` (torchrun's environment makes Lightning pick
``TorchElasticEnvironment``); with ``--ranks-per-node L`` > 1 the L ranks of a node reach each other over
its loopback (unshaped) and the other nodes over the shaped link, and the ``*_hier`` methods run the
two-level collective (``hierarchical=True``) next to the flat one (the plain names, ``hierarchical=False``).
For each (nodes, rate, workload) *one* torchrun measures every method in turn,
each with a fresh model (same seed, same data), so the methods share the machine's conditions.

Methods: DDP + AdamW (fp32 allreduce), DDP + fp16 / bf16 compress hooks, DDP + PowerSGD (rank 1 and 4),
and the strategies ``onebit_adam``, ``onebit_lamb``, ``qadam``, ``cd_adam`` (``CompressedDDPStrategy`` with
``warmup=W``) and ``zero_one_adam`` (0/1 Adam with ``var_freeze_step=W``, kappa 2, and the local interval
doubling every step up to H = 4: its phase 2 is the steady state of 3 local steps and 1 synchronisation;
its phase-2 time is the *mean* over whole intervals, not the median, which would be a local step's).
The LightningModule's ``configure_optimizers`` returns ``torch.optim.AdamW(..., fused=True)`` in all cases,
what a user would run: DDP + AdamW and the hooks step with torch's fused AdamW kernel, and the compressed
strategies convert that same optimizer (the converted ``fused=True`` gives ``onebit_adam`` a fused warm-up;
the other algorithms ignore it). PowerSGD gets ``start_powerSGD_iter=W`` so that it has the same warm-up.
Hooks are registered on CPU by a small ``DDPStrategy`` subclass (Lightning does so only on CUDA); the bf16 hook
is registered under another name (DDP refuses the name without NCCL) and PowerSGD with one bucket in flight at
a time (it deadlocks gloo's two worker threads otherwise). That strategy (``hook_strategy``, imported in
``make_strategy``) is the one the recipes' ``ddp_fp16``/``ddp_bf16``/``powersgd_r*`` algorithms use too.

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

The same file is the worker (``--worker`` under torchrun, ``--local`` for the compute-alone runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    add_out_argument,
    emit_tagged,
    header,
    init_gloo_worker,
    load_text,
    parse_tagged,
    read_link_counter,
    repo_on_path,
    require_root,
    write_out,
)
from netns_cluster import (
    EmulatedCluster,
    cleanup_stale,
    node_env,
    parse_rate,
    report_failures,
    run_torchrun,
)

repo_on_path()  # lightning_onebit from this checkout, also when it is not installed

RESULT_TAG = "LOBE2E "
PROFILE_TAG = "LOBPROF "

METHODS = ("ddp_adamw", "ddp_fp16", "ddp_bf16", "powersgd_r1", "powersgd_r4",
           "onebit_adam", "onebit_lamb", "qadam", "cd_adam", "zero_one_adam",
           "onebit_adam_hier", "onebit_lamb_hier", "qadam_hier", "cd_adam_hier", "diloco", "diloco_4bit", "diloco_1bit")
DILOCO_H = 8
"""DiLoCo's ``sync_every`` here (its phase-2 figures are means over whole intervals of this many steps)."""
DILOCO = ("diloco", "diloco_4bit", "diloco_1bit")
HIER = ("onebit_adam_hier", "onebit_lamb_hier", "qadam_hier", "cd_adam_hier")
"""The two-level collective (``hierarchical=True``); the plain names run flat (``hierarchical=False``)."""
COMPRESSED = ("onebit_adam", "onebit_lamb", "qadam", "cd_adam", "zero_one_adam", *HIER, *DILOCO)
INTERVALS = ("zero_one_adam", *DILOCO)
"""Methods whose steps differ within an interval: their phase-2 step time is the mean over whole intervals."""
DEFAULT_METHODS = METHODS[:10]
HOOKS = ("ddp_fp16", "ddp_bf16", "powersgd_r1", "powersgd_r4")
LABEL = {
    "ddp_adamw": "DDP + fused AdamW (fp32)",
    "ddp_fp16": "DDP + fp16 hook",
    "ddp_bf16": "DDP + bf16 hook",
    "powersgd_r1": "DDP + PowerSGD r1",
    "powersgd_r4": "DDP + PowerSGD r4",
    "onebit_adam": "onebit_adam",
    "onebit_lamb": "onebit_lamb",
    "qadam": "qadam",
    "cd_adam": "cd_adam",
    "zero_one_adam": "zero_one_adam (mean over intervals)",
    **{m: f"{m[:-5]} two-level" for m in HIER},
    "diloco": f"diloco H={DILOCO_H}, fp32 (mean over intervals)",
    "diloco_4bit": f"diloco H={DILOCO_H}, 4-bit (mean over intervals)",
    "diloco_1bit": f"diloco H={DILOCO_H}, 1-bit (mean over intervals)",
}
WORKLOADS = ("mlp", "transformer")
WORKLOAD_DESC = {
    "mlp": "wide MLP 1024-4096-4096-1024-10 (25.2M params), batch 16/worker, synthetic teacher labels "
           "(communication-bound)",
    "transformer": "transformer encoder, 4 layers, d=256, 4 heads, ff 1024, seq 128, vocab 1000 (3.7M params), "
                   "batch 8/worker, shifted-token target (compute-heavier)",
}
FULL = {"nodes": [2, 4], "rates": ["1gbit", "10gbit"], "workloads": list(WORKLOADS), "warmup": 6,
        "compress_steps": 10, "skip": 2}
QUICK = {"nodes": [2], "rates": ["1gbit"], "workloads": ["mlp"], "warmup": 5, "compress_steps": 6, "skip": 2}


# ---------------------------------------------------------------------------------------------------------
# models (worker side; torch and lightning are imported lazily so the driver starts fast)
# ---------------------------------------------------------------------------------------------------------


def build_module(workload: str, lr: float = 1e-3) -> Any:
    """A fresh LightningModule for ``workload`` (same initial weights on every rank and every method)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    if workload == "mlp":
        net: nn.Module = nn.Sequential(
            nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
            nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 10))
    elif workload == "transformer":
        net = _Encoder()
    else:
        raise ValueError(f"unknown workload {workload!r}")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x)
            return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01, fused=True)

    return Module()


def _Encoder() -> Any:  # noqa: N802 - a factory, named like the class it builds
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self, vocab: int = 1000, d: int = 256, layers: int = 4, seq: int = 128) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.emb(x) + self.pos[: x.shape[1]]))

    return Encoder()


def batch_size(workload: str) -> int:
    return {"mlp": 16, "transformer": 8}[workload]


POOL_BATCHES = 8
"""Each rank cycles through this many distinct batches, so the loss visibly falls within a short run."""


def make_loader(workload: str, steps: int, rank: int) -> Any:
    """Exactly ``steps`` batches of synthetic data (a pool of POOL_BATCHES batches, repeated), different per
    rank, identical across methods."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    b = batch_size(workload)
    gen = torch.Generator().manual_seed(1234 + rank)
    n = POOL_BATCHES * b
    if workload == "mlp":
        teacher = torch.randn(1024, 10, generator=torch.Generator().manual_seed(7))
        x = torch.randn(n, 1024, generator=gen)
        y = (x @ teacher).argmax(dim=1)
    else:
        x = torch.randint(0, 1000, (n, 128), generator=gen)
        y = torch.roll(x, 1, dims=1)  # predict the previous token: learnable through attention
    reps = -(-steps // POOL_BATCHES)
    x, y = x.repeat(reps, *([1] * (x.dim() - 1)))[: steps * b], y.repeat(reps, *([1] * (y.dim() - 1)))[: steps * b]
    return DataLoader(TensorDataset(x, y), batch_size=b, shuffle=False)


def model_numel(workload: str) -> int:
    return sum(p.numel() for p in build_module(workload).parameters())


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------


def _step_timer(iface: str | None, profile_window: tuple[int, int] | None = None) -> Any:
    """A callback that records, per training step: end time, link counters, loss, compression state."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.t_start = 0.0
            self.ends: list[float] = []
            self.tx: list[int] = []
            self.rx: list[int] = []
            self.loss: list[float] = []
            self.compressing: list[bool] = []
            self.counted: list[int] = []
            self.intra: list[int] = []
            self.profiler: Any = None
            self.profile_text = ""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.t_start = time.perf_counter()
            self.tx0, self.rx0 = read_link_counter(iface, "tx_bytes"), read_link_counter(iface, "rx_bytes")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if profile_window is not None and batch_idx == profile_window[0]:
                self.profiler = _Profiler()
                self.profiler.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.profiler is not None and batch_idx == profile_window[1] - 1:  # type: ignore[index]
                self.profile_text = self.profiler.stop(profile_window[1] - profile_window[0])  # type: ignore
                self.profiler = None
            self.ends.append(time.perf_counter())
            self.tx.append(read_link_counter(iface, "tx_bytes"))
            self.rx.append(read_link_counter(iface, "rx_bytes"))
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.loss.append(float(loss))
            opt = trainer.strategy.optimizers[0]
            opt = getattr(opt, "_optimizer", opt)
            self.compressing.append(bool(getattr(opt, "compressing", False)))
            counter = getattr(opt, "comm_counter", None)
            self.counted.append(int(counter.total.bytes_sent) if counter is not None else 0)
            intra = getattr(opt, "intra_node_counter", None)
            self.intra.append(int(intra.total.bytes_sent) if intra is not None else 0)

        def step_times(self) -> list[float]:
            prev = [self.t_start, *self.ends[:-1]]
            return [e - s for s, e in zip(prev, self.ends, strict=True)]

    return StepTimer()


class _Profiler:
    """cProfile (Python-level attribution, numba kernels included in their callers) + torch.profiler (aten ops
    and gloo collectives) over a window of steps of one rank."""

    def __init__(self) -> None:
        import cProfile

        import torch

        self.cprof = cProfile.Profile()
        self.tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.tprof.start()
        self.cprof.enable()

    def stop(self, steps: int) -> str:
        import io
        import pstats

        self.cprof.disable()
        self.tprof.stop()
        wall = time.perf_counter() - self.t0
        s = io.StringIO()
        s.write(f"profiled {steps} steps, {wall:.3f} s wall, {wall / steps * 1e3:.1f} ms/step (with profiler "
                "overhead)\n\n=== cProfile, sorted by cumulative time (ms per step = cumtime / steps) ===\n")
        st = pstats.Stats(self.cprof, stream=s)
        rows = []
        for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            rows.append((ct, tt, nc, f"{Path(file).name}:{line}({func})" if line else func, file))
        rows.sort(reverse=True)
        s.write(f"{'cum ms/step':>11} {'self ms/step':>12} {'calls/step':>10}  function\n")
        shown = 0
        for ct, tt, nc, name, file in rows:
            interesting = ("lightning_onebit" in file or "distributed" in file or "ddp_comm_hooks" in file
                           or "optim" in file or name.startswith("<built-in method torch")
                           or "{method" in name or "autograd" in file)
            if not interesting or ct / steps < 0.5e-3:
                continue
            s.write(f"{ct / steps * 1e3:11.1f} {tt / steps * 1e3:12.1f} {nc / steps:10.1f}  {name}\n")
            shown += 1
            if shown >= 40:
                break
        s.write("\n=== cProfile, sorted by self time ===\n")
        rows.sort(key=lambda r: -r[1])
        for ct, tt, nc, name, _file in rows[:15]:
            s.write(f"{ct / steps * 1e3:11.1f} {tt / steps * 1e3:12.1f} {nc / steps:10.1f}  {name}\n")
        s.write("\n=== torch.profiler, sorted by self CPU time (totals over the window) ===\n")
        s.write(self.tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return s.getvalue()


def zero_one_schedule(warmup: int) -> dict[str, int]:
    """0/1 Adam's schedule here: phase A (refreshes and 1-bit steps) for the warm-up's ``warmup`` steps,
    then local intervals 1, 2 and from then on 4 (H)."""
    return {"var_freeze_step": warmup, "var_update_scaler": 2, "local_step_scaler": 1, "local_step_clipper": 4}


def _whole_intervals(method: str, warmup: int, lo: int, hi: int) -> tuple[int, int]:
    """0/1 Adam's phase-2 window cut to whole local intervals (from a step after a synchronisation to a
    synchronisation), so that its mean step time and bytes are the steady state's; others unchanged."""
    if method not in INTERVALS:
        return lo, hi
    if method in DILOCO:  # an outer step after every DILOCO_H-th step
        syncs = [i for i in range(lo - 1, hi) if (i + 1) % DILOCO_H == 0]
        return (syncs[0] + 1, syncs[-1] + 1) if len(syncs) >= 2 else (lo, hi)
    from lightning_onebit.optim import ZeroOneSchedule

    kinds = ZeroOneSchedule(**zero_one_schedule(warmup)).kinds(hi)  # kinds[i]: step index i (0-based)
    syncs = [i for i in range(lo - 1, hi) if kinds[i] == "sync"]
    return (syncs[0] + 1, syncs[-1] + 1) if len(syncs) >= 2 else (lo, hi)


def make_strategy(method: str, warmup: int) -> Any:
    """The Lightning strategy of ``method`` (DDP with a hook registered on CPU too, or a compressed one)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_onebit.strategies.ddp_hooks import hook_strategy

    # every method gets DDP's gradient_as_bucket_view (the compressed strategies' default), so
    # that no baseline pays the bucket -> .grad copy the others skip
    views = {"gradient_as_bucket_view": True}
    if method == "ddp_adamw":
        return DDPStrategy(**views)
    if method == "ddp_fp16":
        return hook_strategy("fp16", **views)
    if method == "ddp_bf16":
        return hook_strategy("bf16", **views)
    if method.startswith("powersgd_r"):
        return hook_strategy("powersgd", rank=int(method[10:]), start_iter=max(2, warmup), **views)
    if method in DILOCO:
        from lightning_onebit import DiLoCoStrategy

        compression = method.partition("_")[2] or "fp32"
        return DiLoCoStrategy(sync_every=DILOCO_H, compression=compression, **views)
    if method in COMPRESSED:
        from lightning_onebit import CompressedDDPStrategy

        hier = method in HIER
        if method == "zero_one_adam":
            return CompressedDDPStrategy(method, optimizer_kwargs=zero_one_schedule(warmup), hierarchical=False,
                                         **views)
        return CompressedDDPStrategy(method[:-5] if hier else method, warmup=warmup, hierarchical=hier, **views)
    raise ValueError(f"unknown method {method!r}")


def _trainer(strategy: Any, steps: int, callbacks: list[Any], num_nodes: int = 1, devices: int = 1) -> Any:
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=steps,
                     max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     use_distributed_sampler=False, callbacks=callbacks)


def _quiet() -> None:
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_onebit"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*Total length of .* across ranks.*")


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
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return statistics.median(max(r[i] for r in everyone) for i in range(reps))


def run_method(method: str, args: argparse.Namespace, rank: int, world: int, iface: str,
               profile: bool = False) -> dict[str, Any] | None:
    """Train ``method`` for ``warmup + skip + compress_steps`` steps; rank 0 returns the summary row."""
    import torch.distributed as dist

    W, skip, S = args.warmup, args.skip, args.warmup + args.skip + args.compress_steps
    start, stop = (W + skip, S) if args.profile_phase == "compress" else (skip, W)  # stay inside the phase
    window = (start, min(stop, start + args.profile_steps)) if profile and rank == 0 else None
    timer = _step_timer(iface, window)
    module = build_module(args.workload, args.lr)
    L = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = _trainer(make_strategy(method, W), S, [timer], num_nodes=world // L, devices=L)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=make_loader(args.workload, S, rank))
    fit_s = time.perf_counter() - t0
    if len(timer.ends) != S:
        raise RuntimeError(f"{method}: expected {S} steps, timed {len(timer.ends)}")
    mine = {"times": timer.step_times(), "tx": timer.tx, "rx": timer.rx, "loss": timer.loss,
            "compressing": timer.compressing, "counted": timer.counted, "intra": timer.intra, "tx0": timer.tx0,
            "profile": timer.profile_text}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    del trainer, module
    if rank != 0:
        return None
    if profile:
        return {"method": method, "profile": everyone[0]["profile"]}
    comp = everyone[0]["compressing"]
    switch = next((i for i, c in enumerate(comp) if c), None)  # first step that ended compressed
    if method in COMPRESSED and switch is not None and switch > 0:
        boundary = switch
    else:
        boundary = W  # also 0/1 Adam's freeze (var_freeze_step = W)
    per_step = [max(r["times"][i] for r in everyone) for i in range(S)]
    phases = {"warmup": (skip, boundary), "compress": _whole_intervals(method, W, boundary + skip, S)}
    stat = statistics.mean if method in INTERVALS else _med
    row: dict[str, Any] = {
        "nodes": world // L, "ranks_per_node": L, "rate": args.rate, "workload": args.workload, "method": method,
        "batch_per_worker": batch_size(args.workload), "steps": S, "switch_step": switch,
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
        row[f"{name}_rounds_per_step"] = (sum(b > 0 for b in sent) / len(sent) if method in COMPRESSED else 1.0) \
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

    _quiet()
    rank, world = init_gloo_worker(args.pg_timeout)
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    numel = model_numel(args.workload)
    t_fp32 = measure_fp32_allreduce(numel)
    L = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
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
    """Compute alone: the same model and batch, ``Trainer(devices=1)``, ``AdamW(fused=True)``, no DDP, no
    communication."""
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    _quiet()
    S, skip = args.warmup + args.skip + args.compress_steps, args.skip
    timer = _step_timer(None)
    trainer = _trainer("auto", S, [timer])
    trainer.fit(build_module(args.workload, args.lr), train_dataloaders=make_loader(args.workload, S, 0))
    times = timer.step_times()
    emit_tagged(RESULT_TAG, {"kind": "compute_alone", "workload": args.workload,
                             "median_s": statistics.median(times[skip:]), "times": times})


# ---------------------------------------------------------------------------------------------------------
# driver side (root namespace, as root)
# ---------------------------------------------------------------------------------------------------------


def _worker_args(args: argparse.Namespace, workload: str) -> list[str]:
    return ["--workload", workload, "--warmup", str(args.warmup), "--compress-steps", str(args.compress_steps),
            "--skip", str(args.skip), "--lr", str(args.lr), "--profile-steps", str(args.profile_steps),
            "--profile-phase", args.profile_phase]


def run_compute_alone(cluster: EmulatedCluster, args: argparse.Namespace, workload: str,
                      ranks_per_node: int = 1) -> dict[str, Any]:
    """``nodes x ranks_per_node`` concurrent single-device Trainers (no torchrun): compute per worker."""
    procs, files = [], []
    argv = [sys.executable, str(Path(__file__).resolve()), "--local", *_worker_args(args, workload)]
    try:
        for k in [k for k in range(cluster.nodes) for _ in range(ranks_per_node)]:
            out = tempfile.TemporaryFile()
            files.append(out)
            procs.append(cluster.popen(k, argv, node_env(cluster, k), stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout_local
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if any(p.poll() is None for p in procs):
            cluster.kill_processes()
    rows = []
    for k, (p, f) in enumerate(zip(procs, files, strict=True)):
        f.seek(0)
        text = f.read().decode(errors="replace")
        f.close()
        got = parse_tagged(text, RESULT_TAG)
        if p.returncode != 0 or not got:
            raise SystemExit(f"compute-alone run failed on node {k} (rc={p.returncode}):\n{text[-4000:]}")
        rows.extend(got)
    meds = [r["median_s"] for r in rows]
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
                methods = [m for m in args.methods if L > 1 or m not in HIER]
                if not methods:
                    continue
                what = _layout(nodes, L)
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
                        results = run_torchrun(cluster, str(Path(__file__).resolve()), wargs, master_port=port,
                                               timeout=timeout, nproc_per_node=L)
                        port += 1
                        got = parse_tagged(results[0].stdout, RESULT_TAG)
                        for r in got:
                            if r.get("kind") == "fp32_allreduce":
                                r["compute_alone_s"] = alone[workload]["median_s"]
                                refs.append(r)
                            else:
                                rows.append(r)
                                print(f"  {r['method']:<16} phase1 {_fmt_s(r['warmup_median_s'])} s  "
                                      f"phase2 {_fmt_s(r['compress_median_s'])} s", file=sys.stderr, flush=True)
                        for p in parse_tagged(results[0].stdout, PROFILE_TAG):
                            profiles.append(f"### profile: {p['method']}, {args.profile_phase} phase, {what}, "
                                            f"{rate}, {workload}, rank 0\n\n"
                                            f"```\n{p['profile']}```\n")
                        print(f"[{what}, {rate}, {workload}] done in {time.monotonic() - t0:.0f} s",
                              file=sys.stderr, flush=True)
                        report_failures(results, f"{what} at {rate} ({workload})", keep_going=args.keep_going,
                                        stdout_tail=2000, stderr_tail=6000)
    return rows, refs, profiles


# -- reporting ---------------------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _mb(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}" if v < 10e6 else f"{v / 1e6:.1f}"


def _layout(nodes: int, L: int) -> str:
    return f"{nodes} nodes x {L} ranks" if L > 1 else f"{nodes} nodes"


def _setting(r: dict[str, Any]) -> tuple[str, int, int, str]:
    """(workload, nodes, ranks per node, rate) of a row (rows without a layout are one rank per node)."""
    return r["workload"], r["nodes"], r.get("ranks_per_node", 1), r["rate"]


def _setting_key(k: tuple[str, int, int, str]) -> tuple[int, int, int, float]:
    return WORKLOADS.index(k[0]), k[1], k[2], parse_rate(k[3])


def ideal_of(refs: list[dict[str, Any]], nodes: int, rate: str, workload: str,
             ranks_per_node: int = 1) -> dict[str, float] | None:
    for r in refs:
        if r.get("kind") == "fp32_allreduce" and _setting(r) == (workload, nodes, ranks_per_node, rate):
            return {"compute": r["compute_alone_s"], "fp32": r["seconds"],
                    "ideal": r["compute_alone_s"] + r["seconds"] / 32}
    return None


def tables(rows: list[dict[str, Any]], refs: list[dict[str, Any]], rtt: float = 0.0) -> str:
    """Markdown: one table per (workload, nodes, rate), then the target check (``rtt``: the round trip
    every link had, for the titles)."""
    out = []
    settings = sorted({_setting(r) for r in rows}, key=_setting_key)
    for workload, nodes, L, rate in settings:
        sub = [r for r in rows if _setting(r) == (workload, nodes, L, rate)]
        sub.sort(key=lambda r: METHODS.index(r["method"]))
        ideal = ideal_of(refs, nodes, rate, workload, L)
        base = next((r["compress_median_s"] for r in sub if r["method"] == "ddp_adamw"), None)
        link = f"{rate} + {rtt:g} ms RTT" if rtt else rate
        out.append(f"### {workload}, {_layout(nodes, L)}, {link}\n")
        if ideal:
            out.append(f"Ideal step: compute alone {ideal['compute']:.3f} s + fp32 all_reduce "
                       f"{ideal['fp32']:.3f} s / 32 = **{ideal['ideal']:.3f} s**\n")
        out.append("| method | phase 1 (warm-up) s | phase 2 (compression) s | samples/s (phase 2) | "
                   "link MB/step/node phase 1 | phase 2 | speedup vs DDP + fused AdamW (phase 2) | "
                   "phase 2 / ideal | loss first -> last |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in sub:
            c = r["compress_median_s"]
            sps = r["batch_per_worker"] * nodes * L / c if c else None
            speed = f"{base / c:.2f}x" if base and c else "-"
            vs_ideal = f"{c / ideal['ideal']:.2f}" if ideal and c else "-"
            out.append(f"| {LABEL[r['method']]} | {_fmt_s(r['warmup_median_s'])} | {_fmt_s(c)} | "
                       f"{'-' if sps is None else f'{sps:.1f}'} | {_mb(r.get('warmup_tx_per_step'))} | "
                       f"{_mb(r.get('compress_tx_per_step'))} | {speed} | {vs_ideal} | "
                       f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
        out.append("")
        out.append(_zero_one_vs_onebit(sub))
        out.append(_flat_vs_two_level(sub))
    out.append(target_check(rows, refs))
    return "\n".join(out)


def _zero_one_vs_onebit(sub: list[dict[str, Any]]) -> str:
    """0/1 Adam's steady state (whole local intervals) against 1-bit Adam's compression phase."""
    by = {r["method"]: r for r in sub}
    z, o = by.get("zero_one_adam"), by.get("onebit_adam")
    if z is None:
        return ""
    line = (f"zero_one_adam, phase 2: {z['compress_rounds_per_step']:.2f} rounds per step over "
            f"{z['compress_steps']} steps of whole local intervals")
    if o is not None and o["compress_median_s"] and z["compress_median_s"]:
        bz, bo = z.get("compress_tx_per_step"), o.get("compress_tx_per_step")
        ratio = o["compress_median_s"] / z["compress_median_s"]
        line += f"; onebit_adam (compression phase) / zero_one_adam: step time {ratio:.2f}x"
        line += f", link bytes {bo / bz:.2f}x" if bz and bo else ""
        line += f", rounds {o['compress_rounds_per_step'] / z['compress_rounds_per_step']:.2f}x"
    return line + ".\n"


def _flat_vs_two_level(sub: list[dict[str, Any]]) -> str:
    """For nodes of several ranks: each algorithm flat against two-level, compression phase."""
    by = {r["method"]: r for r in sub}
    pairs = [(m[:-5], m) for m in HIER if m in by and m[:-5] in by]
    if not pairs:
        return ""
    lines = ["Flat vs two-level, compression phase (inter-node bytes: each node's link counter):\n",
             "| algorithm | flat s | two-level s | flat / two-level time | flat link MB/step/node | "
             "two-level link MB/step/node | flat / two-level bytes | two-level fp32 MB/step/node inside the node |",
             "|---|---|---|---|---|---|---|---|"]
    for flat, hier in pairs:
        f, h = by[flat], by[hier]
        tf, th = f["compress_median_s"], h["compress_median_s"]
        bf, bh = f.get("compress_tx_per_step"), h.get("compress_tx_per_step")
        lines.append(f"| {flat} | {_fmt_s(tf)} | {_fmt_s(th)} | {f'{tf / th:.2f}x' if tf and th else '-'} | "
                     f"{_mb(bf)} | {_mb(bh)} | {f'{bf / bh:.2f}x' if bf and bh else '-'} | "
                     f"{_mb(h.get('compress_intra_per_step'))} |")
    return "\n".join(lines) + "\n"


def target_check(rows: list[dict[str, Any]], refs: list[dict[str, Any]]) -> str:
    """The targets (see the module docstring): on the communication-bound model, 2 nodes, 1 Gbit/s; and
    two-level against flat wherever nodes have 2 ranks."""
    return _flat_targets(rows, refs) + _two_level_targets(rows)


def _two_level_targets(rows: list[dict[str, Any]]) -> str:
    lines = []
    for workload, nodes, L, rate in sorted({_setting(r) for r in rows if r.get("ranks_per_node", 1) == 2},
                                           key=_setting_key):
        by = {r["method"]: r for r in rows if _setting(r) == (workload, nodes, L, rate)}
        for hier in HIER:
            flat = hier[:-5]
            if hier not in by or flat not in by:
                continue
            f, h = by[flat], by[hier]
            bf, bh = f.get("compress_tx_per_step"), h.get("compress_tx_per_step")
            tf, th = f["compress_median_s"], h["compress_median_s"]
            if not (bf and bh and tf and th):
                continue
            lines.append(f"- {workload}, {_layout(nodes, L)}, {rate}, {flat}: inter-node bytes flat / two-level "
                         f"{bf / bh:.2f}x (>= 1.8x: {'met' if bf / bh >= 1.8 else 'MISSED'}); step flat / two-level "
                         f"{tf / th:.2f}x (not slower: {'met' if th <= tf else 'MISSED'})")
    return ("Targets (two-level vs flat, compression phase, 2 ranks per node):\n" + "\n".join(lines) + "\n"
            if lines else "")


def _flat_targets(rows: list[dict[str, Any]], refs: list[dict[str, Any]]) -> str:
    sub = {r["method"]: r for r in rows if _setting(r) == ("mlp", 2, 1, "1gbit")}
    ob = sub.get("onebit_adam")
    if not ob or not ob["compress_median_s"]:
        return "Targets (mlp, 2 nodes, 1gbit): not measured in this run.\n"
    t = ob["compress_median_s"]
    lines = ["Targets (mlp, 2 nodes, 1gbit, onebit_adam compression phase):"]
    if "ddp_adamw" in sub:
        s = sub["ddp_adamw"]["compress_median_s"] / t
        lines.append(f"- >= 2.5x faster than DDP + fused AdamW: {s:.2f}x -> {'met' if s >= 2.5 else 'MISSED'}")
    ideal = ideal_of(refs, 2, "1gbit", "mlp", 1)
    if ideal:
        q = t / ideal["ideal"]
        lines.append(f"- within 1.3x of the ideal ({ideal['ideal']:.3f} s): {q:.2f}x -> "
                     f"{'met' if q <= 1.3 else 'MISSED'}")
    for h in HOOKS:
        if h in sub and sub[h]["compress_median_s"]:
            other = sub[h]["compress_median_s"]
            lines.append(f"- faster than {LABEL[h]} ({other:.3f} s): {other / t:.2f}x -> "
                         f"{'met' if t < other else 'MISSED'}")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], refs: list[dict[str, Any]], path: Path) -> None:
    """Bar chart: per setting, each method's phase-1 and phase-2 step time, and the ideal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({_setting(r) for r in rows}, key=_setting_key)
    ncol = min(4, len(settings))
    nrow = -(-len(settings) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(7.0, 4.6 * ncol), 4.2 * nrow + 0.6), squeeze=False)
    for ax, (workload, nodes, L, rate) in zip(axes.flat, settings, strict=False):
        sub = sorted((r for r in rows if _setting(r) == (workload, nodes, L, rate)),
                     key=lambda r: METHODS.index(r["method"]))
        xs = range(len(sub))
        p1 = [r["warmup_median_s"] or 0 for r in sub]
        p2 = [r["compress_median_s"] or 0 for r in sub]
        colors = ["tab:gray" if r["method"] == "ddp_adamw" else "tab:orange" if r["method"] in HOOKS
                  else "tab:blue" for r in sub]
        ax.bar([x - 0.2 for x in xs], p1, 0.4, color=colors, alpha=0.35)
        ax.bar([x + 0.2 for x in xs], p2, 0.4, color=colors)
        ideal = ideal_of(refs, nodes, rate, workload, L)
        if ideal:
            ax.axhline(ideal["ideal"], color="k", ls="--", lw=1, label=f"ideal {ideal['ideal']:.3f} s")
            ax.legend(fontsize=7, loc="lower left", framealpha=0.9)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([LABEL[r["method"]].replace("DDP + ", "") for r in sub], rotation=60, ha="right",
                           fontsize=8)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{workload}, {_layout(nodes, L)}, {rate}", fontsize=10)
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.suptitle("Training step time on emulated links (median, slowest rank; lower is better)\n"
                 "pale: phase 1 (warm-up), dark: phase 2 (compression)\n"
                 "gray: DDP, orange: PyTorch comm hooks, blue: lightning_onebit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setup_text(args: argparse.Namespace, chart_path: Path | None) -> str:
    """What was run and how it was measured: the paragraph that heads an ``--out`` file."""
    S = args.warmup + args.skip + args.compress_steps
    wl = "\n".join(f"- `{w}`: {WORKLOAD_DESC[w]}" for w in args.workloads)
    return (
        f"Workloads:\n{wl}\n\n"
        f"One torchrun per node (network namespace behind a tc-tbf shaped veth), Lightning Trainer(accelerator="
        f"'cpu', devices=L, num_nodes=N), gloo, 1 thread per process, all methods in the same torchrun one "
        f"after another. {S} steps per method: warm-up switch at step {args.warmup} "
        f"(CompressedDDPStrategy(warmup={args.warmup}), PowerSGD start_powerSGD_iter={args.warmup}); "
        f"medians skip the first {args.skip} steps of each phase. Step time = interval between consecutive "
        "on_train_batch_end calls, slowest rank per step. Phase 1 = steps before the switch (for the fp16/bf16 "
        "hooks and cd_adam, which have one regime, both phases measure the same thing). Link MB = veth tx "
        "counter per step and node (incl. TCP/IP headers). Ideal = compute alone (same model, Trainer(devices=1),"
        " AdamW(fused=True), N such processes at once since the nodes share the machine's cores) + measured fp32 "
        "all_reduce of all parameters / 32. Loss: mean over ranks, first step -> mean of the last 3 steps (a "
        f"sanity check only: {S} steps say nothing about final quality)."
        + (f"\n\nChart: `{chart_path}`" if chart_path else ""))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a few minutes: {QUICK} (explicit flags override)")
    ap.add_argument("--nodes", type=int, nargs="+", help=f"default {FULL['nodes']}")
    ap.add_argument("--rates", nargs="+", help=f"tc rates, default {FULL['rates']}")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, help=f"default {FULL['workloads']}")
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
    ap.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
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

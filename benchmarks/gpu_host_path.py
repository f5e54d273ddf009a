"""The host work of a compression-phase step on the CUDA path, counted on a CPU (numba's CUDA simulator).

    python benchmarks/gpu_host_path.py                                  # OnebitAdam: both models, 1 and 2 ranks
    python benchmarks/gpu_host_path.py --algorithm OnebitAdam QAdam OnebitLamb ZeroOneAdam
    python benchmarks/gpu_host_path.py --sites --ops                    # where each copy and read happens
    python benchmarks/gpu_host_path.py --world 2 --sync hook step       # 2 ranks: DDP's hook, and step()
    python benchmarks/gpu_host_path.py --world 2 --exchange gloo nccl   # 2 ranks: gloo's path, and NCCL's
    python benchmarks/gpu_host_path.py --full --out host_path.md        # the 17M-parameter MLP

A step is fast on a GPU only if the host does little besides queueing kernels: each launch, conversion
of a tensor to a kernel array, blocking host-to-device copy, device-to-host read (which also waits for
the device), torch call and allocation costs host time. This runs the package's ``cuda`` backend
(``LIGHTNING_ONEBIT_BACKEND=cuda``) on CPU tensors under numba's CUDA simulator with every kernel
stubbed (it counts and returns: the simulator's threads never run) and counts each of those per
step, with :class:`host_counters.HostPathCounter` (its docstring says how each counter recognises
what it counts). Counted: the steps after the warm-up, without the first two of each kind where there are
more (the compression phase's first binds its buffers; with DDP's hook a bucket's first compressed
sync comes a step before its first compressed update); for one rank the optimizer's ``step()`` alone (fixed
gradients), for two gloo ranks DDP's comm hook calls during backward plus ``step()`` (the model's own
forward and backward are not counted), with the compressed sync in the hook (``--sync hook``, the default:
the policy "raise") or in ``step()`` (``--sync step``: the policy "skip", the Lightning strategies'
default, whose hook hands back the local gradients). With several ranks the exchanges take gloo's path for CPU
tensors (``--exchange gloo``, the default: each direction of a rank pair on its own connection, gathers fanned
out, see ``comm/duplex.py``), or the path a GPU's NCCL group takes (``--exchange nccl``: those switched off, the
plain ``all_to_all_single`` and ``all_gather``, still on gloo here). Host time: thread CPU time of the same,
the stubs' time left out, over further steps with the counting off (min / median); on a CPU the torch ops the step makes
also do their arithmetic, so it is an upper bound of the host's share that shrinks with the model.

Models, sized so that the counts (which depend on tensors and buckets, not sizes) come quickly: an
MLP of 6 tensors in 3 buckets (``--full``: 1024-4096-2048-2048, 17M parameters, as
``optimizer_step.py``) and a GPT-like model of 100 tensors in 13 buckets (token and position
embeddings, 6 blocks of LayerNorms, attention projections, MLP and their biases, a final LayerNorm;
the output tied to the token embedding); the bucket cap is chosen so that the buckets come out so.
Sizes matter only where the package branches on them on a CPU: with ``--full`` the MLP's buckets are
long enough at 2 ranks for the CPU's pipeline to cut each call into pieces (a GPU's takes one), and
the host time is then mostly the torch ops' arithmetic. Two ranks are forked from this process.
``--json PATH`` writes every count (per step, per kernel, per torch op, per site) for
``tests/test_gpu_host_path.py``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before numba is imported (the package imports it)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    os.environ["LIGHTNING_ONEBIT_BACKEND"] = "cuda"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from _common import header, load_text, repo_on_path, tee_stdout  # noqa: E402
from host_counters import COUNTERS, HostPathCounter  # noqa: E402
from torch import nn  # noqa: E402

repo_on_path()
import lightning_onebit as lo  # noqa: E402

ALGORITHMS = ("OnebitAdam", "QAdam", "OnebitLamb", "ZeroOneAdam")
MODELS = ("mlp", "gpt")
BUCKETS = {"mlp": 3, "gpt": 13}
MLP_WIDTHS = {"small": (64, 256, 128, 128), "full": (1024, 4096, 2048, 2048)}
GPT_SHAPE = {"small": {"vocab": 128, "d": 64, "ff": 256, "seq": 64, "layers": 6, "heads": 4},
             "full": {"vocab": 1024, "d": 256, "ff": 1024, "seq": 128, "layers": 6, "heads": 4}}
ZERO_ONE = {"var_freeze_step": 2, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}
ZERO_ONE_BEFORE = 8  # from step 9 on: 3 local steps, then 1 that synchronises

ROWS = (  # (counter, what the table calls it)
    ("launches", "numba kernel launches"),
    ("conversions", "`__cuda_array_interface__` conversions"),
    ("h2d", "blocking host-to-device copies"),
    ("h2d_async", "non-blocking host-to-device copies"),
    ("d2h", "device-to-host reads"),
    ("d2h_async", "non-blocking device-to-host copies"),
    ("torch_ops", "torch ops outside the kernels"),
    ("torch_views", "of which views and no-ops (no kernel on a GPU)"),
    ("allocations", "allocations on the device"),
    ("host_allocations", "host tensors made"),
    ("cpu_branches", "CPU-only branches (`.numpy()` of a step tensor no kernel takes)"),
)


# -- the models ------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, ff: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab: int, d: int, ff: int, seq: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, ff, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.T  # tied: every row of the embedding gets a gradient


def build(model: str, size: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model and its loss on a fixed batch (GELU, every token once: no coordinate without a gradient,
    which the optimizers would mask)."""
    torch.manual_seed(0)
    if model == "mlp":
        a, b, c, d = MLP_WIDTHS[size]
        net = nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.GELU(), nn.Linear(c, d))
        x = torch.randn(8, a)
        return net, lambda m: m(x).square().mean()
    shape = GPT_SHAPE[size]
    net = _GPT(**shape)
    idx = torch.arange(shape["vocab"]).view(-1, shape["seq"])
    target = idx.roll(1)
    return net, lambda m: F.cross_entropy(m(idx).flatten(0, 1), target.flatten())


def _nbuckets(numels: Sequence[int], cap: int) -> int:
    """Buckets the optimizers cut (reverse order, a new one when the next tensor would pass the cap)."""
    n, size = 0, 0
    for k in reversed(numels):
        if size and size + k > cap:
            n, size = n + 1, 0
        size += k
    return n + (size > 0)


def bucket_cap_mb(numels: Sequence[int], buckets: int) -> float:
    """A ``bucket_cap_mb`` that cuts tensors of ``numels`` into ``buckets`` buckets (exact in binary)."""
    lo, hi = max(numels), sum(numels)
    while lo < hi:  # the smallest cap with at most that many buckets (the count falls as the cap grows)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if _nbuckets(numels, mid) > buckets else (lo, mid)
    if _nbuckets(numels, lo) != buckets:
        raise ValueError(f"no bucket cap cuts these {len(numels)} tensors into {buckets} buckets")
    return lo * 4 / 2**20


# -- one measurement -------------------------------------------------------------------------------------


def _optimizer(algorithm: str, params: list[nn.Parameter], cap_mb: float) -> tuple[Any, Callable[[], str], int]:
    """The optimizer, ``kind()`` (the kind of its coming step) and the steps to take before counting: the
    warm-up (0/1 Adam: up to its steady 3 local steps and 1 synchronising one)."""
    if algorithm == "ZeroOneAdam":
        opt = lo.ZeroOneAdam(params, lr=1e-3, weight_decay=0.01, bucket_cap_mb=cap_mb, **ZERO_ONE)
        return opt, lambda: opt.schedule().kind(opt.optimizer_steps + 1), ZERO_ONE_BEFORE
    opt = getattr(lo, algorithm)(params, lr=1e-3, weight_decay=0.01, warmup_steps=1, bucket_cap_mb=cap_mb)
    return opt, lambda: "compression" if opt.optimizer_steps >= opt.warmup_steps else "warm-up", 1


@contextlib.contextmanager
def exchanges_as(exchange: str):
    """``"nccl"``: the package's choices for gloo with CPU tensors (the duplex twin, gathers fanned out) switched
    off while it runs, so that a step takes the collectives a GPU's NCCL group would; ``"gloo"``: as they are."""
    if exchange == "gloo":
        yield
        return
    import lightning_onebit.comm.allreduce as allreduce
    import lightning_onebit.comm.dense as dense
    import lightning_onebit.optim.ddp as ddp

    saved = ddp.enable_duplex, dense.fans_out, allreduce.fans_out
    ddp.enable_duplex = lambda group=None: False  # what it answers for a group that is not gloo's
    dense.fans_out = allreduce.fans_out = lambda group, device: False  # its answer for CUDA tensors
    try:
        yield
    finally:
        ddp.enable_duplex, dense.fans_out, allreduce.fans_out = saved


@contextlib.contextmanager
def updates_as_on_a_gpu():
    """The optimizers' own choices by device made as on a GPU while it runs: their updates take the torch ops
    instead of the CPU's numba kernels (``optim.functional``), and 0/1 Adam's local steps keep their finiteness
    flags on the device instead of reading them (``optim.local_steps``)."""
    import lightning_onebit.optim.functional as functional
    import lightning_onebit.optim.local_steps as local_steps

    saved = functional._fusable, local_steps.flags_stay_on_device
    functional._fusable = lambda *tensors: False
    local_steps.flags_stay_on_device = lambda device: True
    try:
        yield
    finally:
        functional._fusable, local_steps.flags_stay_on_device = saved


def measure(model: str, algorithm: str, size: str, world: int, steps: int, timed: int,
            sync: str = "hook", exchange: str = "gloo") -> dict[str, Any]:
    """Counts and host times of ``algorithm``'s steps on ``model`` (this process is one of ``world`` ranks
    of the default group when ``world > 1``, synchronising in DDP's hook or in ``step()``, ``sync``, through
    the exchanges of ``exchange``'s path): see the module docstring."""
    exchange = exchange if world > 1 else "gloo"
    with exchanges_as(exchange), updates_as_on_a_gpu():
        return dict(_measure(model, algorithm, size, world, steps, timed, sync), exchange=exchange)


def _measure(model: str, algorithm: str, size: str, world: int, steps: int, timed: int, sync: str) -> dict[str, Any]:
    net, loss = build(model, size)
    params = list(net.parameters())
    cap_mb = bucket_cap_mb([p.numel() for p in params], BUCKETS[model])
    counter = HostPathCounter()
    if world == 1:
        g = torch.Generator().manual_seed(1)
        for p in params:  # fixed, nonzero: no coordinate is masked at the switch
            p.grad = torch.randn(p.shape, generator=g).mul_(1e-3).add_(1e-6)
    with counter.stubs():
        with counter.tracking():
            opt, kind, before = _optimizer(algorithm, params, cap_mb)
            ddp = None
            if world > 1:
                if sync == "step":
                    opt.set_nonfinite_policy("skip")
                # gradients as views of DDP's buckets: memory that stays (as a user of step()'s sync would set)
                ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
                with counter.counting_ddp_hooks():
                    opt.attach(ddp)

            def step(count: bool) -> float:
                """One step; returns its host time (the hooks' and ``step()``'s thread time, stubs left out)."""
                s0, h0 = counter.stub_s, counter.hook_s
                if ddp is not None:
                    opt.zero_grad(set_to_none=True)
                    loss(ddp).backward()
                t0 = time.thread_time()
                if count:
                    with counter.window():
                        opt.step()
                else:
                    opt.step()
                own = time.thread_time() - t0
                return own + (counter.hook_s - h0) - (counter.stub_s - s0)

            for _ in range(before):
                step(count=False)
                counter.take()
            counted: dict[str, list[dict[str, Any]]] = {}
            for _ in range(max(steps, 2 * ZERO_ONE["local_step_clipper"]) if algorithm == "ZeroOneAdam" else steps):
                k = kind()
                step(count=True)
                counted.setdefault(k, []).append(counter.take())
        times: dict[str, list[float]] = {}
        for _ in range(timed):
            k = kind()
            times.setdefault(k, []).append(1e3 * step(count=False))
            counter.take()
    nb = len(opt.second_moments())
    if nb != BUCKETS[model]:
        raise RuntimeError(f"{algorithm} cut {model} into {nb} buckets, expected {BUCKETS[model]}")
    kinds = {}
    for k, rows in counted.items():
        # the first of its kind binds buffers and caches; with DDP's hook a bucket's first compressed sync
        # runs a step before its first compressed update (the hook runs in backward, before the switch), so
        # the first two are left out where there are more
        rows = rows[2:] if len(rows) > 2 else rows[1:] or rows
        kinds[k] = {c: [r[c] for r in rows] for c in COUNTERS}
        for detail in ("kernels", "ops", "op_sites", "sites"):
            kinds[k][detail] = rows[-1][detail]
        kinds[k]["host_ms"] = times.get(k, [])
    return {"model": model, "algorithm": algorithm, "world": world, "sync": "step" if world == 1 else sync,
            "tensors": len(params), "buckets": nb,
            "params": sum(p.numel() for p in params), "bucket_cap_mb": cap_mb, "kinds": kinds}


# -- two ranks -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(jobs: list[dict[str, Any]], world: int, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``jobs`` (keyword arguments of :func:`measure`) on ``world`` gloo ranks forked from this process
    (which has imported torch and the package: call it before this process runs any threads); returns
    rank 0's results, with ``ranks_differ`` listing the counters another rank counted otherwise. Every
    rank is killed if they are not all done within ``timeout_s``, and as soon as one fails."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu_host_path"))
    try:
        ctx = multiprocessing.get_context("fork")
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(jobs, str(tmp), r, world, port, timeout_s), daemon=True)
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            # until all are done, one fails (the others would wait for it until gloo's timeout) or time is up
            while (time.monotonic() < deadline and any(p.is_alive() for p in procs)
                   and not any(p.exitcode for p in procs)):
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            logs = {r: (tmp / f"rank{r}.log").read_text()[-3000:] for r in failed}
            raise RuntimeError(f"rank(s) {failed} failed (exit {[procs[r].exitcode for r in failed]}):\n"
                               + "\n".join(f"--- rank {r} ---\n{log}" for r, log in logs.items()))
        results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for i, res in enumerate(results[0]):
        res["ranks_differ"] = sorted({c for other in results[1:] for k, v in res["kinds"].items() for c in COUNTERS
                                      if other[i]["kinds"].get(k, {}).get(c) != v[c]})
    return results[0]


def _rank_main(jobs: list[dict[str, Any]], tmp: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    """A rank of :func:`run_ranks`: every job, then its results into ``tmp`` (its output into a log there)."""
    import datetime

    import torch.distributed as dist

    log = open(Path(tmp) / f"rank{rank}.log", "w")  # noqa: SIM115 - the process's own stdout and stderr
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        results = [measure(**job) for job in jobs]
    finally:
        dist.destroy_process_group()
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(results))


# -- the tables ------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:.1f}"


def _cell(values: list[float], per: int = 1) -> str:
    lo_, hi = min(values) / per, max(values) / per
    return _fmt(lo_) if lo_ == hi else f"{_fmt(lo_)}-{_fmt(hi)}"


def table(results: list[dict[str, Any]], algorithm: str, world: int, kind: str, sync: str,
          exchange: str = "gloo") -> str:
    """The counts of one algorithm, world size, sync path, exchanges' path and kind of step for every model, per
    step and per bucket."""
    cols = [r for r in results if r["algorithm"] == algorithm and r["world"] == world and r["sync"] == sync
            and r.get("exchange", "gloo") == exchange and kind in r["kinds"]]
    if not cols:
        return ""
    ranks = "1 rank" if world == 1 else f"{world} ranks, " + ("DDP's hook" if sync == "hook" else "step()") + (
        ", NCCL's path" if exchange == "nccl" else "")
    head = "| per step | " + " | ".join(
        f"{r['model'].upper() if r['model'] == 'mlp' else 'GPT-like'}, {ranks} ({r['tensors']} tensors, "
        f"{r['buckets']} buckets) | per bucket" for r in cols) + " |"
    lines = [f"{algorithm}, {ranks}, {kind} steps", "", head, "|---|" + "---|---|" * len(cols)]
    for c, label in ROWS:
        cells = [f"{_cell(r['kinds'][kind][c])} | {_cell(r['kinds'][kind][c], r['buckets'])}" for r in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for r in cols:
        ms = r["kinds"][kind]["host_ms"]
        cells.append(f"{min(ms):.2f} / {statistics.median(ms):.2f} ms | " if ms else "- | ")
    lines.append("| host CPU time, kernels stubbed (min / median) | " + " | ".join(cells) + " |")
    differ = sorted({c for r in cols for c in r.get("ranks_differ", [])})
    if differ:
        lines.append(f"\nrank 0's counts; another rank counted {', '.join(differ)} otherwise")
    return "\n".join(lines) + "\n"


def details(results: list[dict[str, Any]], what: str) -> str:
    """Per measurement and kind of step: kernels launched, and the ``what`` (``ops`` or ``sites``) counted."""
    lines = []
    for r in results:
        for k, v in r["kinds"].items():
            items = sorted(v[what].items(), key=lambda kv: (-kv[1], kv[0]))
            path = ", NCCL's path" if r.get("exchange") == "nccl" else ""
            lines.append(f"{r['algorithm']} {r['model']} world {r['world']} ({r['sync']}{path}) {k}: kernels "
                         f"{dict(sorted(v['kernels'].items()))}")
            lines += [f"    {n:4d}  {name}" for name, n in items]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", nargs="+", default=["OnebitAdam"], choices=ALGORITHMS)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2], choices=[1, 2, 3, 4])
    ap.add_argument("--sync", nargs="+", default=["hook"], choices=["hook", "step"],
                    help="with several ranks: the compressed sync in DDP's hook (policy 'raise', the default) "
                         "and/or in step() (policy 'skip', the strategies' default)")
    ap.add_argument("--exchange", nargs="+", default=["gloo"], choices=["gloo", "nccl"],
                    help="with several ranks: the exchanges' path for CPU tensors on gloo (the default) and/or the "
                         "one a GPU's NCCL group takes (see the module docstring)")
    ap.add_argument("--steps", type=int, default=4, help="counted steps after the warm-up (default 4; the first "
                                                          "two of each kind are left out where there are more)")
    ap.add_argument("--timed", type=int, default=10, help="steps timed after the counted ones (default 10)")
    ap.add_argument("--full", action="store_true", help="the 17M-parameter MLP and a 5M GPT-like model")
    ap.add_argument("--ops", action="store_true", help="also list the torch ops of a step by name and package line")
    ap.add_argument("--sites", action="store_true", help="also list the package lines of the copies and reads")
    ap.add_argument("--json", metavar="PATH", help="also write every count to PATH (JSON)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks may take (default 600)")
    ap.add_argument("--out", metavar="PATH", help="also write the output to PATH")
    args = ap.parse_args(argv)
    from numba import config as numba_config

    if not numba_config.ENABLE_CUDASIM:
        ap.error("needs numba's CUDA simulator: NUMBA_ENABLE_CUDASIM=1 before numba is imported (running the "
                 "script sets it)")
    torch.set_num_threads(1)
    size = "full" if args.full else "small"
    load = os.getloadavg()
    jobs = [{"model": m, "algorithm": a, "size": size, "steps": args.steps, "timed": args.timed}
            for a in args.algorithm for m in args.models]
    with tee_stdout(args.out):
        print(header("gpu_host_path.py", argv, extra="numba CUDA simulator, kernels stubbed, cuda backend on CPU "
                                                       "tensors"), end="")
        results = []
        for world in sorted(args.world, reverse=True):  # the ranks fork before this process runs threads
            if world == 1:
                results += [measure(**job, world=1) for job in jobs]
            else:
                results += run_ranks([dict(job, world=world, sync=sync, exchange=exchange) for exchange in args.exchange
                                      for sync in args.sync for job in jobs], world, args.timeout)
        for r in {r["model"]: r for r in results}.values():
            print(f"{r['model']}: {r['tensors']} tensors, {r['params']} parameters, {r['buckets']} buckets "
                  f"(bucket_cap_mb={r['bucket_cap_mb']:.4f})")
        print()
        for a in args.algorithm:
            kinds = dict.fromkeys(k for r in results if r["algorithm"] == a for k in r["kinds"])
            for world in args.world:
                for exchange in ["gloo"] if world == 1 else args.exchange:
                    for sync in ["step"] if world == 1 else args.sync:
                        for k in kinds:
                            text = table(results, a, world, k, sync, exchange)
                            if text:
                                print(text)
        if args.ops:
            print(details(results, "op_sites"))
        if args.sites:
            print(details(results, "sites"))
        print(load_text(load, os.getloadavg()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

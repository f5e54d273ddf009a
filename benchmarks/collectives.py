"""Benchmark fp32 ``all_reduce`` against the 1-bit and 8-bit compressed allreduce on emulated slow links.

Why: compression only pays off when the link, not the CPU, is the bottleneck. Without a real
network between machines, each node runs in its own network namespace behind a ``tc tbf``-shaped
veth (``benchmarks/netns_cluster.py``; ``docs/design/cluster.md``, "Emulated cluster benchmarks"), with one
``torchrun`` per namespace. For every (nodes, rate, size, method) we report the median wall time per
call after warm-up, the bytes that actually crossed each node's link per call (interface counters)
next to the bytes the allreduce object says it sent, and fp32-time / compressed-time ratios.
Absolute times on small shared machines are noisy; compare ratios inside one run.

Usage (as root)::

    python benchmarks/collectives.py --quick                    # smaller grid: 1M and 25M elements
    python benchmarks/collectives.py --methods fp32 --nodes 2 --rates 1gbit --sizes 25M
    python benchmarks/collectives.py --out collectives.md       # full grid, also written to collectives.md

The same file is the worker: the driver runs it under torchrun with ``--worker``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import (
    add_out_argument,
    emit_tagged,
    header,
    load_text,
    parse_tagged,
    read_link_counter,
    repo_on_path,
    require_root,
    write_out,
)
from netns_cluster import EmulatedCluster, cleanup_stale, parse_rate, report_failures, run_torchrun

repo_on_path()  # lightning_onebit from this checkout, also when it is not installed

RESULT_TAG = "LOBRESULT "
METHODS = ("fp32", "onebit", "onebit_serial", "onebit_ring", "int8", "int8_ring", "wire1bit", "onebit_hier",
           "int8_hier")
PAIR = ("pair_oneway", "pair_bothways", "pair_duplex")
"""Diagnostics outside the default grid: d/8 bytes between ranks 0 and 1 by send/recv, one way, or both ways at
once (isend + irecv) on one connection, or on two (the way back on the default group's duplex twin). Each stage
of the two-stage collective sends both ways at once."""
DUPLEX = ("wire1bit_duplex", "onebit_simplex", "int8_simplex")
"""Also outside the default grid, for the ratio of the duplex exchanges (``comm.duplex``; the worker gives the
default group a twin, as the package's strategies do, so ``onebit`` and ``int8`` use it): ``wire1bit``'s bytes
sent duplex, and the compressed allreduces without the twin (``duplex=False``: gloo's collectives)."""
COMPRESSED = ("onebit", "onebit_serial", "onebit_ring", "int8", "int8_ring", "onebit_hier", "int8_hier",
              "onebit_simplex", "int8_simplex")
HIER = ("onebit_hier", "int8_hier")
"""Two-level methods (fp32 inside a node, compressed between nodes): they need ``--ranks-per-node`` >= 2."""
METHOD_LABEL = {"fp32": "fp32 all_reduce", "onebit": "1-bit EF (SignCodec l2)",
                "onebit_serial": "1-bit EF, not pipelined (pieces=1)", "int8": "8-bit (MinMaxUInt8)",
                "onebit_ring": "1-bit EF, server rows by gloo's ring all_gather", "int8_ring": "8-bit, ring all_gather",
                "wire1bit": "1-bit bytes only (no codec), gloo's collectives",
                "wire1bit_duplex": "1-bit bytes only (no codec), duplex", "onebit_hier": "1-bit EF, two-level",
                "int8_hier": "8-bit, two-level", "pair_oneway": "d/8 bytes rank 0 -> 1 (send/recv)",
                "pair_bothways": "d/8 bytes each way at once (isend + irecv)",
                "pair_duplex": "d/8 bytes each way at once, one connection each way",
                "onebit_simplex": "1-bit EF, gloo's collectives (no duplex twin)",
                "int8_simplex": "8-bit, gloo's collectives (no duplex twin)"}
FULL = {"nodes": [2, 4], "rates": ["1gbit", "10gbit"], "sizes": ["1M", "25M", "100M"], "iters": 5,
        "warmup": 2, "ranks_per_node": [1]}
QUICK = {"nodes": [2, 4], "rates": ["1gbit", "10gbit"], "sizes": ["1M", "25M"], "iters": 3, "warmup": 1,
         "ranks_per_node": [1]}


def parse_size(text: str) -> int:
    """'1M' -> 1_000_000 elements (decimal suffixes k/M/G, so '25M' fp32 is 100 MB)."""
    text = text.strip()
    mult = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def fmt_size(numel: int) -> str:
    """Inverse of ``parse_size`` for table labels."""
    for suffix, mult in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if numel >= mult and numel % mult == 0:
            return f"{numel // mult}{suffix}"
    return str(numel)


# ---------------------------------------------------------------------------------------------------------
# worker side (runs inside a namespace under torchrun)
# ---------------------------------------------------------------------------------------------------------


def _make_op(method: str, world: int, ranks_per_node: int = 1,
             node_groups: tuple[Any, Any] | None = None) -> tuple[Callable[[Any], Any], Callable[[], int], str]:
    """Return (op(x) -> mean, inter-node bytes counter(), description) for ``method``.

    The counter counts what this rank sends *between nodes*: the flat calls' rows to ranks of other
    nodes (with one rank per node: all of them), the two-level calls' shard collective.
    """
    import torch
    import torch.distributed as dist

    if method == "fp32":
        buf: dict[str, Any] = {}

        def fp32(x: Any) -> Any:
            out = buf.get("out")
            if out is None or out.numel() != x.numel():
                out = buf["out"] = x.clone()
            else:
                out.copy_(x)
            dist.all_reduce(out)
            return out.div_(world)

        # gloo has no byte counter; count what its ring allreduce must send: 2 (n-1)/n * 4 d.
        sent = {"n": 0}

        def fp32_counted(x: Any) -> Any:
            # a ring's 2 (n-1) chunks of d/n leave a node through its link twice per node boundary
            sent["n"] += int(2 * (world - 1) / world * 4 * x.numel() / ranks_per_node)
            return fp32(x)

        return fp32_counted, lambda: sent["n"], "torch.distributed.all_reduce (gloo); counted = ring formula"
    if method in ("wire1bit", "wire1bit_duplex"):
        return _wire1bit_op(world, ranks_per_node, duplex=method == "wire1bit_duplex")
    if method in PAIR:
        return _pair_op(method)
    from lightning_onebit.comm import CompressedAllreduce, HierarchicalAllreduce
    from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec
    from lightning_onebit.compress.kernels import resolve_backend_name

    pieces, gather, duplex = None, "auto", True  # automatic pipeline and gather
    if method.endswith("_simplex"):
        method, duplex = method[: -len("_simplex")], False
    if method.endswith("_ring"):  # the server rows by gloo's ring all_gather, for the ratio
        method, gather = method[: -len("_ring")], "ring"
    if method in ("onebit", "onebit_hier"):
        codec, mode = SignCodec("l2"), "error_feedback"
    elif method == "onebit_serial":  # the same collective without the pipeline, for the ratio
        codec, mode, pieces = SignCodec("l2"), "error_feedback", 1
    elif method in ("int8", "int8_hier"):
        codec, mode = MinMaxUInt8Codec(), "plain"
    else:
        raise ValueError(f"unknown method {method!r}")
    backend = resolve_backend_name(torch.device("cpu"), codec.backend)
    car: Any
    if method in HIER:
        if node_groups is None:
            raise ValueError(f"{method} needs --ranks-per-node >= 2")
        car = HierarchicalAllreduce(codec, mode, local_group=node_groups[0], cross_group=node_groups[1],
                                    pieces=pieces)
        counter = car.counter.total  # the shard collective between nodes; the fp32 inside is not counted
        inter = 1.0
        desc = (f"HierarchicalAllreduce({codec!r}, mode={mode!r}, {ranks_per_node} ranks per node), kernels: "
                f"{backend}, out= preallocated")
    else:
        car = CompressedAllreduce(codec, mode=mode, group=None, pieces=pieces, gather=gather, duplex=duplex)
        counter = car.counter.total
        # of a rank's rows to its n-1 peers, those to the n-L ranks of other nodes cross a link
        inter = (world - ranks_per_node) / (world - 1)
        desc = (f"CompressedAllreduce({codec!r}, mode={mode!r}, pieces={pieces}, gather={gather!r}, "
                f"duplex={duplex}), "
                f"kernels: {backend}, out= preallocated")
    outs: dict[int, Any] = {}

    def op(x: Any) -> Any:
        # a persistent output buffer, as the optimizers use: a fresh 100 MB tensor per call
        # would time first-touch page faults, not the collective
        if x.numel() not in outs:
            outs[x.numel()] = torch.empty(x.numel(), dtype=torch.float32)
        return car(x, out=outs[x.numel()])

    return op, lambda: int(counter.bytes_sent * inter), desc


def _wire1bit_op(world: int, ranks_per_node: int = 1, *,
                 duplex: bool = False) -> tuple[Callable[[Any], Any], Callable[[], int], str]:
    """The two exchanges of the 1-bit scheme on d/8 bytes of uint8, without encoding or decoding (the server
    rows gathered as ``CompressedAllreduce`` gathers them: fanned out on gloo).

    A lower bound for the 1-bit allreduce: what is left of its time is codec (CPU) cost. Same
    pattern as the compressed allreduce (``docs/design/dataflow.md``, "Data flow of one bucket"):
    ``all_to_all_single`` of the chunks, then ``all_gather`` of the server chunks (scales omitted:
    a few bytes); with ``duplex`` both as ``exchange_rows`` on the default group and its twin, as the
    compressed allreduce sends them where the group has one.
    """
    import torch
    import torch.distributed as dist

    from lightning_onebit.comm.dense import all_gather_rows
    from lightning_onebit.comm.duplex import duplex_twin, exchange_rows

    twin = duplex_twin() if duplex else None
    if duplex and twin is None:
        raise RuntimeError("wire1bit_duplex: the default group has no duplex twin")

    bufs: dict[str, Any] = {}
    sent = {"n": 0}

    def op(x: Any) -> Any:
        chunk = -(-x.numel() // (8 * world))  # bytes per server chunk, rounded up
        if bufs.get("chunk") != chunk:
            bufs.update(chunk=chunk, send=torch.zeros(world * chunk, dtype=torch.uint8),
                        recv=torch.empty(world * chunk, dtype=torch.uint8),
                        out=torch.empty(world * chunk, dtype=torch.uint8),
                        fan=torch.empty(world, chunk, dtype=torch.uint8))  # the gather's copies, if fanned out
        if twin is not None:
            exchange_rows(bufs["recv"].view(world, chunk), bufs["send"].view(world, chunk), twin=twin)
        else:
            dist.all_to_all_single(bufs["recv"], bufs["send"])
        all_gather_rows(bufs["out"].view(world, chunk), bufs["recv"][:chunk], send=bufs["fan"], twin=twin)
        sent["n"] += 2 * (world - ranks_per_node) * chunk  # the rows to other nodes' ranks
        return bufs["out"]

    how = "exchange_rows (duplex)" if duplex else "all_to_all_single + all_gather_rows"
    return op, lambda: sent["n"], f"{how} of d/8 uint8 bytes"


def _pair_op(method: str) -> tuple[Callable[[Any], Any], Callable[[], int], str]:
    """d/8 uint8 bytes from rank 0 to rank 1, and unless ``pair_oneway`` from rank 1 to rank 0 at the same time
    (see :data:`PAIR`); the other ranks send nothing."""
    import torch
    import torch.distributed as dist

    from lightning_onebit.comm.duplex import duplex_twin

    both = method != "pair_oneway"
    back = duplex_twin() if method == "pair_duplex" else None  # rank 1 -> 0 on its own connection
    if method == "pair_duplex" and back is None:
        raise RuntimeError("pair_duplex: the default group has no duplex twin")

    bufs: dict[str, Any] = {}
    sent = {"n": 0}

    def op(x: Any) -> Any:
        n = -(-x.numel() // 8)
        if bufs.get("n") != n:
            bufs.update(n=n, send=torch.zeros(n, dtype=torch.uint8), recv=torch.empty(n, dtype=torch.uint8))
        rank = dist.get_rank()
        if rank > 1:
            return None
        if both:
            to, fro = (None, back) if rank == 0 else (back, None)
            works = [dist.isend(bufs["send"], 1 - rank, group=to), dist.irecv(bufs["recv"], 1 - rank, group=fro)]
            for w in works:
                w.wait()
        elif rank == 0:
            dist.send(bufs["send"], 1)
        else:
            dist.recv(bufs["recv"], 0)
        sent["n"] += n if both or rank == 0 else 0
        return bufs["recv"]

    how = {"pair_oneway": "", "pair_bothways": ", both ways", "pair_duplex": ", both ways, one connection each"}
    return op, lambda: sent["n"], "d/8 uint8 bytes by send/recv between ranks 0 and 1" + how[method]


def worker(args: argparse.Namespace) -> None:
    """Time every (size, method) on this cluster; rank 0 prints one JSON line per measurement."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    from lightning_onebit.comm import enable_duplex

    enable_duplex()  # as the package's strategies do; the *_simplex methods and wire1bit do without
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    methods = args.methods
    L = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    groups = None
    if L > 1:
        from lightning_onebit.comm import node_groups

        groups = node_groups(L)  # collective: every rank, once
    for numel in [parse_size(s) for s in args.sizes]:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(numel, generator=gen)
        exact = None
        if any(m in COMPRESSED for m in methods):  # reference mean for the sanity column (untimed)
            exact = x.clone()
            dist.all_reduce(exact)
            exact.div_(world)
        for method in methods:
            op, counter, desc = _make_op(method, world, L, groups)
            rel_err = float("nan")
            for i in range(args.warmup):
                y = op(x)
                if i == 0 and exact is not None and method in COMPRESSED:  # no error-feedback state yet
                    rel_err = float((y - exact).norm() / exact.norm())
            times = []
            counted0 = counter()
            # Counter window = whole loop up to a final barrier: a rank's op can return while its last
            # bytes still sit in its socket buffer / tbf queue (veth counts them only on dequeue), so
            # per-call windows would undercount. The barriers add a few hundred bytes per iteration.
            dist.barrier()
            tx0, rx0 = read_link_counter(iface, "tx_bytes"), read_link_counter(iface, "rx_bytes")
            for _ in range(args.iters):
                if args.idle:  # a training step's compute between bursts: the link goes idle
                    time.sleep(args.idle)
                dist.barrier()  # start together
                t0 = time.perf_counter()
                op(x)
                times.append(time.perf_counter() - t0)
            dist.barrier()
            tx, rx = read_link_counter(iface, "tx_bytes") - tx0, read_link_counter(iface, "rx_bytes") - rx0
            counted = counter() - counted0
            mine = {"times": times, "tx": tx, "rx": rx, "counted": counted, "rel_err": rel_err}
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, mine)
            if rank == 0:
                # a call is done when the slowest rank is done
                per_iter = [max(r["times"][i] for r in everyone) for i in range(args.iters)]
                row = {
                    "nodes": world // L, "ranks_per_node": L, "rate": args.rate, "numel": numel,
                    "method": method, "desc": desc,
                    "median_s": statistics.median(per_iter), "min_s": min(per_iter), "max_s": max(per_iter),
                    "iters": args.iters,
                    "link_tx_per_call": statistics.mean(r["tx"] for r in everyone) / args.iters,
                    "link_rx_per_call": statistics.mean(r["rx"] for r in everyone) / args.iters,
                    # the ranks of a node share its link: bytes per node
                    "counted_per_call": statistics.mean(r["counted"] for r in everyone) * L / args.iters,
                    "rel_err": max(r["rel_err"] for r in everyone),
                    "rtt_ms": args.rtt, "idle_s": args.idle, "slow_start_after_idle": args.ssai,
                }
                emit_tagged(RESULT_TAG, row)
            del op
        del x, exact
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# driver side (root namespace, as root)
# ---------------------------------------------------------------------------------------------------------


def estimate_timeout(
    nodes: int, rate: str, sizes: Sequence[int], methods: Sequence[str], calls: int, ranks_per_node: int = 1
) -> float:
    """Generous wall-clock limit for one torchrun: 3x (fp32 wire time + codec CPU time) + startup.

    Only there so that a wedged run is killed instead of hanging the benchmark forever. Codec CPU time
    is budgeted at 100 ns per element per compressed method per call, times nodes/2 (the nodes share
    2 cores); the fp32 reference mean costs one more fp32 allreduce per size.
    """
    bps = parse_rate(rate)
    n_codec = sum(m in COMPRESSED for m in methods)
    wire = sum(2 * (nodes - 1) / nodes * 4 * d * 8 / bps for d in sizes)
    cpu = sum(n_codec * d * 100e-9 * max(1.0, nodes * ranks_per_node / 2) for d in sizes)
    return 120.0 + 3.0 * (calls * (wire + cpu) + wire)


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One cluster per node count, re-shaped for each rate; one torchrun per (nodes, ranks per node, rate).

    The two-level methods run only where a node has several ranks."""
    cleanup_stale()
    rows: list[dict[str, Any]] = []
    sizes = [parse_size(s) for s in args.sizes]
    port = 29500
    for nodes in args.nodes:
        with EmulatedCluster(nodes, rate=args.rates[0]) as cluster:
            if args.rtt:
                cluster.set_delay(args.rtt)
            for L, ssai in itertools.product(args.ranks_per_node, args.slow_start_after_idle or [None]):
                if ssai is not None:
                    cluster.set_slow_start_after_idle(bool(ssai))
                methods = [m for m in args.methods if L > 1 or m not in HIER]
                if not methods:
                    continue
                what = f"{nodes} nodes x {L} ranks" if L > 1 else f"{nodes} nodes"
                if ssai is not None:
                    what += f", slow start after idle {ssai}"
                for rate in args.rates:
                    cluster.set_rate(rate)
                    timeout = args.timeout or estimate_timeout(
                        nodes, rate, sizes, methods, args.iters + args.warmup + 2, L) + args.iters * args.idle
                    wargs = ["--worker", "--rate", rate, "--rtt", str(args.rtt), "--idle", str(args.idle),
                             "--ssai", str(ssai), "--iters", str(args.iters), "--warmup",
                             str(args.warmup), "--pg-timeout", str(int(timeout)), "--sizes", *args.sizes,
                             "--methods", *methods]
                    print(f"[{what}, {rate}] running (timeout {timeout:.0f} s) ...", file=sys.stderr, flush=True)
                    t0 = time.monotonic()
                    tx0 = [cluster.tx_bytes(k) for k in range(nodes)]
                    results = run_torchrun(cluster, str(Path(__file__).resolve()), wargs, master_port=port,
                                           timeout=timeout, nproc_per_node=L)
                    port += 1
                    total_tx = sum(cluster.tx_bytes(k) - tx0[k] for k in range(nodes))
                    got = parse_tagged(results[0].stdout, RESULT_TAG)
                    rows.extend(got)
                    print(f"[{what}, {rate}] {len(got)} results in {time.monotonic() - t0:.0f} s, "
                          f"{total_tx / 1e6:.0f} MB sent on all links", file=sys.stderr, flush=True)
                    report_failures(results, f"{what} at {rate}", keep_going=args.keep_going)
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f}" if nbytes < 1e6 else f"{nbytes / 1e6:.1f}"


def _grid_key(r: dict[str, Any] | tuple[int, int, str, int]) -> tuple[int, int, float, int]:
    """Sort key (nodes, ranks per node, rate in bit/s, numel): '10gbit' must come after '1gbit'."""
    nodes, L, rate, numel = ((r["nodes"], r.get("ranks_per_node", 1), r["rate"], r["numel"])
                             if isinstance(r, dict) else r)
    return nodes, L, parse_rate(rate), numel


def _layout(nodes: int, L: int) -> str:
    return f"{nodes} x {L}" if L > 1 else str(nodes)


def _err(value: float) -> str:
    return "-" if value != value else f"{value:.3g}"  # NaN: fp32 has no compression error to report


def _cell(times: dict[str, float], method: str) -> str:
    return f"{times[method]:.4f}" if method in times else "-"


def _ratio(times: dict[str, float], method: str, base: str = "fp32") -> str:
    return f"{times[base] / times[method]:.1f}x" if method in times and base in times else "-"


def tables(rows: list[dict[str, Any]]) -> str:
    """Markdown: one detail table, one speedup table (fp32 time / compressed time) and, for nodes of
    several ranks, flat against two-level (time and bytes between nodes)."""
    order = {m: i for i, m in enumerate(("fp32", "wire1bit", "wire1bit_duplex", "onebit", "onebit_simplex",
                                         "onebit_serial", "onebit_ring", "onebit_hier", "int8", "int8_simplex",
                                         "int8_ring", "int8_hier"))}
    rows = sorted(rows, key=lambda r: (*_grid_key(r), order.get(r["method"], 9)))
    by_key: dict[tuple[int, int, str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["nodes"], r.get("ranks_per_node", 1), r["rate"], r["numel"]), {})[r["method"]] = r
    lines = [
        "| nodes (x ranks) | rate | numel | method | median s | min-max s | link tx MB/call/node | "
        "counted inter-node MB/call/node | rel err (1st call) | fp32 / this |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        L = r.get("ranks_per_node", 1)
        times = {m: x["median_s"] for m, x in by_key[(r["nodes"], L, r["rate"], r["numel"])].items()}
        label = METHOD_LABEL.get(r["method"], r["method"])
        lines.append(
            f"| {_layout(r['nodes'], L)} | {r['rate']} | {fmt_size(r['numel'])} | {label} | {r['median_s']:.4f} | "
            f"{r['min_s']:.4f}-{r['max_s']:.4f} | {_mb(r['link_tx_per_call'])} | "
            f"{_mb(r['counted_per_call'])} | {_err(r['rel_err'])} | {_ratio(times, r['method'])} |"
        )
    grid = sorted(by_key.items(), key=lambda kv: _grid_key(kv[0]))
    flat = [(k, {m: x["median_s"] for m, x in v.items()}) for k, v in grid if k[1] == 1]
    if any(len(t) > 1 and "fp32" in t for _, t in flat):
        lines += ["", "| nodes | rate | numel | fp32 s | 1-bit s | 8-bit s | 1-bit bytes only s | "
                  "fp32/1-bit | fp32/8-bit | fp32/1-bit bytes only |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for (nodes, _, rate, numel), t in flat:
            lines.append(f"| {nodes} | {rate} | {fmt_size(numel)} | {_cell(t, 'fp32')} | "
                         f"{_cell(t, 'onebit')} | {_cell(t, 'int8')} | {_cell(t, 'wire1bit')} | "
                         f"{_ratio(t, 'onebit')} | {_ratio(t, 'int8')} | {_ratio(t, 'wire1bit')} |")
    multi = [(k, v) for k, v in grid if k[1] > 1]
    if multi:
        lines += ["", "Flat vs two-level on nodes of several ranks (inter-node bytes: each node's link counter):", "",
                  "| nodes x ranks | rate | numel | codec | fp32 s | flat s | two-level s | flat / two-level time | "
                  "flat MB/call/node | two-level MB/call/node | flat / two-level bytes | fp32 / two-level |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (nodes, L, rate, numel), v in multi:
            t = {m: x["median_s"] for m, x in v.items()}
            for name, fl, hi in (("1-bit", "onebit", "onebit_hier"), ("8-bit", "int8", "int8_hier")):
                if fl not in v or hi not in v:
                    continue
                bf, bh = v[fl]["link_tx_per_call"], v[hi]["link_tx_per_call"]
                lines.append(f"| {nodes} x {L} | {rate} | {fmt_size(numel)} | {name} | {_cell(t, 'fp32')} | "
                             f"{_cell(t, fl)} | {_cell(t, hi)} | {_ratio(t, hi, fl)} | {_mb(bf)} | {_mb(bh)} | "
                             f"{bf / bh:.2f}x | {_ratio(t, hi)} |")
    descs = {r["method"]: r["desc"] for r in rows}
    lines += ["", *(f"- {METHOD_LABEL.get(m, m)}: `{d}`" for m, d in descs.items())]
    return "\n".join(lines)


def grouped_tables(rows: list[dict[str, Any]]) -> str:
    """``tables`` per condition (round trip, idle between calls, slow start after idle), each under a heading
    where any of them is set."""
    groups: dict[tuple[float, float, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("rtt_ms", 0.0), r.get("idle_s", 0.0), str(r.get("slow_start_after_idle"))),
                          []).append(r)
    parts = []
    for (rtt, idle, ssai), group in groups.items():
        if (rtt, idle, ssai) != (0.0, 0.0, "None"):
            ssai_text = "kernel default" if ssai == "None" else ssai
            parts.append(f"### round trip {rtt:g} ms, {idle:g} s idle before each call, "
                         f"tcp_slow_start_after_idle {ssai_text}")
        parts.append(tables(group))
    return "\n\n".join(parts)


SETUP = ("Each node is a network namespace behind a tc-tbf shaped veth (both directions); one torchrun per "
         "node, gloo, 1 thread per process. Times: median over iterations of the slowest rank, after warm-up. "
         "Link bytes: tx counter of each node's veth (frames incl. TCP/IP headers and ACKs, and a barrier per "
         "call), per call and node (the ranks of a node share its link). Counted bytes: the inter-node share of "
         "what the collective counts, per node (flat: the rows to other nodes' ranks; two-level: the shard "
         "collective; fp32: ring formula 2(n-1)/n*4d per node). Nodes of several ranks (--ranks-per-node): "
         "one torchrun per node starts them; they reach each other over the node's loopback, unshaped. "
         "Compare ratios, not absolute times.")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags; run as worker under torchrun (``--worker``) or as the driver that builds clusters."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smaller grid: {QUICK} (explicit flags still override)")
    ap.add_argument("--nodes", type=int, nargs="+", help=f"default {FULL['nodes']}")
    ap.add_argument("--rates", nargs="+", help=f"tc rates, default {FULL['rates']}")
    ap.add_argument("--sizes", nargs="+", help=f"fp32 elements (k/M/G decimal), default {FULL['sizes']}")
    ap.add_argument("--methods", nargs="+", choices=METHODS + PAIR + DUPLEX,
                    help=f"default {list(METHODS)} ({PAIR + DUPLEX}: diagnostics, only when named)")
    ap.add_argument("--ranks-per-node", type=int, nargs="+",
                    help="ranks per emulated node (default 1); >= 2 adds the two-level methods")
    ap.add_argument("--iters", type=int, help="timed iterations (median reported)")
    ap.add_argument("--rtt", type=float, default=0.0, help="round-trip delay in ms between nodes")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="seconds of sleep before each timed call, as a step's compute leaves the link idle")
    ap.add_argument("--slow-start-after-idle", type=int, nargs="+", choices=(0, 1),
                    help="run with the nodes' net.ipv4.tcp_slow_start_after_idle at each value "
                         "(default: the kernel's, on)")
    ap.add_argument("--warmup", type=int, help="untimed iterations first (>= 1; numba compiles here)")
    ap.add_argument("--timeout", type=float, help="seconds per torchrun (default: estimated)")
    ap.add_argument("--json", metavar="PATH", help="also write the raw rows as JSON")
    ap.add_argument("--keep-going", action="store_true", help="continue after a failed torchrun")
    add_out_argument(ap)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", help=argparse.SUPPRESS)
    ap.add_argument("--ssai", default="None", help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=int, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for name in ("nodes", "rates", "sizes", "iters", "warmup", "ranks_per_node"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.warmup = max(1, args.warmup)
    args.methods = args.methods or list(METHODS)
    if args.worker:
        worker(args)
        return 0

    if not require_root():
        return 2
    load0 = os.getloadavg()
    rows = run_grid(args)
    load = load_text(load0, os.getloadavg())
    print(load, file=sys.stderr)
    text = grouped_tables(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        write_out(args.out, "# Collectives, emulated links\n\n"
                  + header("collectives.py", argv, f"{load}\n\n{SETUP}") + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

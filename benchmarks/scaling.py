"""Cost model of a compression-phase training step, from the emulated nodes to cluster scale.

Predicts the step time of DDP (fp32 ring allreduce), flat 1-bit Adam (the two-stage compressed
allreduce over all ``n = N L`` ranks) and hierarchical 1-bit Adam (fp32 inside a node, the
two-stage collective between nodes) on ``N`` nodes of ``L`` ranks, from the link rate and latency,
the model size ``d`` and the compute time ``c`` of a step. Byte counts come from the package's own
formulas (``ring_allreduce_bytes``, ``TwoStageRank.bytes_per_call``, ``shard_groups`` and
``_intra_node_bytes`` of the two-level call); codec costs from this repository's kernel
measurements. The script checks the model against the emulated-cluster measurements and against
the 1-bit Adam paper's BERT-Large headline, then prints the 8-256 GPU table.

Model, per bucket of ``b`` elements (a step sums its buckets)::

    B        goodput of a node's link, each direction: rate x efficiency; alpha: latency per message
    DDP      T = 2 (n-1) alpha + ring_allreduce_bytes(b, n, g) / min(B, stream cap)
             (node-aware ring: a node's link carries one rank's ring traffic, 2 (n-1)/n g b)
    flat     T = o + (2k+1)(n-1) alpha + pipe(W, X, k)
             W = max(L 2 (n-L) row(b, n) / B,  2 (L-1) row(b, n) / B_intra)
             X = [b (20 + 1/8) + (b/n)(24 + (n+1)/8) + b (4 + 1/8)] / B_codec
    hier     T = o + (n-1) alpha + 2k (N-1) alpha + I / B_intra + M / B_codec + pipe(W', X', k)
             s = ceil(b / L), I = _intra_node_bytes(L, s) = 2 (L-1) 4 s, M = (20 L + 20) s + 16 b
             W' = L 2 (N-1) row(s, N) / B, X' = X of s elements among N ranks
    pipe(W, X, k) = max(W, X) + min(W, X) / k  where the k pieces can overlap wire and codec, else W + X
    step     DDP: c + max(0, T - omega c);  compressed: c + T (the package's hook is synchronous)

``row(b, m)`` is one packed row of the two-stage call (codes + scales; ``2 (m-1) row`` is
``bytes_per_call``); ``o`` the fixed host cost of a call (dispatch, the agreement round's host
wait); ``k`` the pipeline pieces as the package cuts them (one on a GPU). The codec bytes are the
memory traffic of the kernels' passes per element: worker encode with error feedback 20 B (scale
pass reads input and error, encode pass reads both and writes the error) + the codes; server step
24 B (decode the mean: write 4 B, scale pass: read 8 B, encode: read 8 B, write 4 B) + the n rows'
codes; decode 4 B + the codes. The node mean of the two-level call sums in fp64
(``_node_mean``: 20 B per row and shard element, + 20 B), and the call copies its input in and its
result out (16 B per element). Warm-up steps are DDP steps: end to end, ``1 / (f + (1 - f) / s)``
for a compression-phase speedup ``s`` and a warm-up fraction ``f`` of the steps; volume likewise
with the per-rank byte ratio.

    python benchmarks/scaling.py [--out PATH] [--plot docs/scaling.png] [--calibrate]
    python benchmarks/scaling.py --params 1.5e9 --compute-s 1.0 --rates 25 100 --latency-us 20
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from _common import add_out_argument, header, tee_stdout

from lightning_onebit.comm import TwoStageRank, ring_allreduce_bytes
from lightning_onebit.comm.hierarchical import _intra_node_bytes, _shard_len, shard_groups
from lightning_onebit.comm.two_stage import MAX_PIECES, MIN_PIECE
from lightning_onebit.compress import SignCodec

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
MB = 1e6
# TCP/IPv4 with timestamps over a 1500-byte MTU: 1448 payload bytes per 1514-byte frame, and a
# 66-byte ACK per two frames taking the same direction as the other flow's data.
TCP_EFFICIENCY = 1448 / 1514 * (1 - 66 / (2 * 1514))

# -- reference data: measurements of this repository (inputs, not outputs) ------------------------------

CODEC_REF_SOURCE = ("benchmarks/RESULTS.md, 'Codec kernels (codecs.py)': run 2026-11-22 08:09 UTC, "
                    "torch 2.13.0+cpu, numba, 2 threads, commit b16419d")
# (elements, op, ms): sign-l2 rows of the numba backend; 'server x4' is the server step over 4 workers
CODEC_REF = [(16 * 2**20, "encode+EF", 8.4), (16 * 2**20, "server x4", 1.8),
             (128 * 2**20, "encode+EF", 52.6), (128 * 2**20, "server x4", 19.5)]

CALL_OVERHEAD_SOURCE = ("`scaling.py --calibrate` on the machine of benchmarks/RESULTS.md, 2026-11-23 01:35 UTC, "
                        "torch 2.14.1, load average 4 (another job running): a 1-rank CompressedAllreduce of 4096 "
                        "elements, its local stages and Python, no traffic")
CALL_OVERHEAD_CPU_S = 1.4e-3

COLLECTIVES_SOURCE = ("benchmarks/RESULTS.md, 'Compressed allreduce on emulated links (collectives.py)': runs "
                      "2026-11-22 08:07 and 08:09 UTC, torch 2.13.0+cpu, commit b16419d; seconds per call")
COLLECTIVES_REF = [  # one rank per emulated node; 1-bit: pipelined, serial: pieces=1, wire: bytes only
    dict(nodes=2, gbit=1, numel=1_000_000, fp32=0.0336, onebit=0.0057, serial=0.0036, wire=0.0008),
    dict(nodes=2, gbit=1, numel=25_000_000, fp32=0.8512, onebit=0.0544, serial=0.0803, wire=0.0361),
    dict(nodes=2, gbit=1, numel=100_000_000, fp32=3.4028, onebit=0.2022, serial=0.3311, wire=0.1350),
    dict(nodes=2, gbit=10, numel=1_000_000, fp32=0.0051, onebit=0.0044, serial=0.0044, wire=0.0007),
    dict(nodes=2, gbit=10, numel=25_000_000, fp32=0.1119, onebit=0.0439, serial=0.0444, wire=0.0070),
    dict(nodes=4, gbit=1, numel=1_000_000, fp32=0.0522, onebit=0.0156, serial=0.0155, wire=0.0100),
    dict(nodes=4, gbit=1, numel=25_000_000, fp32=1.2906, onebit=0.1133, serial=0.1143, wire=0.0517),
    dict(nodes=4, gbit=10, numel=1_000_000, fp32=0.0145, onebit=0.0132, serial=0.0145, wire=0.0082),
    dict(nodes=4, gbit=10, numel=25_000_000, fp32=0.2376, onebit=0.0994, serial=0.1043, wire=0.0118),
]

E2E_SOURCE = ("benchmarks/E2E.md (then a section of RESULTS.md), 'End-to-end training on emulated links': "
              "run 2026-11-22 08:35-08:52 UTC, torch 2.13.0+cpu, commit 03b437b; compression-phase step, seconds")
E2E_REF = [  # compute: 'compute alone' of the ideal column (an input); ddp: DDP + AdamW; onebit: onebit_adam
    dict(workload="mlp", nodes=2, gbit=1, compute=0.196, ddp=1.013, onebit=0.197),
    dict(workload="mlp", nodes=2, gbit=10, compute=0.196, ddp=0.332, onebit=0.201),
    dict(workload="mlp", nodes=4, gbit=1, compute=0.407, ddp=1.668, onebit=0.404),
    dict(workload="mlp", nodes=4, gbit=10, compute=0.407, ddp=0.689, onebit=0.498),
    dict(workload="transformer", nodes=2, gbit=1, compute=0.265, ddp=0.392, onebit=0.307),
    dict(workload="transformer", nodes=2, gbit=10, compute=0.265, ddp=0.305, onebit=0.307),
    dict(workload="transformer", nodes=4, gbit=1, compute=0.548, ddp=0.769, onebit=0.650),
    dict(workload="transformer", nodes=4, gbit=10, compute=0.548, ddp=0.626, onebit=0.667),
]

# Two-level emulations (N nodes x L ranks), one dict per cell; every key among fp32 / flat /
# hierarchical that is present is compared with its prediction. Source: benchmarks/RESULTS.md,
# "Compressed allreduce on emulated links", nodes of 2 ranks (2026-11-23, torch 2.14.1).
HIERARCHICAL_REF: list[dict] = [
    dict(nodes=2, ranks_per_node=2, gbit=1, numel=25_000_000, fp32=1.3086, flat=0.2272, hierarchical=0.4360),
    dict(nodes=2, ranks_per_node=2, gbit=0.1, numel=25_000_000, fp32=12.7102, flat=0.5664, hierarchical=0.5847),
]


def _linear(i: int, o: int) -> list[int]:
    return [o * i, o]


def _encoder_layer(d: int, ff: int) -> list[int]:  # nn.TransformerEncoderLayer's parameters, in order
    return [3 * d * d, 3 * d, d * d, d, ff * d, ff, d * ff, d, d, d, d, d]


# Parameter tensors (elements, in parameter order) of benchmarks/e2e.py's workloads: the MLP
# 1024-4096-4096-1024-10 and the encoder (vocabulary 1000, d 256, 4 layers, ff 1024, sequence 128).
WORKLOADS = {
    "mlp": _linear(1024, 4096) + _linear(4096, 4096) + _linear(4096, 1024) + _linear(1024, 10),
    "transformer": [1000 * 256, 128 * 256] + 4 * _encoder_layer(256, 1024) + _linear(256, 1000),
}

# -- the 1-bit Adam paper's BERT-Large setting ----------------------------------------------------------

PAPER = dict(
    title="Tang et al., '1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence "
          "Speed' (ICML 2021), and the DeepSpeed 1-bit Adam blog post and tutorial by the same team",
    nodes=16, ranks_per_node=4,  # 64 V100, 4 per node, 40 Gbit/s Ethernet
    params=340e6, grad_bytes=2,  # BERT-Large; mixed precision: the Adam baseline allreduces fp16 gradients
    samples_per_step=64,  # micro-batch 16 per GPU, batch 4096 over 64 GPUs: 4 micro-batches per step
    compression_speedup=6.6, end_to_end=3.3, volume=5.0, warmup_fraction=0.15, iperf_gbit=4.1,
)
V100_SAMPLES_PER_S = 200.0  # assumed BERT-Large seq-128 mixed-precision training throughput of one V100
V100_HBM_GBS = 900.0


# -- the model --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Everything the model needs besides the node count, ranks per node and link rate."""

    params: int  # d: elements synchronised per step
    compute_s: float  # c: forward + backward + update of one step on one rank
    grad_bytes: int = 4  # g: bytes per element of DDP's allreduce (4 fp32, 2 fp16)
    bucket_elems: int | None = 25 * 2**20 // 4  # elements per bucket (the optimizers' 25 MiB); None: one
    latency_s: float = 10e-6  # alpha: per message between nodes
    intra_latency_s: float = 2e-6  # per message inside a node
    efficiency: float = TCP_EFFICIENCY  # link goodput / link rate
    stream_gbit: float | None = None  # cap on one TCP stream, applied to the ring's one stream per hop
    intra_bps: float = 150e9  # bytes/s per rank inside a node (NVLink class)
    codec_bps: float = 0.5 * V100_HBM_GBS * 1e9  # bytes/s the codec passes move per rank
    call_overhead_s: float = 100e-6  # o: fixed host cost of one compressed call
    device: str = "cuda"  # "cuda": one piece per call (serial); "cpu": pieces as the package cuts them
    overlap: float = 1 / 6  # omega: fraction of the compute DDP's allreduce can hide behind
    pipeline_overlap: bool = True  # the pieces may overlap wire and codec (false: cores are oversubscribed)


def buckets(params: int, bucket_elems: int | None) -> list[int]:
    """Equal buckets of ``bucket_elems`` and the remainder (a model of the optimizer's bucketing)."""
    if bucket_elems is None or params <= bucket_elems:
        return [params]
    full, rest = divmod(params, bucket_elems)
    return [bucket_elems] * full + ([rest] if rest else [])


def optimizer_buckets(numels: Sequence[int], cap: int = 25 * 2**20 // 4) -> list[int]:
    """The optimizers' bucketing of parameter tensors (``optim/buckets.py``): reverse order, a new
    bucket when the next tensor would pass the cap (a larger tensor gets one of its own)."""
    out, size = [], 0
    for n in reversed(numels):
        if size and size + n > cap:
            out.append(size)
            size = 0
        size += n
    return out + ([size] if size else [])


@functools.cache
def _probe(numel: int, world: int, groups: tuple[int, ...] = ()) -> tuple[int, int]:
    """(padded elements, packed row bytes) of a two-stage call of ``numel`` elements among ``world`` ranks."""
    p = TwoStageRank(SignCodec("l2"), "error_feedback", 0, world, groups=groups or None)
    return p.padded_numel(numel), p.codec.row_bytes(p.make_layout(numel))


def row_bytes(numel: int, world: int) -> int:
    """One packed row (codes + scales) of the 1-bit two-stage call: a rank sends 2 (world-1) of them."""
    return _probe(numel, world)[1]


@functools.cache
def flat_rank_bytes(numel: int, world: int) -> int:
    """Bytes a rank sends per flat 1-bit call (``TwoStageRank.bytes_per_call``)."""
    return TwoStageRank(SignCodec("l2"), "error_feedback", 0, world).bytes_per_call(numel)


@functools.cache
def hier_rank_bytes(numel: int, nodes: int, ranks_per_node: int, local_rank: int = 0) -> int:
    """Bytes a rank sends between nodes per two-level call: the two-stage call of its shard among the
    ``nodes`` ranks of its local rank (what ``HierarchicalAllreduce.inter_node_bytes_per_call`` computes)."""
    sg = tuple(shard_groups(numel, ranks_per_node, local_rank, ()))
    probe = TwoStageRank(SignCodec("l2"), "error_feedback", 0, nodes, groups=sg)
    return probe.bytes_per_call(_shard_len(numel, ranks_per_node))


@functools.cache
def node_link_bytes(method: str, numel: int, nodes: int, ranks_per_node: int, grad_bytes: int = 4) -> int:
    """Bytes one node sends over its link per call of ``numel`` elements.

    DDP: a node-aware ring crosses each node boundary once per step, so the link carries one rank's
    ring traffic. Flat: stage 1 (all_to_all, direct) sends L (n-L) rows to ranks of other nodes; stage 2
    (all_gather) is a ring in gloo and NCCL, which crosses each node boundary once per row: n-1 rows
    (measured on the 2 x 2 emulation: 7 rows per node, not the 8 a direct all_gather would send).
    Hierarchical: each of the L ranks sends its shard's two-stage traffic, all of it between nodes."""
    n, L = nodes * ranks_per_node, ranks_per_node
    if nodes == 1:
        return 0
    if method == "ddp":
        return ring_allreduce_bytes(numel, n, grad_bytes)
    if method == "flat":
        return (L * (n - L) + n - 1) * row_bytes(numel, n)
    if method == "hier":
        return sum(hier_rank_bytes(numel, nodes, L, j) for j in range(L))
    raise ValueError(method)


def pieces(seg: int, device: str) -> int:
    """Pipeline pieces of a row of ``seg`` elements, as ``TwoStageRank`` cuts them (one on CUDA)."""
    if device == "cuda":
        return 1
    k = max(1, min(MAX_PIECES, seg // MIN_PIECE, seg // 32))
    bounds = {round(i * seg / k / 32) * 32 for i in range(k)} | {seg}
    return k if len(bounds) > 2 else 1


def codec_bytes(numel: int, world: int) -> float:
    """Memory traffic of one rank's codec passes in a two-stage call (see the module docstring)."""
    padded, _ = _probe(numel, world)
    seg = padded / world
    return padded * (20 + 1 / 8) + seg * (24 + (world + 1) / 8) + padded * (4 + 1 / 8)


def _pipe(wire: float, codec: float, k: int, overlap: bool) -> float:
    if not overlap or k == 1:
        return wire + codec
    return max(wire, codec) + min(wire, codec) / k


def _link_bps(setup: Setup, rate_gbit: float) -> float:
    return rate_gbit * GBIT * setup.efficiency


def ddp_call(setup: Setup, b: int, nodes: int, L: int, rate_gbit: float) -> float:
    """Seconds of one ring allreduce of ``b`` elements of ``grad_bytes``: as slow as its slowest hop."""
    n = nodes * L
    if n == 1:
        return 0.0
    nbytes = ring_allreduce_bytes(b, n, setup.grad_bytes)
    if nodes == 1:
        return 2 * (n - 1) * setup.intra_latency_s + nbytes / setup.intra_bps
    bw = _link_bps(setup, rate_gbit)
    if setup.stream_gbit is not None:
        bw = min(bw, setup.stream_gbit * GBIT)
    if L > 1:
        bw = min(bw, setup.intra_bps)
    return 2 * (n - 1) * setup.latency_s + nbytes / bw


def flat_call(setup: Setup, b: int, nodes: int, L: int, rate_gbit: float) -> float:
    """Seconds of one flat two-stage 1-bit call of ``b`` elements over all ``nodes * L`` ranks."""
    n = nodes * L
    row = row_bytes(b, n)
    padded, _ = _probe(b, n)
    k = pieces(padded // n, setup.device)
    alpha = setup.latency_s if nodes > 1 else setup.intra_latency_s
    inter = node_link_bytes("flat", b, nodes, L) / _link_bps(setup, rate_gbit) if nodes > 1 else 0.0
    wire = max(inter, 2 * (L - 1) * row / setup.intra_bps)
    codec = codec_bytes(b, n) / setup.codec_bps
    return setup.call_overhead_s + (2 * k + 1) * (n - 1) * alpha + _pipe(wire, codec, k, setup.pipeline_overlap)


def hier_call(setup: Setup, b: int, nodes: int, L: int, rate_gbit: float) -> float:
    """Seconds of one two-level call of ``b`` elements (fp32 inside the node, 1-bit between nodes)."""
    if L == 1 or nodes == 1:  # the package runs the flat call then
        return flat_call(setup, b, nodes, L, rate_gbit)
    n, s = nodes * L, _shard_len(b, L)
    padded, _ = _probe(s, nodes)
    k = pieces(padded // nodes, setup.device)
    intra = _intra_node_bytes(L, s) / setup.intra_bps + 2 * (L - 1) * setup.intra_latency_s
    local = ((20 * L + 20) * s + 16 * b) / setup.codec_bps  # node mean in fp64, copies in and out
    alpha = setup.latency_s if nodes > 1 else setup.intra_latency_s
    wire = node_link_bytes("hier", b, nodes, L) / _link_bps(setup, rate_gbit) if nodes > 1 else 0.0
    codec = codec_bytes(s, nodes) / setup.codec_bps
    lat = (n - 1) * alpha + 2 * k * (nodes - 1) * alpha  # the agreement spans every rank
    return setup.call_overhead_s + lat + intra + local + _pipe(wire, codec, k, setup.pipeline_overlap)


CALLS = {"ddp": ddp_call, "flat": flat_call, "hier": hier_call}


@dataclass(frozen=True)
class Step:
    ddp: float  # seconds per compression-phase step
    flat: float
    hier: float
    link_bytes: dict  # method -> bytes one node sends over its link per step


def step(setup: Setup, nodes: int, L: int, rate_gbit: float, sizes: Sequence[int] | None = None) -> Step:
    """Compression-phase step times and link bytes of the three methods; ``sizes``: the buckets
    (default: ``buckets(setup.params, setup.bucket_elems)``)."""
    sizes = list(sizes) if sizes is not None else buckets(setup.params, setup.bucket_elems)
    comm = {m: sum(CALLS[m](setup, b, nodes, L, rate_gbit) for b in sizes) for m in CALLS}
    link = {m: sum(node_link_bytes(m, b, nodes, L, setup.grad_bytes) for b in sizes) for m in CALLS}
    c = setup.compute_s
    return Step(ddp=c + max(0.0, comm["ddp"] - setup.overlap * c), flat=c + comm["flat"], hier=c + comm["hier"],
                link_bytes=link)


def end_to_end(speedup: float, warmup_fraction: float) -> float:
    """Whole-run speedup when a fraction of the steps are warm-up steps at DDP's speed."""
    return 1.0 / (warmup_fraction + (1 - warmup_fraction) / speedup)


# -- calibration ------------------------------------------------------------------------------------------


def codec_bps_from_reference() -> tuple[float, list[tuple[str, float]]]:
    """Host codec bandwidth (bytes the passes move per second) from the codec kernel table: the median
    over its rows, each row's bytes counted as in ``codec_bytes``."""
    rows = []
    for numel, op, ms in CODEC_REF:
        if op == "encode+EF":
            moved = numel * (20 + 1 / 8)
        else:
            workers = int(op.split("x")[1])
            moved = numel / workers * (24 + (workers + 1) / 8)
        rows.append((f"{numel / 2**20:.0f}Mi {op}", moved / (ms * 1e-3)))
    return statistics.median(bw for _, bw in rows), rows


def calibrate(seconds: float = 3.0) -> tuple[float, float, list[tuple[str, float]]]:
    """Measure on this machine: codec bandwidth (encode + EF, server step x4, decode of 4Mi elements)
    and the fixed cost of one 1-rank ``CompressedAllreduce`` call of 4096 elements."""
    import torch

    from lightning_onebit.comm import CompressedAllreduce

    def timed(fn, reps: int) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    numel, workers, reps = 4 * 2**20, 4, max(3, int(seconds / 0.3))
    codec = SignCodec("l2")
    x, err = torch.randn(numel), torch.zeros(numel)
    seg = numel // workers
    msgs = codec.encode(x, nseg=workers)
    serr, mean, out = torch.zeros(seg), torch.empty(seg), torch.empty(numel)
    rows = [("4Mi encode+EF", numel * (20 + 1 / 8) / timed(lambda: codec.encode_error_feedback(x, err), reps)),
            ("4Mi server x4", seg * (24 + (workers + 1) / 8)
             / timed(lambda: codec.server_step(msgs, serr, mean=mean), reps)),
            ("4Mi decode", numel * (4 + 1 / 8) / timed(lambda: codec.decode(msgs, out=out), reps))]
    car = CompressedAllreduce(SignCodec("l2"), "error_feedback")
    small = torch.randn(4096)
    small_out = torch.empty_like(small)
    overhead = timed(lambda: car(small, out=small_out), 30)
    return statistics.median(bw for _, bw in rows), overhead, rows


# -- the emulated cluster ---------------------------------------------------------------------------------

EMULATION_CORES = 2  # every emulated node's ranks share this host's cores
EMULATION_THREADS = 1  # NUMBA_NUM_THREADS per rank (benchmarks/netns_cluster.py)
EMULATION_INTRA_BPS = 1e9  # loopback between ranks of one emulated node (assumed; TCP on the shared host)


def emulation_alpha(ranks: int) -> float:
    """Per-message latency among ``ranks`` emulated ranks (one per node in the measurements), fitted
    to the '1-bit bytes only' cells of 1M elements (one all_to_all + one all_gather: 2 (n-1) messages):
    what is left after the wire time. It is mostly scheduling: 4 ranks on 2 cores wait for each other."""
    fits = []
    for r in COLLECTIVES_REF:
        if r["nodes"] == ranks and r["numel"] == 1_000_000:
            n = r["nodes"]
            wire = 2 * (n - 1) * -(-r["numel"] // (8 * n)) / (r["gbit"] * GBIT * TCP_EFFICIENCY)
            fits.append(max(0.0, r["wire"] - wire) / (2 * (n - 1)))
    return statistics.mean(fits) if fits else 0.0


def emulation_setup(nodes: int, ranks_per_node: int, host_codec_bps: float, call_overhead_s: float,
                    compute_s: float = 0.0, params: int = 0) -> Setup:
    """The emulated cluster as a Setup: P = N L single-thread ranks share the host's cores, so a rank
    gets min(threads/cores, 1/P) of the host's codec bandwidth, pays the call overhead P/cores times
    when the cores are oversubscribed, and cannot overlap its pieces then (the kernel's TCP work needs
    the same cores); gloo's allreduce is not hidden behind backward (omega = 0)."""
    P = nodes * ranks_per_node
    share = min(EMULATION_THREADS / EMULATION_CORES, 1 / P)
    return Setup(params=params, compute_s=compute_s, grad_bytes=4, bucket_elems=None,
                 latency_s=emulation_alpha(P), intra_latency_s=emulation_alpha(P), efficiency=TCP_EFFICIENCY,
                 intra_bps=EMULATION_INTRA_BPS, codec_bps=host_codec_bps * share,
                 call_overhead_s=call_overhead_s * max(1.0, P / EMULATION_CORES), device="cpu", overlap=0.0,
                 pipeline_overlap=P <= EMULATION_CORES)


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%"


def check_collectives(host_bps: float, overhead: float) -> list[float]:
    """Print predicted vs measured seconds per call; return the relative errors of the checked cells."""
    print("| nodes | link | numel | method | measured s | predicted s | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for r in COLLECTIVES_REF:
        N, rate, d = r["nodes"], r["gbit"], r["numel"]
        s = emulation_setup(N, 1, host_bps, overhead)
        serial = replace(s, pipeline_overlap=False)
        wire = 2 * (N - 1) * (s.latency_s + -(-d // (8 * N)) / _link_bps(s, rate))
        cells = [("fp32", ddp_call(s, d, N, 1, rate)), ("onebit", flat_call(s, d, N, 1, rate)),
                 ("serial", flat_call(serial, d, N, 1, rate)), ("wire", wire)]
        label = {"fp32": "fp32 all_reduce", "onebit": "1-bit", "serial": "1-bit not pipelined",
                 "wire": "1-bit bytes only"}
        for key, pred in cells:
            fitted = key == "wire" and d == 1_000_000  # these cells set the latency
            if not fitted:
                errors.append((pred - r[key]) / r[key])
            print(f"| {N} | {rate} Gbit/s | {d / 1e6:g}M | {label[key]} | {r[key]:.4f} | {pred:.4f} | "
                  f"{'(fitted)' if fitted else _err(pred, r[key])} |")
    return errors


def check_e2e(host_bps: float, overhead: float) -> list[float]:
    print("| workload | nodes | link | compute s (input) | DDP + AdamW measured | predicted | error | "
          "onebit_adam measured | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for r in E2E_REF:
        numels = WORKLOADS[r["workload"]]
        s = emulation_setup(r["nodes"], 1, host_bps, overhead, compute_s=r["compute"], params=sum(numels))
        st = step(s, r["nodes"], 1, r["gbit"], sizes=optimizer_buckets(numels))
        errors += [(st.ddp - r["ddp"]) / r["ddp"], (st.flat - r["onebit"]) / r["onebit"]]
        print(f"| {r['workload']} | {r['nodes']} | {r['gbit']} Gbit/s | {r['compute']:.3f} | {r['ddp']:.3f} | "
              f"{st.ddp:.3f} | {_err(st.ddp, r['ddp'])} | {r['onebit']:.3f} | {st.flat:.3f} | "
              f"{_err(st.flat, r['onebit'])} |")
    return errors


def predict_two_level(host_bps: float, overhead: float, numel: int = 25_000_000) -> list[float]:
    """2 emulated nodes x 2 ranks (and every cell of HIERARCHICAL_REF): DDP, flat and hierarchical
    bytes on a node's link and seconds per call; returns the errors of the measured cells."""
    measured = {(r["nodes"], r["ranks_per_node"], r["gbit"], r["numel"]): r for r in HIERARCHICAL_REF}
    cells = sorted({(2, 2, 1, numel), (2, 2, 10, numel)} | set(measured))
    print("| nodes x ranks | link | numel | method | node link MB/call | predicted s | measured s | error |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for N, L, rate, d in cells:
        s = emulation_setup(N, L, host_bps, overhead)
        ref = measured.get((N, L, rate, d), {})
        for m, key in (("ddp", "fp32"), ("flat", "flat"), ("hier", "hierarchical")):
            pred = CALLS[m](s, d, N, L, rate)
            meas = ref.get(key)
            if meas:
                errors.append((pred - meas) / meas)
            tail = f"{meas:.4f} | {_err(pred, meas)}" if meas else "not measured | -"
            print(f"| {N} x {L} | {rate} Gbit/s | {d / 1e6:g}M | {key} | {node_link_bytes(m, d, N, L) / MB:.2f} | "
                  f"{pred:.4f} | {tail} |")
    return errors


# -- the paper --------------------------------------------------------------------------------------------


def paper_setups() -> list[tuple[str, Setup, float]]:
    """(assumption, Setup, link Gbit/s) for the paper's cluster; see the docs for each assumption."""
    p = PAPER
    base = Setup(params=int(p["params"]), compute_s=p["samples_per_step"] / V100_SAMPLES_PER_S,
                 grad_bytes=p["grad_bytes"], bucket_elems=None,  # DeepSpeed: one flat buffer per step
                 latency_s=25e-6, intra_bps=10e9,  # TCP over Ethernet; 4 GPUs on PCIe
                 codec_bps=0.5 * V100_HBM_GBS * 1e9, overlap=1 / 6)
    iperf = p["iperf_gbit"]
    return [
        (f"every transfer at the iperf goodput ({iperf} Gbit/s)", replace(base, efficiency=1.0), iperf),
        ("40 Gbit/s link; the ring's one TCP stream per hop at the iperf goodput", replace(base, stream_gbit=iperf),
         40.0),
        ("40 Gbit/s for every transfer", base, 40.0),
    ]


def check_paper(quick: bool = False) -> dict:
    p = PAPER
    N, L, f = p["nodes"], p["ranks_per_node"], p["warmup_fraction"]
    d = int(p["params"])
    n = N * L
    fp16_rank = ring_allreduce_bytes(d, n, p["grad_bytes"])
    ratio = fp16_rank / flat_rank_bytes(d, n)
    volume = end_to_end(ratio, f)
    print(f"BERT-Large, {d / 1e6:.0f}M parameters, {n} V100 = {N} nodes x {L}, fp16 gradients in the Adam "
          f"baseline, compute {p['samples_per_step']} samples per GPU per step at {V100_SAMPLES_PER_S:.0f} "
          f"samples/s, warm-up {100 * f:.0f}% of the steps.\n")
    print(f"Volume per rank, compression phase: fp16 ring {fp16_rank / MB:.0f} MB / 1-bit "
          f"{flat_rank_bytes(d, n) / MB:.1f} MB = {ratio:.1f}x; with the warm-up: **{volume:.2f}x** "
          f"(paper: {p['volume']:g}x, {_err(volume, p['volume'])}).\n")
    print("| link assumption | DDP step s | flat 1-bit step s | hierarchical step s | compression phase: flat vs "
          f"DDP (paper {p['compression_speedup']}x) | error | end to end (paper {p['end_to_end']}x) | error | "
          "hierarchical vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {}
    for label, s, rate in paper_setups():
        st = step(s, N, L, rate)
        sp = st.ddp / st.flat
        e2e = end_to_end(sp, f)
        out[label] = (sp, e2e)
        print(f"| {label} | {st.ddp:.3f} | {st.flat:.3f} | {st.hier:.3f} | {sp:.2f}x | "
              f"{_err(sp, p['compression_speedup'])} | {e2e:.2f}x | {_err(e2e, p['end_to_end'])} | "
              f"{st.ddp / st.hier:.2f}x |")
    _, s, rate = paper_setups()[1]
    lo, hi = 150.0, 270.0  # V100 samples/s
    span = [step(replace(s, compute_s=p["samples_per_step"] / sps), N, L, rate) for sps in (lo, hi)]
    print(f"\nWith {lo:.0f}-{hi:.0f} V100 samples/s instead of {V100_SAMPLES_PER_S:.0f}, the second row's flat vs "
          f"DDP is {span[0].ddp / span[0].flat:.1f}x-{span[1].ddp / span[1].flat:.1f}x.")
    paper_e2e = end_to_end(p["compression_speedup"], f)
    print(f"\nThe paper's own {p['compression_speedup']}x with {100 * f:.0f}% warm-up steps gives "
          f"{paper_e2e:.2f}x end to end by the same identity (reported: {p['end_to_end']}x).")
    return out


# -- the table --------------------------------------------------------------------------------------------


def table(setup: Setup, gpus: Sequence[int], L: int, rates: Sequence[float]) -> list[dict]:
    print("| GPUs | nodes | link | DDP s | flat 1-bit s | hierarchical s | flat vs DDP | hierarchical vs DDP | "
          "link MB/step/node: DDP | flat | hierarchical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for rate in rates:
        for g in gpus:
            if g % L:
                raise SystemExit(f"{g} GPUs is not a multiple of {L} GPUs per node")
            N = g // L
            st = step(setup, N, L, rate)
            rows.append(dict(gpus=g, nodes=N, rate=rate, ddp=st.ddp, flat=st.flat, hier=st.hier,
                             link=st.link_bytes))
            lb = st.link_bytes
            print(f"| {g} | {N} | {rate:g} Gbit/s | {st.ddp:.3f} | {st.flat:.3f} | {st.hier:.3f} | "
                  f"{st.ddp / st.flat:.2f}x | {st.ddp / st.hier:.2f}x | {lb['ddp'] / MB:.0f} | {lb['flat'] / MB:.0f} | "
                  f"{lb['hier'] / MB:.0f} |")
    return rows


def plot(rows: list[dict], path: str, setup: Setup, L: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rates = sorted({r["rate"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, rate in enumerate(rates):
        rs = [r for r in rows if r["rate"] == rate]
        g = [r["gpus"] for r in rs]
        ax.plot(g, [r["ddp"] / r["hier"] for r in rs], "o-", color=colors[i], label=f"hierarchical, {rate:g} Gbit/s")
        ax.plot(g, [r["ddp"] / r["flat"] for r in rs], "s--", color=colors[i], label=f"flat, {rate:g} Gbit/s")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["gpus"] for r in rows}), [str(x) for x in sorted({r["gpus"] for r in rows})])
    ax.set_xlabel(f"GPUs ({L} per node)")
    ax.set_ylabel("compression-phase speedup vs DDP")
    ax.set_title(f"1-bit Adam vs DDP, model: {setup.params / 1e6:.0f}M parameters, compute {setup.compute_s:g} s/step",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


# -- main -------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=340e6, help="elements synchronised per step (BERT-Large)")
    ap.add_argument("--compute-s", type=float, default=PAPER["samples_per_step"] / V100_SAMPLES_PER_S,
                    help="forward + backward + update per step (default: 64 BERT-Large samples on a V100)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 40, 100], help="node link, Gbit/s")
    ap.add_argument("--latency-us", type=float, default=10.0, help="per message between nodes")
    ap.add_argument("--intra-latency-us", type=float, default=2.0, help="per message inside a node")
    ap.add_argument("--efficiency", type=float, default=TCP_EFFICIENCY, help="link goodput / rate")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="MiB of fp32 per bucket (0: one bucket)")
    ap.add_argument("--grad-bytes", type=int, default=4, help="bytes per element of DDP's allreduce")
    ap.add_argument("--intra-gbs", type=float, default=150.0, help="GB/s per GPU inside a node")
    ap.add_argument("--gpu-mem-gbs", type=float, default=V100_HBM_GBS, help="GPU memory bandwidth, GB/s")
    ap.add_argument("--codec-efficiency", type=float, default=0.5,
                    help="fraction of the memory bandwidth the codec passes reach")
    ap.add_argument("--call-overhead-us", type=float, default=100.0, help="host cost of one compressed call")
    ap.add_argument("--overlap", type=float, default=1 / 6,
                    help="fraction of the compute DDP's allreduce hides behind (backward of the last of 4 "
                         "micro-batches)")
    ap.add_argument("--warmup-fraction", type=float, default=PAPER["warmup_fraction"])
    ap.add_argument("--calibrate", action="store_true",
                    help="measure the CPU codec bandwidth and call overhead here (a few seconds) for the "
                         "emulation checks, instead of the reference values")
    ap.add_argument("--quick", action="store_true", help="the table only, 8-64 GPUs (for tests)")
    ap.add_argument("--plot", metavar="PATH", help="write the speedup plot (PNG) to PATH")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    with tee_stdout(args.out, header("scaling.py", argv)):
        run(args)


def run(args: argparse.Namespace) -> None:
    setup = Setup(params=int(args.params), compute_s=args.compute_s, grad_bytes=args.grad_bytes,
                  bucket_elems=int(args.bucket_mb * 2**20) // 4 if args.bucket_mb > 0 else None,
                  latency_s=args.latency_us * 1e-6, intra_latency_s=args.intra_latency_us * 1e-6,
                  efficiency=args.efficiency, intra_bps=args.intra_gbs * 1e9,
                  codec_bps=args.codec_efficiency * args.gpu_mem_gbs * 1e9,
                  call_overhead_s=args.call_overhead_us * 1e-6, overlap=args.overlap)
    L = args.gpus_per_node
    gpus = [g for g in args.gpus if g <= 64] if args.quick else args.gpus
    if not args.quick:
        host_bps, ref_rows = codec_bps_from_reference()
        overhead, source = CALL_OVERHEAD_CPU_S, CALL_OVERHEAD_SOURCE
        print("# Cost model: compression-phase step time from emulated nodes to cluster scale\n")
        print(f"## Calibration (CPU, the emulated nodes)\n\nCodec bandwidth from {CODEC_REF_SOURCE}: "
              + ", ".join(f"{k} {bw / 1e9:.1f} GB/s" for k, bw in ref_rows)
              + f"; median **{host_bps / 1e9:.1f} GB/s** (2 threads).\n")
        if args.calibrate:
            host_bps, overhead, rows = calibrate()
            source = "measured now"
            print("Measured here now (`--calibrate`, used below): "
                  + ", ".join(f"{k} {bw / 1e9:.1f} GB/s" for k, bw in rows)
                  + f"; median **{host_bps / 1e9:.1f} GB/s**, call overhead {overhead * 1e3:.2f} ms.\n")
        print(f"Per-call host overhead {overhead * 1e3:.2f} ms ({source}). Link goodput = rate x "
              f"{TCP_EFFICIENCY:.3f} (TCP framing). Latency per message, fitted to the 1M-element '1-bit bytes "
              f"only' cells: 2 nodes {emulation_alpha(2) * 1e3:.2f} ms, 4 nodes {emulation_alpha(4) * 1e3:.2f} ms.\n")
        print(f"## Check: one allreduce on emulated links\n\nMeasured: {COLLECTIVES_SOURCE}.\n")
        errs = check_collectives(host_bps, overhead)
        _summary(errs)
        print(f"\n## Check: training steps on emulated links\n\nMeasured: {E2E_SOURCE}.\n")
        errs = check_e2e(host_bps, overhead)
        _summary(errs)
        print("\n## Prediction: 2 emulated nodes x 2 ranks, flat vs hierarchical\n")
        errs = predict_two_level(host_bps, overhead)
        if errs:
            _summary(errs)
        print(f"\n## Check: the 1-bit Adam paper\n\n{PAPER['title']}.\n")
        check_paper()
        print()
    print(f"## Compression-phase step, {L} GPUs per node\n")
    print(f"Model {setup.params / 1e6:.0f}M parameters, compute {setup.compute_s:g} s/step, DDP overlap "
          f"{setup.overlap:.2f} of it, {len(buckets(setup.params, setup.bucket_elems))} buckets, "
          f"grad {setup.grad_bytes} B, latency {setup.latency_s * 1e6:g} us, link efficiency "
          f"{setup.efficiency:.3f}, inside a node {setup.intra_bps / 1e9:g} GB/s per GPU, codec "
          f"{setup.codec_bps / 1e9:g} GB/s per GPU, call overhead {setup.call_overhead_s * 1e6:g} us.\n")
    rows = table(setup, gpus, L, args.rates)
    if args.plot:
        plot(rows, args.plot, setup, L)


def _summary(errors: list[float]) -> None:
    a = sorted(abs(e) for e in errors)
    print(f"\n{len(a)} cells: median |error| {100 * statistics.median(a):.0f}%, "
          f"largest {100 * a[-1]:.0f}%, within 25%: {sum(e <= 0.25 for e in a)}.")


if __name__ == "__main__":
    main()

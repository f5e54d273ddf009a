"""benchmarks/scaling.py, the cost model from emulated nodes to cluster scale: its byte counts are the
package's own (checked against the simulated collectives' counters), its times follow the links, and
the script prints its table."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scaling  # noqa: E402

from lightning_onebit.comm import (  # noqa: E402
    SimulatedCluster,
    SimulatedHierarchicalCluster,
    TwoStageRank,
    ring_allreduce_bytes,
)
from lightning_onebit.comm.two_stage import MIN_PIECE  # noqa: E402
from lightning_onebit.compress import SignCodec  # noqa: E402


@pytest.mark.parametrize("nodes,ranks_per_node,numel", [(2, 2, 1000), (3, 2, 777), (2, 3, 4099)])
def test_link_bytes_are_what_the_simulated_collectives_send(nodes, ranks_per_node, numel):
    n, L = nodes * ranks_per_node, ranks_per_node
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=gen) for _ in range(n)]
    hier = SimulatedHierarchicalCluster(SignCodec("l2"), "error_feedback", nodes, L)
    hier.allreduce(xs)
    flat = SimulatedCluster(SignCodec("l2"), "error_feedback", n)
    flat.allreduce(xs)
    # per rank: the counters hold rank 0's bytes of one call
    assert scaling.hier_rank_bytes(numel, nodes, L) == hier.counter.bytes_sent
    assert scaling.flat_rank_bytes(numel, n) == flat.counter.bytes_sent
    # per node: every rank of a node sends as much; of flat's rows, the all_to_all's to other nodes' ranks
    # (L (n - L)) and the ring all_gather's that cross the node boundary (n - 1) leave the node
    assert scaling.node_link_bytes("hier", numel, nodes, L) == L * hier.counter.bytes_sent
    row = flat.counter.bytes_sent // (2 * (n - 1))
    assert scaling.node_link_bytes("flat", numel, nodes, L) == (L * (n - L) + n - 1) * row
    assert scaling.node_link_bytes("ddp", numel, nodes, L) == ring_allreduce_bytes(numel, n)
    assert scaling.node_link_bytes("flat", numel, 1, L) == 0


@pytest.mark.parametrize("ranks_per_node", [2, 4, 8])
@pytest.mark.parametrize("nodes", [2, 16])
def test_hierarchical_link_bytes_against_flat(nodes, ranks_per_node):
    """L x fewer for flat's stage 1; its ring all_gather already crosses a node boundary once per row, so
    in all (L (n-L) + n-1) / (2 L (N-1)): 1.75x at 2 x 2, -> (L + 1) / 2 with many nodes."""
    d = 25 * 2**20 // 4
    flat = scaling.node_link_bytes("flat", d, nodes, ranks_per_node)
    hier = scaling.node_link_bytes("hier", d, nodes, ranks_per_node)
    L, N, n = ranks_per_node, nodes, nodes * ranks_per_node
    assert flat / hier == pytest.approx((L * (n - L) + n - 1) / (2 * L * (N - 1)), rel=2e-3)  # scales aside
    ddp = scaling.node_link_bytes("ddp", d, nodes, ranks_per_node)
    n = nodes * ranks_per_node  # the ring's link carries 2 (n-1)/n 4d, the two-level call's 2 (N-1)/N d/8
    assert ddp / hier == pytest.approx(32 * ((n - 1) / n) / ((nodes - 1) / nodes), rel=2e-3)


def test_pieces_are_the_packages():
    for seg in (MIN_PIECE - 8, 2 * MIN_PIECE + 64, 3 * MIN_PIECE + 8):
        # two ranks: at world size 1 there is no network to overlap, so a rank keeps one piece
        probe = TwoStageRank(SignCodec("l2"), "error_feedback", 0, 2)
        probe.bind(2 * seg, "cpu")
        assert scaling.pieces(probe.seg_len, "cpu") == probe.num_pieces > (seg >= 2 * MIN_PIECE), seg
    assert scaling.pieces(8 * MIN_PIECE, "cuda") == 1


def test_ddp_time_follows_link_rate_and_latency():
    s = scaling.Setup(params=100_000_000, compute_s=0.0, latency_s=0.0, overlap=0.0, bucket_elems=None)
    slow, fast = scaling.step(s, 4, 8, 10.0), scaling.step(s, 4, 8, 100.0)
    assert slow.ddp == pytest.approx(10 * fast.ddp)  # bandwidth-bound: 1/rate
    assert slow.ddp == pytest.approx(ring_allreduce_bytes(s.params, 32) / (10 * scaling.GBIT * s.efficiency))
    lat = scaling.step(replace(s, latency_s=1e-3), 4, 8, 100.0)
    assert lat.ddp - fast.ddp == pytest.approx(2 * 31 * 1e-3)  # 2 (n-1) messages
    one_node = [scaling.step(s, 1, 8, r).ddp for r in (1.0, 100.0)]
    assert one_node[0] == one_node[1]  # nothing crosses a node link
    # compression pays on a slow link, and the two-level call more than the flat one
    assert slow.hier < slow.flat < slow.ddp


def test_overlap_hides_only_ddp_communication():
    s = scaling.Setup(params=10_000_000, compute_s=1.0, overlap=0.0)
    hidden = scaling.step(replace(s, overlap=1.0), 2, 8, 10.0)
    plain = scaling.step(s, 2, 8, 10.0)
    assert hidden.ddp == pytest.approx(max(1.0, plain.ddp - 1.0))
    assert hidden.flat == plain.flat and hidden.hier == plain.hier


def test_end_to_end_and_volume_identities():
    assert scaling.end_to_end(6.6, 0.15) == pytest.approx(1 / (0.15 + 0.85 / 6.6))
    assert scaling.end_to_end(1.0, 0.3) == pytest.approx(1.0)
    # the paper's volume: fp16 ring bytes over 1-bit bytes per rank is ~16x in the compression phase
    d, n = int(scaling.PAPER["params"]), 64
    assert ring_allreduce_bytes(d, n, 2) / scaling.flat_rank_bytes(d, n) == pytest.approx(16, rel=1e-3)


def test_optimizer_buckets_of_the_e2e_mlp():
    assert scaling.optimizer_buckets(scaling.WORKLOADS["mlp"]) == [4_209_674, 16_777_216, 4_198_400]
    assert scaling.optimizer_buckets(scaling.WORKLOADS["transformer"]) == [3_704_808]


def test_emulation_check_uses_reference_data(capsys):
    bps, _ = scaling.codec_bps_from_reference()
    errors = scaling.check_collectives(bps, scaling.CALL_OVERHEAD_CPU_S)
    out = capsys.readouterr().out
    assert "| 2 | 1 Gbit/s | 25M | fp32 all_reduce | 0.8512 |" in out
    # the wire model holds where the link, not the shared CPU, is the bottleneck
    fp32_1gbit = [r for r in scaling.COLLECTIVES_REF if r["gbit"] == 1 and r["numel"] >= 25_000_000]
    for r in fp32_1gbit:
        s = scaling.emulation_setup(r["nodes"], 1, bps, scaling.CALL_OVERHEAD_CPU_S)
        assert scaling.ddp_call(s, r["numel"], r["nodes"], 1, 1) == pytest.approx(r["fp32"], rel=0.05)
    assert len(errors) == 4 * len(scaling.COLLECTIVES_REF) - 4  # the fitted 1M bytes-only cells excluded


def test_main_quick_prints_the_table_and_plots(tmp_path, capsys):
    out, png = tmp_path / "scaling.md", tmp_path / "scaling.png"
    scaling.main(["--quick", "--rates", "10", "100", "--out", str(out), "--plot", str(png)])
    text = capsys.readouterr().out
    assert "| GPUs | nodes | link | DDP s |" in text
    assert "| 64 | 8 | 100 Gbit/s |" in text and "| 128 |" not in text
    assert out.read_text().startswith("Run ") and "`python benchmarks/scaling.py --quick" in out.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The comm layer's one wire and one mean builder (comm/wire.py, comm/mean.py, comm/topology.py): what each
name means, what each wire builds, and the layout decision both families take from one place."""

import pytest
import torch

from lightning_onebit.comm import (
    CompressedAllreduce,
    DenseMean,
    SimulatedCluster,
    SimulatedDenseMean,
    SimulatedHierarchicalCluster,
    Topology,
    Wire,
    make_mean,
)
from lightning_onebit.compress import MinMaxCodec, SignCodec, TopKCodec


@pytest.mark.parametrize("value,kind,bits,dtype", [
    (None, "dense", 32, torch.float32), ("fp32", "dense", 32, torch.float32), (torch.bfloat16, "dense", 16,
                                                                                torch.bfloat16),
    ("fp16", "dense", 16, torch.float16), ("8bit", "minmax", 8, torch.uint8), ("uint8", "minmax", 8, torch.uint8),
    (torch.uint8, "minmax", 8, torch.uint8), ("4bit", "minmax", 4, torch.uint8), ("2bit", "minmax", 2, torch.uint8),
    ("1bit", "sign", 1, torch.uint8),
])
def test_every_name_parses_to_one_wire(value, kind, bits, dtype):
    allowed = ("fp32", "bf16", "fp16", "uint8", "8bit", "4bit", "2bit", "1bit")
    wire = Wire.parse(value, allowed=allowed)
    assert (wire.kind, wire.bits, wire.torch_dtype) == (kind, bits, dtype)
    assert Wire.parse(wire, allowed=allowed) is wire  # a Wire passes as itself
    assert Wire.parse(str(wire) if str(wire) in allowed else value, allowed=allowed) == wire


def test_a_name_outside_the_allowed_ones_is_an_error_naming_the_option_and_the_choices():
    with pytest.raises(ValueError, match=r"compression must be one of \['1bit', '8bit', 'fp32'\].* got '3bit'"):
        Wire.parse("3bit", option="compression", allowed=("fp32", "8bit", "1bit"))
    with pytest.raises(ValueError, match="warmup_comm_dtype must be one of"):
        Wire.parse("4bit", option="warmup_comm_dtype", allowed=("fp32", "bf16", "fp16", "uint8"))
    with pytest.raises(ValueError, match="bits must be one of"):
        Wire.minmax(3)
    with pytest.raises(ValueError, match="scale is 'l2' or 'l1'"):
        Wire.sign("max")


def test_each_coded_wire_has_its_codec_and_a_dense_one_has_none():
    assert isinstance(Wire.sign().codec(), SignCodec) and Wire.sign("l1").codec().scale == "l1"
    assert isinstance(Wire.minmax(4).codec(64), MinMaxCodec) and Wire.minmax(4).codec(64).block_size == 64
    assert isinstance(Wire.topk(0.1).codec(), TopKCodec)
    with pytest.raises(ValueError, match="dense mean"):
        Wire.dense(torch.bfloat16).codec()


def test_make_mean_builds_what_the_wire_and_layout_say():
    """One process (no process group): dense and coded means, simulated flat and on two levels."""
    assert isinstance(make_mean(Wire.dense()), DenseMean)
    assert isinstance(make_mean(Wire.dense(torch.bfloat16), simulate=4), SimulatedDenseMean)
    flat = make_mean(Wire.sign(), mode="error_feedback", numel=100, groups=[0, 60])
    assert isinstance(flat, CompressedAllreduce) and flat.world_size == 1 and flat.numel == 100
    assert isinstance(make_mean(Wire.minmax(8), simulate=4), SimulatedCluster)
    two = make_mean(Wire.sign(), mode="error_feedback", simulate=4, topology=Topology(ranks_per_node=2))
    assert isinstance(two, SimulatedHierarchicalCluster) and (two.nodes, two.ranks_per_node) == (2, 2)
    # the simulation's arithmetic is the real call's: 4 workers' 4-bit mean is identical on every worker
    xs = [torch.randn(257, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    outs = make_mean(Wire.minmax(4), mode="error_feedback", simulate=4).allreduce(xs)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert (outs[0] - torch.stack(xs).mean(0)).abs().max() < 0.5


def test_the_bf16_mean_feeds_back_what_the_cast_dropped():
    """One rank: the mean is the input itself, rounded to bf16; the error holds the rounding, and the next
    call sends input + error, so that the sum of what was sent tracks the sum of the inputs."""
    mean = DenseMean(Wire.dense(torch.bfloat16))
    err = torch.zeros(1000)
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(k)) * 1e-3 for k in range(20)]
    sent = torch.zeros(1000, dtype=torch.float64)
    for x in xs:
        flight = mean.start(x.clone(), error=err)
        assert flight.result.dtype == torch.bfloat16
        sent += flight.wait().double()
    total = torch.stack(xs).double().sum(0)
    assert torch.allclose(sent + err.double(), total, atol=1e-9)  # nothing lost: it is in the error
    assert (sent - total).abs().max() < 2 ** -8 * total.abs().max()


@pytest.mark.parametrize("hierarchical,ranks_per_node,world,chosen", [
    (None, 2, 4, 2), (None, 4, 4, None), (None, 1, 4, None), (True, 1, 4, 1), (False, 2, 4, None),
    (True, 3, 4, None),
])
def test_one_layout_decision_for_both_families(hierarchical, ranks_per_node, world, chosen):
    """The Adam family and DiLoCo ask the same Topology (here for a simulated world)."""
    from lightning_onebit import DiLoCo, OnebitAdam

    assert Topology(hierarchical=hierarchical, ranks_per_node=ranks_per_node).two_level(world_size=world) == chosen
    p = [torch.zeros(3, requires_grad=True)]
    opt = OnebitAdam(p, simulate_workers=world)
    opt.set_topology(hierarchical=hierarchical, ranks_per_node=ranks_per_node)
    assert opt.topology.two_level(world_size=world) == chosen
    d = DiLoCo(p, hierarchical=hierarchical, ranks_per_node=ranks_per_node, compression="4bit")
    assert d.topology.two_level(world_size=world) == chosen
    with pytest.raises(ValueError, match="ranks_per_node must be a positive int"):
        Topology(ranks_per_node=0)

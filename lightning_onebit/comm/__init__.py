"""Compressed collectives over a ProcessGroup, their two-stage arithmetic, byte accounting and the
simulated cluster."""

from .accounting import ByteCounter, StepStats, ring_allreduce_bytes
from .agree import all_ranks, gather_objects, is_distributed, max_across_, sum_across_
from .allreduce import CompressedAllreduce, NonFiniteInputError
from .ddp_hook import (
    CompressionHookState,
    compression_hook,
    local_gradients_hook,
    register_compression_hook,
    register_local_hook,
)
from .dense import (
    all_finite,
    all_finite_many,
    any_across,
    any_across_bytes,
    group_size,
    mean_allreduce,
    nonfinite_flags_,
    ready_future,
)
from .duplex import duplex_twin, enable_duplex
from .errors import CollectiveError
from .hierarchical import HierarchicalAllreduce, SimulatedHierarchicalCluster, node_groups
from .inflight import Verdict, check_together
from .mean import DenseMean, Flight, Sender, SimulatedDenseMean, ThreadedMean, make_mean, simulated_mean
from .simulated import SimulatedCluster
from .sparse import gather_sizes, sparse_mean, sparse_mean_bytes, sparse_row
from .topology import Topology, is_default_group, rank, spans_the_world
from .two_stage import MODES, TwoStageRank
from .wire import Wire

__all__ = ["MODES", "ByteCounter", "CollectiveError", "CompressedAllreduce", "CompressionHookState", "DenseMean",
           "Flight", "HierarchicalAllreduce", "NonFiniteInputError", "Sender", "SimulatedCluster", "SimulatedDenseMean",
           "SimulatedHierarchicalCluster", "StepStats", "ThreadedMean", "Topology", "TwoStageRank", "Verdict", "Wire",
           "all_finite", "all_finite_many", "all_ranks", "any_across", "any_across_bytes", "check_together",
           "compression_hook",
           "duplex_twin", "enable_duplex", "gather_objects", "gather_sizes", "group_size", "is_default_group",
           "is_distributed", "local_gradients_hook", "make_mean", "max_across_", "mean_allreduce", "node_groups",
           "nonfinite_flags_",
           "rank", "ready_future", "register_compression_hook", "register_local_hook", "ring_allreduce_bytes",
           "simulated_mean", "sparse_mean", "sparse_mean_bytes", "sparse_row", "spans_the_world", "sum_across_"]

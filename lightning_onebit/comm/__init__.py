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
from .dense import all_finite, all_finite_many, any_across, any_across_bytes, group_size, mean_allreduce, wire_dtype
from .duplex import duplex_twin, enable_duplex
from .hierarchical import HierarchicalAllreduce, SimulatedHierarchicalCluster, node_groups
from .simulated import SimulatedCluster
from .sparse import gather_sizes, sparse_mean, sparse_mean_bytes, sparse_row
from .two_stage import MODES, TwoStageRank

__all__ = ["MODES", "ByteCounter", "CompressedAllreduce", "CompressionHookState", "HierarchicalAllreduce",
           "NonFiniteInputError", "SimulatedCluster", "SimulatedHierarchicalCluster", "StepStats", "TwoStageRank",
           "all_finite", "all_finite_many", "all_ranks", "any_across", "any_across_bytes", "compression_hook",
           "duplex_twin", "enable_duplex", "gather_objects", "gather_sizes", "group_size", "is_distributed",
           "local_gradients_hook", "max_across_", "mean_allreduce", "node_groups", "register_compression_hook",
           "register_local_hook", "ring_allreduce_bytes", "sparse_mean", "sparse_mean_bytes", "sparse_row",
           "sum_across_", "wire_dtype"]

"""Compressed collectives over a ProcessGroup, byte accounting and the simulated cluster."""

from .accounting import ByteCounter, StepStats, ring_allreduce_bytes
from .allreduce import MODES, CompressedAllreduce
from .simulated import SimulatedCluster

__all__ = ["MODES", "ByteCounter", "CompressedAllreduce", "SimulatedCluster", "StepStats",
           "ring_allreduce_bytes"]

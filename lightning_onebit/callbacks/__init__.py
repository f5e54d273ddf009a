"""Phase switching, replica synchronisation and communication monitoring callbacks."""

from .monitor import CommunicationMonitor
from .phase import PhaseSwitch, find_compressed_optimizer, find_compressed_optimizers
from .replicas import ReplicaSync

__all__ = ["CommunicationMonitor", "PhaseSwitch", "ReplicaSync", "find_compressed_optimizer",
           "find_compressed_optimizers"]

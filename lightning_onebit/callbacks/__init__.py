"""Phase switching and communication monitoring callbacks."""

from .monitor import CommunicationMonitor
from .phase import PhaseSwitch, find_compressed_optimizer

__all__ = ["CommunicationMonitor", "PhaseSwitch", "find_compressed_optimizer"]

"""Phase switching and communication monitoring callbacks."""

from .monitor import CommunicationMonitor
from .phase import PhaseSwitch

__all__ = ["CommunicationMonitor", "PhaseSwitch"]

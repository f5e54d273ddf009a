"""The error a failed collective raises, for both families."""

from __future__ import annotations

from .topology import rank

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective failed (another rank died, stalled past the process group's timeout, or the network
    broke); the message names the collective, where it ran (bucket or fragment) and the step."""

    @classmethod
    def lost(cls, failed: str, exc: BaseException, then: str = "") -> CollectiveError:
        """``failed`` (what failed, and where) on this rank, with the process group's error ``exc``."""
        return cls(f"{failed} on rank {rank()}: {exc}. Another rank has probably died or stalled; the process "
                   f"group's timeout bounds the wait{then}")

"""Byte accounting for collectives: what a rank put on the wire, per step and in total.

A :class:`ByteCounter` is cheap (plain Python ints) and can be shared: every collective of
an optimizer or strategy adds to the same counter; the optimizer closes each step with
:meth:`ByteCounter.end_step`, and the Lightning layer logs the closed step (``last``).

It also counts communication *rounds*: steps (or out-of-step synchronisations, closed with
:meth:`ByteCounter.end_round`) in which anything was sent. Most algorithms communicate in every
step; 0/1 Adam's local steps send nothing, and the rounds are what its latency bill depends on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) allreduce: 2 (n-1)/n * size."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * numel * element_size // world_size


@dataclass
class StepStats:
    bytes_sent: int = 0
    numel: int = 0  # elements reduced (each bucket's real, unpadded size)
    fp32_ring_bytes: int = 0  # what an fp32 ring allreduce of the same tensors would send

    def __add__(self, other: StepStats) -> StepStats:
        """Figures of two counters together (e.g. several optimizers of one model)."""
        return StepStats(self.bytes_sent + other.bytes_sent, self.numel + other.numel,
                         self.fp32_ring_bytes + other.fp32_ring_bytes)

    @property
    def bits_per_param(self) -> float:
        return 8.0 * self.bytes_sent / self.numel if self.numel else 0.0

    @property
    def ratio_vs_fp32(self) -> float:
        """fp32 ring-allreduce bytes / bytes actually sent (32 ~ the 1-bit ideal)."""
        return self.fp32_ring_bytes / self.bytes_sent if self.bytes_sent else 0.0


@dataclass
class ByteCounter:
    """Cumulative and current-step byte figures of the collectives that report to it."""

    total: StepStats = field(default_factory=StepStats)
    current: StepStats = field(default_factory=StepStats)
    last: StepStats = field(default_factory=StepStats)  # the most recently closed step
    steps: int = 0
    rounds: int = 0  # closed steps and out-of-step synchronisations that sent anything
    _round_open: bool = False

    def add(self, bytes_sent: int, numel: int, world_size: int) -> None:
        fp32 = ring_allreduce_bytes(numel, world_size)
        for s in (self.total, self.current):
            s.bytes_sent += bytes_sent
            s.numel += numel
            s.fp32_ring_bytes += fp32
        self._round_open = self._round_open or world_size > 1

    def add_baseline(self, numel: int, world_size: int) -> None:
        """Count ``numel`` elements whose fp32 ring all-reduce a method skipped (DiLoCo's inner steps):
        the baseline grows, nothing was sent and no round opens."""
        fp32 = ring_allreduce_bytes(numel, world_size)
        for s in (self.total, self.current):
            s.numel += numel
            s.fp32_ring_bytes += fp32

    def end_round(self) -> None:
        """Close a round of communication outside a step (e.g. a synchronisation before validation)."""
        self.rounds += self._round_open
        self._round_open = False

    def end_step(self) -> StepStats:
        """Close the current step (and its round, if it communicated) and return its figures."""
        self.end_round()
        self.last, self.current = self.current, StepStats()
        self.steps += 1
        return self.last

    @property
    def bytes_sent(self) -> int:
        return self.total.bytes_sent

    def state_dict(self) -> dict:
        t = self.total
        return {"bytes_sent": t.bytes_sent, "numel": t.numel, "fp32_ring_bytes": t.fp32_ring_bytes,
                "steps": self.steps, "rounds": self.rounds}

    def load_state_dict(self, sd: dict) -> None:
        self.total = StepStats(sd["bytes_sent"], sd["numel"], sd["fp32_ring_bytes"])
        self.current = StepStats()
        self.steps = sd["steps"]
        self.rounds = sd.get("rounds", 0)
        self._round_open = False

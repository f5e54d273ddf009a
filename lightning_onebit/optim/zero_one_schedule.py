"""0/1 Adam's schedule: which steps refresh the variance, which synchronise (DeepSpeed's rules)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .fractions import check_steps

__all__ = ["STEP_KINDS", "ZeroOneSchedule", "check_steps"]

#: kinds of step: the variance is refreshed (fp32 gradient mean), the gradient is synchronised
#: 1-bit, a local step that sends nothing, a local step that ends with a 1-bit synchronisation
STEP_KINDS = ("refresh", "onebit", "local", "sync")


@dataclass
class ZeroOneSchedule:
    """Which steps refresh the variance and which synchronise, DeepSpeed's rules counted from step 1.

    Up to ``var_freeze_step`` (phase A) step ``t`` refreshes the variance if ``t % var_interval == 0``
    and synchronises a 1-bit gradient otherwise; every ``var_update_scaler`` refreshes the interval
    doubles. After it (phase B) the variance is frozen and step ``t`` ends with a 1-bit
    synchronisation if ``t % local_interval == 0`` and is a local step otherwise; every
    ``local_step_scaler`` phase-B steps the interval doubles, up to ``local_step_clipper`` (H).
    """

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    var_interval: int = 1
    var_counter: int = 0
    local_interval: int = 1
    local_counter: int = 0

    def kind(self, t: int) -> str:
        """The kind of step ``t`` (1-based), given the steps before it were taken."""
        if t <= self.var_freeze_step:
            return "refresh" if t % self.var_interval == 0 else "onebit"
        return "sync" if t % self.local_interval == 0 else "local"

    def advance(self, t: int) -> None:
        """Step ``t`` was taken."""
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, 2 * self.var_interval
        else:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)

    def kinds(self, steps: int) -> list[str]:
        """The kinds of steps 1..``steps`` from this state (the state is not changed)."""
        s, out = dataclasses.replace(self), []
        for t in range(1, steps + 1):
            out.append(s.kind(t))
            s.advance(t)
        return out

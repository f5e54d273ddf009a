"""QAdam (Bagua): 1-bit Adam's phases with 8-bit min-max quantised momentum, no error feedback."""

from __future__ import annotations

from ..comm import Wire
from .onebit_adam import OnebitAdam

__all__ = ["QAdam"]


class QAdam(OnebitAdam):
    r"""QAdam (Bagua): AdamW warm-up, then frozen variance and 8-bit min-max quantised
    momentum exchanged with the two-stage scheme, without error feedback.

    Same update as :class:`OnebitAdam`, including ``eps_inside_sqrt`` (default ``True``: with
    ``sqrt(v_hat) + eps`` the digits quickstart diverges at lr 3e-3 after the switch, as 1-bit Adam
    does). Unlike Bagua, weight decay keeps working after warm-up and no gradient is dropped at the
    switch. Memory per parameter: m, v (fp32): 8 bytes of state.
    """

    strategy_name = "qadam"
    comm_mode = "plain"
    wire = Wire.minmax(8)

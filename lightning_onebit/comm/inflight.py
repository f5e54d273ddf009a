"""A call of :class:`~.allreduce.CompressedAllreduce` in flight: its agreement round and its phase, and
:func:`check_together`, which reads the agreements of several begun calls from the device at once.

A call's agreement is what every rank must see alike before any state is written (sizes, codec, mode,
flags, every input finite): with several ranks a gather of each rank's signature, at world size 1 the
local finiteness flags. Each is one host read of the device, the step's waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from .allreduce import CompressedAllreduce

__all__ = ["Agreement", "Call", "check_together"]


class Agreement(NamedTuple):
    """An agreement round :meth:`~.allreduce.CompressedAllreduce._agree_start` began: ``work`` None when
    it needs no round."""

    prev: torch.Tensor | None  # the previous call's server scales were finite (GPU), read in this round
    ok: bool | torch.Tensor  # this rank's input (and what it vouched for) is finite
    allsig: torch.Tensor | None = None  # every rank's signature, once ``work`` is done
    work: Any = None  # the gather of the signatures, on the wire
    host: np.ndarray | None = None  # ``allsig`` read to the host already (:func:`check_together`)


class Call:
    """A call of :class:`~.allreduce.CompressedAllreduce` in flight: its phase and what the next phase needs."""

    __slots__ = ("x", "xp", "scales", "agreement", "works", "phase")

    def __init__(self, x, xp, scales, agreement: Agreement) -> None:
        self.x, self.xp, self.scales, self.agreement = x, xp, scales, agreement
        self.works: list = []  # the collectives of the last phase, waited for by the next
        self.phase = "begun"


def check_together(calls: Sequence[CompressedAllreduce]) -> None:
    """The agreements of begun calls read from the device once for all of them, where
    :meth:`~.allreduce.CompressedAllreduce.send` reads them one call at a time, a wait for the device
    each: the gathered signatures of the calls with a round (several ranks), in one read; the local flags of those
    without (world size 1, or ``verify="first"`` once verified: input finite, previous server scales
    finite), in one read. When the local flags all hold those calls' checks are done; when one does not,
    nothing is changed and each call raises as it would have. The collectives are the calls' own: every
    rank still issues the same ones in the same order, and each call still compares its ranks' fields."""
    begun = [c.in_flight for c in calls if c.in_flight is not None and c.in_flight.phase == "begun"]
    rounds = [call for call in begun if call.agreement.work is not None and call.agreement.host is None]
    if len(rounds) > 1 and len({(c.agreement.allsig.device, c.agreement.allsig.shape) for c in rounds}) == 1:
        for call in rounds:
            call.agreement.work.wait()
        host = torch.stack([call.agreement.allsig for call in rounds]).cpu().numpy()  # one read
        for call, sig in zip(rounds, host, strict=True):
            call.agreement = call.agreement._replace(host=sig)
    local = [call for call in begun if call.agreement.work is None]
    flags = [f for call in local for f in call.agreement[:2] if f is not None]
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    if len(tensors) < 2 or len({t.device for t in tensors}) > 1 or not all(f for f in flags if isinstance(f, bool)):
        return  # nothing to save, or a local failure the calls report themselves
    if len({t.shape for t in tensors}) > 1:  # flags of one element, some 0-d
        tensors = [t.reshape(()) for t in tensors]
    if bool(torch.stack(tensors).all()):
        for call in local:
            call.agreement = Agreement(None, True)

"""A call of :class:`~.allreduce.CompressedAllreduce` in flight: its agreement round and its phase, and
:func:`check_together`, which reads the agreements of several begun calls from the device at once.

A call's agreement is what every rank must see alike before any state is written (sizes, codec, mode,
flags, every input finite): with several ranks a gather of each rank's signature, at world size 1 the
local finiteness flags. Each is one host read of the device, the step's waits for it - except on the cuda
backend where the caller asked for it (``skip_on_device``): there the flags are combined on the device
into one ``go`` flag that every write of the step is predicated on, and the host learns the outcome a
step later through a non-blocking copy (:class:`Verdict`), as fused AdamW's ``found_inf`` skips a step
with no sync. With several ranks the flags are the gathered signatures' (every rank computes the same
``go`` from the same bytes), once a call of the collective was verified on the host: its sizes, codec,
mode and groups are fixed for the collective's life, so what is left to agree on is finiteness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from .allreduce import CompressedAllreduce

__all__ = ["Agreement", "Call", "Verdict", "check_together"]


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

    __slots__ = ("x", "xp", "scales", "agreement", "works", "phase", "on_device", "go")

    def __init__(self, x, xp, scales, agreement: Agreement, on_device: bool = False) -> None:
        self.x, self.xp, self.scales, self.agreement = x, xp, scales, agreement
        self.works: list = []  # the collectives of the last phase, waited for by the next
        self.phase = "begun"
        self.on_device = on_device  # its agreement may be decided on the device (check_together)
        self.go: torch.Tensor | None = None  # then: the flag its writes are predicated on


class Verdict:
    """The flags a step's calls were predicated on (:func:`check_together`), on their way to the host: a
    non-blocking copy into pinned memory, read when it has arrived - a step later, so that nothing waits
    for the device on the step's path. ``calls``: the collective each flag belongs to and what it says
    (``"input"``: its input and what it vouched for are finite; ``"server"``: the server scales of its
    previous call were). ``flags``: one per call and kind (bool), or with several ranks the gathered
    signatures (``[calls, ranks, 3]`` of their last three fields, or one call's ``[ranks, len]``), whose
    fields the host ANDs over the ranks when it reads them, so that the device makes no flags of its own; their
    flag field says whether some rank raised a call's flag (:meth:`flagged`)."""

    #: host buffers a step's flags are copied into, reused in turn: a step has read the verdict two steps
    #: back before it makes a new one (:meth:`~lightning_onebit.optim.CompressedOptimizer.settle_device_skips`)
    RING = 4

    @classmethod
    def buffers(cls, flags: torch.Tensor) -> list[torch.Tensor]:
        """The host buffers of :attr:`RING` verdicts of ``flags`` (pinned on a GPU: a copy into pageable
        memory would wait for the device)."""
        return [torch.empty(flags.shape, dtype=flags.dtype, pin_memory=flags.is_cuda) for _ in range(cls.RING)]

    def __init__(self, flags: torch.Tensor, calls: list[tuple[Any, str]], ring: list[torch.Tensor] | None, *,
                 gathered: bool = False) -> None:
        self.calls = calls
        self.gathered = gathered
        self.flags: torch.Tensor | None = flags  # on the device until sent
        self.host: torch.Tensor | None = None
        self.event = None
        if ring is not None:
            self._send(flags, ring)

    def _send(self, flags: torch.Tensor, ring: list[torch.Tensor]) -> None:
        self.host = _rotate(ring)
        self.event = _to_host(self.host, flags)
        self.flags = None

    @classmethod
    def send_together(cls, verdicts: Sequence[Verdict], keep: dict) -> None:
        """Verdicts made unsent (``ring=None``: a DDP hook's, one a bucket) on their way to the host in one
        copy: their flags stacked on the device into a buffer kept in ``keep`` (the caller's, one per count and
        shape, so that nothing is allocated a step), that copied into pinned memory once, and each verdict
        reading its row of it. The flags' buffers are the collectives' own, which their next call rewrites:
        send them before it begins (the stream orders the copy first)."""
        unsent: dict[tuple, list[Verdict]] = {}
        for v in verdicts:
            if v.host is None:
                unsent.setdefault((v.flags.shape, v.flags.dtype, v.flags.device), []).append(v)
        for (shape, dtype, device), group in unsent.items():
            key = (len(group), shape, dtype, device)
            bufs = keep.get(key)
            if bufs is None:  # the host buffers with their rows' views, made once
                stacked = torch.empty((len(group), *shape), dtype=dtype, device=device)
                bufs = keep[key] = (stacked, [(h, list(h)) for h in cls.buffers(stacked)])
            stacked, ring = bufs
            host, rows = _rotate(ring)
            if len(group) == 1:  # nothing to stack: its flags go as they are
                event = _to_host(rows[0], group[0].flags)
            else:
                torch.stack([v.flags for v in group], out=stacked)
                event = _to_host(host, stacked)
            for v, row in zip(group, rows, strict=True):
                v.host, v.event, v.flags = row, event, None

    def ready(self) -> bool:
        """The flags have reached the host (no wait)."""
        self._check_sent()
        return self.event is None or self.event.query()

    def _check_sent(self) -> None:
        if self.host is None:
            raise RuntimeError("Verdict: its flags were never sent to the host (Verdict.send_together)")

    def read(self) -> tuple[bool, list]:
        """(every call's input finite, the collectives whose previous server scales were not); waits for
        the copy if it has not arrived yet."""
        flags = self.values()
        if self.gathered:  # each call's (server, input) fields, ANDed over the ranks
            flags = flags[..., -2:].astype(bool).all(axis=-2).reshape(-1)
        finite = all(bool(f) for f, (_, what) in zip(flags, self.calls, strict=True) if what == "input")
        overflowed = [c for f, (c, what) in zip(flags, self.calls, strict=True) if what == "server" and not f]
        return finite, overflowed

    def flagged(self) -> bool:
        """Some rank's flag (``CompressedAllreduce.__call__``'s ``flag=``) was nonzero in one of the calls: the
        gathered signatures' flag field, the same on every rank (False without several ranks). Waits like
        :meth:`read`."""
        return self.gathered and bool(self.values()[..., -3].any())

    def values(self) -> np.ndarray:
        """The copied flags (or any small tensor given as ``flags``) as they reached the host; waits for the
        copy if it has not arrived yet."""
        self._check_sent()
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


def _rotate(ring: list) -> Any:
    """The oldest of a ring's buffers, made the newest."""
    ring.append(ring.pop(0))
    return ring[-1]


def _to_host(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
    """``src`` copied into host memory ``dst`` without waiting for the device (pinned on a GPU), and the event
    recorded after the copy on a GPU (None elsewhere: the copy has happened)."""
    dst.copy_(src, non_blocking=True)
    if not src.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def check_together(calls: Sequence[CompressedAllreduce], *, send: bool = True) -> Verdict | None:
    """The agreements of begun calls read from the device once for all of them, where
    :meth:`~.allreduce.CompressedAllreduce.send` reads them one call at a time, a wait for the device
    each: the gathered signatures of the calls with a round (several ranks), in one read; the local flags of those
    without (world size 1, or ``verify="first"`` once verified: input finite, previous server scales
    finite), in one read. When the local flags all hold those calls' checks are done; when one does not,
    nothing is changed and each call raises as it would have. The collectives are the calls' own: every
    rank still issues the same ones in the same order, and each call still compares its ranks' fields.

    Where every begun call may be decided on the device (``on_device``: the cuda backend, the caller's
    ``skip_on_device``, with several ranks a collective verified once), nothing is read: the flags (with
    several ranks every rank's, from the gathered signatures) are ANDed on the device into ``go``, which
    every call's encodes and its decode are predicated on, and the returned :class:`Verdict` brings them
    to the host a step later; ``send=False``: not yet, the caller sends it with others
    (:meth:`Verdict.send_together`)."""
    owners = {id(c.in_flight): c for c in calls if c.in_flight is not None and c.in_flight.phase == "begun"}
    begun = [c.in_flight for c in calls if id(c.in_flight) in owners]
    rounds = [call for call in begun if call.agreement.work is not None and call.agreement.host is None]
    alike = len({(c.agreement.allsig.device, c.agreement.allsig.shape) for c in rounds}) == 1  # stack as one
    if rounds and alike and len(rounds) == len(begun) and all(call.on_device for call in begun):
        return _decide_gathered_on_device(calls[0], [(owners[id(call)], call) for call in rounds], send)
    if len(rounds) > 1 and alike:
        for call in rounds:
            call.agreement.work.wait()
        stacked, read = _kept(calls[0], "_read_sigs", rounds[0].agreement.allsig, len(rounds), host=True)
        torch.stack([call.agreement.allsig for call in rounds], out=stacked)
        host = read.copy_(stacked).numpy()  # one read
        for call, sig in zip(rounds, host, strict=True):
            call.agreement = call.agreement._replace(host=sig)
    local = [call for call in begun if call.agreement.work is None]
    flags = [f for call in local for f in call.agreement[:2] if f is not None]
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    device_side = bool(local) and len(local) == len(begun) and all(call.on_device for call in local)
    if (len(tensors) < (1 if device_side else 2) or len({t.device for t in tensors}) > 1
            or not all(f for f in flags if isinstance(f, bool))):
        return None  # nothing to save, or a local failure the calls report themselves
    if len({t.shape for t in tensors}) > 1:  # flags of one element, some 0-d
        tensors = [t.reshape(()) for t in tensors]
    if device_side:
        return _decide_on_device(calls[0], [(owners[id(call)], call) for call in local], tensors, send)
    stacked, every = _kept(calls[0], "_read_flags", tensors[0], len(tensors))
    torch.stack(tensors, out=stacked)
    if bool(torch.all(stacked, out=every)):  # one read
        for call in local:
            call.agreement = Agreement(None, True)
    return None


def _kept(owner: CompressedAllreduce, name: str, like: torch.Tensor, n: int,
          host: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` tensors like ``like`` stacked, and their host copy (``host``) or their AND: buffers ``owner``
    keeps under ``name``, made again only for other flags, so that reading the agreements allocates nothing."""
    key = (like.device, like.dtype, n, like.shape)
    bufs = owner.__dict__.get(name)
    if bufs is None or bufs[0] != key:
        stacked = torch.empty((n, *like.shape), dtype=like.dtype, device=like.device)
        other = (torch.empty(stacked.shape, dtype=like.dtype, pin_memory=like.is_cuda) if host
                 else torch.empty((), dtype=torch.bool, device=like.device))
        bufs = owner.__dict__[name] = (key, stacked, other)
    return bufs[1], bufs[2]


def _decide_on_device(owner: CompressedAllreduce, local: list[tuple[CompressedAllreduce, Call]],
                      tensors: list[torch.Tensor], send: bool = True) -> Verdict:
    """The calls' flags ANDed into ``go`` on the device, every call predicated on it, and their way to the
    host begun. The buffers are ``owner``'s (the first call's collective), reused every step: the stream
    orders a step's writes after the last step's reads."""
    key = (tensors[0].device, len(tensors), tensors[0].shape)
    bufs = owner.__dict__.get("_step_flags")
    if bufs is None or bufs[0] != key:
        stacked = torch.empty((len(tensors), *tensors[0].shape), dtype=torch.bool, device=tensors[0].device)
        go = torch.empty(1, dtype=torch.bool, device=tensors[0].device)
        flat = stacked.view(-1)
        bufs = owner.__dict__["_step_flags"] = (key, stacked, go, go.view(()), flat, Verdict.buffers(flat))
    _, stacked, go, go0, flat, ring = bufs
    torch.stack(tensors, out=stacked)
    torch.all(stacked, out=go0)
    what = [(call_owner, kind) for call_owner, call in local for kind, f in (("server", call.agreement.prev),
                                                                          ("input", call.agreement.ok))
            if isinstance(f, torch.Tensor)]
    for _, call in local:
        call.agreement, call.go = Agreement(None, True), go
    return Verdict(flat, what, ring if send else None)


def _decide_gathered_on_device(owner: CompressedAllreduce, rounds: list[tuple[CompressedAllreduce, Call]],
                               send: bool = True) -> Verdict:
    """:func:`_decide_on_device` with several ranks: ``go`` from the gathered signatures' last two fields
    (every rank's previous server scales finite, its input finite), the same on every rank. Waiting for a
    gather makes the stream wait for it on NCCL, the host for its bytes on gloo: neither reads the device."""
    allsig = rounds[0][1].agreement.allsig
    # a collective's gathered signatures stay in one buffer (its _sig_buffers), so their views are made once
    key = (allsig.device, allsig.shape, *(id(c) for c, _ in rounds), *(id(call.agreement.allsig) for _, call in rounds))
    bufs = owner.__dict__.get("_step_sigs")
    if bufs is None or bufs[0] != key:
        # one call's fields are ANDed where they were gathered; several calls' (flag, server, input) are stacked
        # first, the flag for the host alone
        sigs = None if len(rounds) == 1 else torch.empty((len(rounds), allsig.shape[0], 3), dtype=allsig.dtype,
                                                        device=allsig.device)
        go = torch.empty(1, dtype=torch.bool, device=allsig.device)
        what = [(collective, kind) for collective, _ in rounds for kind in ("server", "input")]
        fields = [call.agreement.allsig[:, -2:] if sigs is None else call.agreement.allsig[:, -3:]
                  for _, call in rounds]
        # what reaches the host: the one call's signatures as they were gathered, or the calls' fields stacked
        shown = allsig if len(rounds) == 1 else sigs
        checked = None if sigs is None else sigs[..., 1:]
        bufs = owner.__dict__["_step_sigs"] = (key, sigs, go, go.view(()), shown, Verdict.buffers(shown), what,
                                               fields, checked)
    _, sigs, go, go0, shown, ring, what, fields, checked = bufs
    for _, call in rounds:
        call.agreement.work.wait()
    # go: every rank's server scales finite and every rank's input finite, for every call
    if len(fields) == 1:  # DDP's hook decides bucket by bucket: nothing to stack
        torch.all(fields[0], out=go0)
    else:
        torch.stack(fields, out=sigs)
        torch.all(checked, out=go0)
    for collective, call in rounds:
        call.agreement, call.go = Agreement(None, True), go
        collective.any_flag, collective.flag_values = False, [0] * collective.world_size
    return Verdict(shown, what, ring if send else None, gathered=True)

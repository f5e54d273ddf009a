"""The agreement round of a :class:`~.allreduce.CompressedAllreduce` call (its ``verify=``) and its
server-overflow check.

Before a call writes any state every rank must see the same thing: sizes, dtype, codec, mode and scale
groups, the flag it sends, and every rank's input finite. With several ranks that is one tiny
``all_gather`` of each rank's signature (its buffers made once per collective), compared on the host; at
world size 1 the local finiteness flags. A mismatch or a NaN raises ``ValueError`` on every rank alike
(:class:`NonFiniteInputError` for a NaN) instead of a hang or garbage. The gathered server scales are
finite or, on a GPU, flag the next call's agreement (see :mod:`~.allreduce`).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .dense import all_gather_rows, collective_device
from .inflight import Agreement
from .two_stage import MODES

__all__ = ["AgreementRound", "NonFiniteInputError"]

_MODE_ID = {m: i for i, m in enumerate(MODES)}
_DTYPE_ID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


class NonFiniteInputError(ValueError):
    """Some rank's input (or what it vouched for with ``finite=``) held NaN/inf: every rank raises
    this in the agreement round, before any state is written."""


class AgreementRound:
    """The agreement and the server-overflow check of :class:`~.allreduce.CompressedAllreduce` (whose
    group, ranks, codec, mode, groups, ``verify`` and state it uses; the attributes below are set by its
    constructor)."""

    _sig_bufs: tuple | None
    _groups_crc: tuple | None
    _gathered_ok: torch.Tensor | None
    _verified: bool

    # -- the server-overflow check -------------------------------------------------------
    def check_gathered(self, piece0: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """Before stage 4: the gathered server scales (piece 0, the same bytes on every rank) are
        finite - raises on the CPU, flags the next agreement where the codec's kernels keep their flags on the
        device (a GPU; the cuda backend on CPU tensors, under numba's simulator, as on a GPU; see the module
        docstring) or ``on_device`` (a call decided on the device). Returns the flag."""
        ok = self.gathered_finite(piece0)
        if ok.device.type != "cpu" or on_device or self.codec.predicates(ok.device):
            self._gathered_ok = ok if self._gathered_ok is None else self._gathered_ok & ok
        elif not bool(ok):
            self._server_overflowed()
        return ok

    def _server_overflowed(self) -> None:
        self.reset_state()  # every rank resets alike, so replicas and Markov estimates stay in step
        raise ValueError("CompressedAllreduce: a server's mean overflowed fp32, so the result is not finite "
                         "(inputs near the fp32 limit); every rank raised and reset its error/estimate state")

    # -- the agreement -------------------------------------------------------------------
    def _signature(self, x: torch.Tensor, flag: int, ok: bool) -> list[int]:
        bs = self.codec.block_size or 0
        if self._groups_crc is None or self._groups_crc[0] is not self.groups:
            self._groups_crc = (self.groups, zlib.crc32(np.asarray(self.groups, np.int64).tobytes()))
        groups = self._groups_crc[1]
        # the last three fields: flag, the previous call's server scales finite (GPU), input finite
        return [x.numel(), _DTYPE_ID.get(x.dtype, 9), self.codec.kind, bs, _MODE_ID[self.mode],
                int(getattr(self.codec, "scale", "l2") == "l1"), groups, flag, 1, int(ok)]

    def _agree(self, x: torch.Tensor, ok: bool | torch.Tensor, flag: int | torch.Tensor | None = None,
               finite: bool | torch.Tensor | None = None) -> None:
        """All ranks exchange (size, dtype, codec, mode, flag, finite) and raise together on disagreement.

        ``ok`` may be a 0-d bool tensor on the data's device: it is written into the signature on
        the device, and the gathered signatures are the one thing the host waits for. ``finite`` (the
        caller's other data) is ANDed into it; it and ``flag`` need ``verify="always"``, whose every
        call has the round they ride in."""
        self._agree_finish(self._agree_start(x, ok, flag, finite))

    def _agree_start(self, x: torch.Tensor, ok: bool | torch.Tensor, flag: int | torch.Tensor | None = None,
                     finite: bool | torch.Tensor | None = None, *, on_device: bool = False) -> Agreement:
        """:meth:`_agree` up to its round on the wire (not waited for): what :meth:`_agree_finish` takes.
        Nothing is written but the flag of this rank alone; a local error raises here. ``on_device`` (a
        call that may be decided on the device): with several ranks always a round, which carries the
        flags, and no read of ``ok``."""
        for name, arg in (("flag", flag), ("finite", finite)):
            if arg is not None and self.verify != "always" and self.world_size > 1:
                raise ValueError(f"{type(self).__name__}: {name}= needs verify='always' (it rides in the "
                                 "per-call agreement round)")
        if finite is not None:
            if (isinstance(ok, torch.Tensor) and isinstance(finite, torch.Tensor) and ok.dtype == torch.bool
                    and ok.device == finite.device and ok.dim() >= finite.dim()):
                ok = ok.logical_and_(finite)  # this call's own flag buffer, rewritten by its next reduction
            else:
                ok = torch.as_tensor(ok, device=x.device) & torch.as_tensor(finite, device=x.device)
        # a flag on the device (one element) goes into the signature there where the call is decided on the
        # device: every rank learns it from the gathered signatures a step later (Verdict.flagged)
        device_flag = flag if isinstance(flag, torch.Tensor) and on_device and self.world_size > 1 else None
        mine_flag = 0 if device_flag is not None else int(flag or 0)
        if mine_flag < 0:
            raise ValueError(f"{type(self).__name__}: flag must be a bool or a non-negative int, got {flag}")
        self.any_flag, self.flag_values = bool(mine_flag), [mine_flag]
        prev, self._gathered_ok = self._gathered_ok, None
        if self.world_size == 1 or (self.verify == "first" and self._verified and not on_device and bool(ok)):
            return Agreement(prev, ok)  # no round: _agree_finish checks locally
        dev = collective_device(self.group, x.device)
        sig = self._signature(x, mine_flag, ok if isinstance(ok, bool) else True)
        (stage, stage_np, mine, allsig, _, mine_prev, mine_ok, fan, mine_row, mine_flags,
         mine_flag_field) = self._sig_buffers(dev, len(sig))
        stage_np[:] = sig  # numpy's write: no torch op, no host tensor per call
        if mine is not stage:  # pinned: the copy does not wait for the stream, as a pageable one would
            mine.copy_(stage, non_blocking=True)
        if device_flag is not None:
            mine_flag_field.copy_(device_flag)
        pair = getattr(self, "_flag_pair", None)
        if (prev is not None and isinstance(ok, torch.Tensor) and pair is not None and pair.device == dev
                and prev.data_ptr() == pair.data_ptr() and ok.data_ptr() == pair.data_ptr() + 1):
            mine_flags.copy_(pair)  # a call decided on the device: its two flags lie side by side, one copy
        else:
            if isinstance(ok, torch.Tensor):  # on the same device no wait; CUDA -> CPU (gloo) waits here
                mine_ok.copy_(ok)
            if prev is not None:
                mine_prev.copy_(prev)
        return Agreement(prev, ok, allsig, all_gather_rows(allsig, mine_row, group=self.group, async_op=True,
                                                               send=fan))

    def _sig_buffers(self, dev: torch.device, length: int) -> tuple:
        """The agreement's buffers, made once per device and reused by every call: (host staging, its
        numpy view, this rank's signature on ``dev``, every rank's, their host copy, views of the
        signature's last two fields, a fanout's staging of this rank's copies, the signature as a
        ``[1, len]`` row, which a gather takes without a view, its last two fields as one view, and its flag
        field). A call's buffers are free again once its round was read (a call is begun only after the previous
        one completed, and the read waits for the round), so a staging copy still in flight is never overwritten."""
        bufs = self._sig_bufs
        if bufs is None or bufs[2].device != dev:
            on_cpu = dev.type == "cpu"
            # on the CPU (gloo) the staging is what goes on the wire
            stage = torch.empty(length, dtype=torch.int64, device=dev) if on_cpu else torch.empty(
                length, dtype=torch.int64, pin_memory=True)
            mine = stage if on_cpu else torch.empty(length, dtype=torch.int64, device=dev)
            allsig = torch.empty(self.world_size, length, dtype=torch.int64, device=dev)
            host = torch.empty(self.world_size, length, dtype=torch.int64, pin_memory=not on_cpu)
            bufs = self._sig_bufs = (stage, stage.numpy(), mine, allsig, host, mine[-2:-1], mine[-1:],
                                     torch.empty_like(allsig), mine.view(1, -1), mine[-2:], mine[-3:-2])
        return bufs

    def _agree_finish(self, started: Agreement) -> None:
        """Wait for the round :meth:`_agree_start` began and raise, on every rank alike, on what it shows."""
        prev, ok, allsig, work, host = started
        if work is None:
            if prev is not None and not bool(prev):
                self._server_overflowed()
            if not bool(ok):
                raise NonFiniteInputError("CompressedAllreduce: the input is not finite (NaN or inf); "
                                          "no state was changed")
            return
        if host is None:
            work.wait()
            read = self._sig_bufs[4]  # one read into a buffer of its own; the fields compared by numpy
            read.copy_(allsig)
            host = read.numpy()
        allsig = host
        fields = ["numel", "dtype", "codec kind", "block_size", "mode", "l1 scale", "groups (crc32)"]
        bad = [f for i, f in enumerate(fields) if not (allsig[:, i] == allsig[0, i]).all()]
        if bad:
            rows = "; ".join(
                f"rank {r}: " + ", ".join(f"{f}={int(allsig[r, i])}" for i, f in enumerate(fields))
                for r in range(self.world_size))
            raise ValueError(f"CompressedAllreduce: ranks disagree on {', '.join(bad)} ({rows})")
        self.flag_values = allsig[:, -3].tolist()
        self.any_flag = any(self.flag_values)
        if not allsig[:, -2].all():
            self._server_overflowed()
        nonfinite = [r for r in range(self.world_size) if not int(allsig[r, -1])]
        if nonfinite:
            raise NonFiniteInputError(f"CompressedAllreduce: the input on rank(s) {nonfinite} is not finite "
                                      "(NaN or inf); every rank skipped this call and no state was changed")
        self._verified = True

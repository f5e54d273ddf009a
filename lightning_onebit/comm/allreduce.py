"""Two-stage compressed allreduce over a torch.distributed process group.

:class:`CompressedAllreduce` is a :class:`~lightning_onebit.comm.two_stage.TwoStageRank` (the
arithmetic, the state and the pipeline pieces: see :mod:`lightning_onebit.comm.two_stage`) whose
two exchanges are collectives: ``all_to_all_single`` after stage 1 (row j to rank j) and
``all_gather_into_tensor`` of the server rows after stage 3. With several pieces, the
collectives of piece k run asynchronously while piece k+1 is encoded, or piece k-1 decoded.

A call is exactly those two data collectives, plus one tiny ``all_gather`` that checks that the
ranks agree on the tensor size, codec and mode and that every rank's input is finite,
before any state is written. A mismatch or a NaN on any rank raises ``ValueError`` on
*every* rank instead of a hang or garbage. A server's mean that overflows fp32 (see
:mod:`~lightning_onebit.comm.two_stage`) shows in the gathered server scales, which every rank
checks before stage 4 decodes. On the CPU that check is free, and every rank raises
there with the result untouched and the error state reset; on a GPU reading it would make the
host wait for the whole call, so the flag stays on the device and the next call's agreement
(the one host wait per call) raises on every rank - the overflowing call's result then holds
non-finite values, except in a step decided on the device (:mod:`.inflight`), whose decode is
predicated on that flag. The agreement is :mod:`.verify`'s. That check costs one
small-message latency
per call; pass ``verify="first"`` where the caller guarantees agreement (DDP buckets are
verified by DDP itself), trading it for a process-group timeout if a rank goes astray.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..compress import Codec, Source, flat_buffer
from .accounting import ByteCounter
from .dense import all_gather_rows, collective_device, fans_out, launcher_ranks_per_node
from .duplex import duplex_twin, exchange_rows
from .inflight import Call
from .stage4 import Predicate
from .two_stage import TwoStageRank
from .verify import AgreementRound, NonFiniteInputError

__all__ = ["CompressedAllreduce", "NonFiniteInputError"]

def _one_rank_per_host() -> bool:
    """The launcher's ``LOCAL_WORLD_SIZE`` says one rank per node, or that this group is on one host."""
    local = launcher_ranks_per_node()
    return local is None or local == 1 or local >= dist.get_world_size()


def _group_rank_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class CompressedAllreduce(AgreementRound, TwoStageRank):
    """Compressed estimate of the mean of a 1-D tensor over a process group.

    Args:
        codec: the codec of both stages (``SignCodec`` for 1-bit, ``MinMaxUInt8Codec`` for 8-bit).
        mode: ``"plain"`` (no feedback), ``"error_feedback"`` (worker + server error, 1-bit Adam)
            or ``"markov"`` (EF21 / CD-Adam Markov sequences both ways; returns g_tilde).
        group: process group (``None``: the default group, or a single process if
            torch.distributed is not initialized).
        counter: a :class:`ByteCounter` to report bytes to (e.g. shared by all buckets).
        verify: ``"always"`` (default) or ``"first"``: see the module docstring.
        pieces: column pieces per row for the pipeline (``None``: automatic, see
            :mod:`~lightning_onebit.comm.two_stage`; codecs that are not elementwise, e.g. top-k,
            always use one).
        groups: offsets where the tensors of a flat multi-tensor input start (e.g. a bucket's
            parameters): no scale spans two of them. ``None``: one tensor.
        gather: how the server rows reach every rank: ``"fanout"`` (each rank sends its row to every
            rank in one ``all_to_all_single``: one round trip), ``"ring"`` (``all_gather``: gloo's ring
            waits a round trip per step, n - 1 of them; NCCL's is pipelined) or ``"auto"``: fanout on
            gloo with CPU tensors where the group has one rank per node (or is on one host), ring
            elsewhere. The bytes per rank are the same; on nodes of several ranks a flat fanout moves
            more of them between nodes (each rank's row to every other node's ranks), which is why
            ``auto`` keeps the ring there (the two-level collective fans out between nodes). A fanout
            stages n copies of this rank's server row: as much memory again as the gathered rows.
        duplex: on gloo, send the two exchanges each direction of a rank pair on its own connection
            where the group has a twin (:func:`~lightning_onebit.comm.enable_duplex`; gloo moves about
            one direction's bytes at a time on one connection): the same bytes and result. ``False``:
            the plain collectives (``all_to_all_single``) even there.

    One object serves one tensor (one size): it owns that tensor's error / Markov state.
    """

    def __init__(self, codec: Codec, mode: str = "error_feedback", group=None,
                 counter: ByteCounter | None = None, verify: str = "always",
                 pieces: int | None = None, groups: Sequence[int] | None = None, gather: str = "auto",
                 duplex: bool = True) -> None:
        if verify not in ("always", "first"):
            raise ValueError(f"verify must be 'always' or 'first', got {verify!r}")
        if gather not in ("auto", "fanout", "ring"):
            raise ValueError(f"gather must be 'auto', 'fanout' or 'ring', got {gather!r}")
        super().__init__(codec, mode, *_group_rank_size(group), counter=counter, pieces=pieces, groups=groups)
        self.group = group
        self.verify = verify
        self._recv: list[torch.Tensor] | None = None  # all_to_all_single receives piece k in _recv[k]
        self._gathered: list[torch.Tensor] | None = None  # all_gather of the server rows, per piece
        self.gather = gather
        self.fanout = False  # resolved from ``gather`` by the first bind
        self._fan: list[torch.Tensor | None] = []  # fanout: each piece's row copied once per rank
        self.duplex = duplex
        self._twin = None  # gloo: the group's duplex twin (comm.duplex), if it has one and duplex is on
        self._verified = False
        self._sig_bufs: tuple | None = None  # the agreement's buffers, made once per device (_sig_buffers)
        self._groups_crc: tuple | None = None  # (groups, their crc32) for the signature
        self._gathered_ok: torch.Tensor | None = None  # GPU: server scales finite, read at the next agreement
        self.any_flag = False  # some rank's flag in the last call was nonzero (see __call__)
        self.flag_values: list[int] = [0]  # every rank's flag in the last call, in rank order
        self._inflight: Call | None = None  # a call between begin() and complete(): its phase and buffers
        #: on the cuda backend, a call's flags may be decided on the device (see
        #: :func:`.inflight.check_together`; with several ranks once a call was verified): set by a caller
        #: that reads the :class:`~.inflight.Verdict` a step later and defers its decode (the decode and
        #: its update are then predicated too)
        self.skip_on_device = False
        self._decode_flags: tuple | None = None  # a call decided on the device: its decode's flags and views
        self._sink_in: torch.Tensor | None = None  # what a predicated decode hands its sink

    def bind(self, numel: int, device: torch.device | str) -> None:
        super().bind(numel, device)
        if self._recv is None:  # the first bind: the buffers the collectives receive into
            self._recv = [flat_buffer((self.world_size, p.rb), torch.uint8, self.worker_device) for p in self.plan]
            self._gathered = [flat_buffer((self.world_size, p.rb), torch.uint8, self.worker_device)
                              for p in self.plan]
            gloo_cpu = self.world_size > 1 and fans_out(self.group, self.worker_device)
            self.fanout = self.world_size > 1 and (
                self.gather == "fanout" or (self.gather == "auto" and gloo_cpu and _one_rank_per_host()))
            self._twin = duplex_twin(self.group) if gloo_cpu and self.duplex else None
            self._fan = [flat_buffer((self.world_size, p.rb), torch.uint8, self.worker_device)
                         if self.fanout and self._twin is None else None for p in self.plan]
            self._messages.keep([*self._recv, *self._gathered, *self._fan])

    # -- the collective ------------------------------------------------------------------
    def __call__(self, x: torch.Tensor | Source, out: torch.Tensor | None = None,
                 flag: int | torch.Tensor | None = None, defer: bool = False,
                 finite: bool | torch.Tensor | None = None) -> torch.Tensor | None:
        """Return the compressed mean of ``x`` over the group (bit-identical on all ranks).

        ``flag``: a bool or non-negative int every rank contributes to the agreement round at no extra
        cost; after the call ``flag_values`` lists them in rank order and ``any_flag`` says one was
        nonzero (e.g. how many bytes each rank has to send about the coordinates the optimizer masks).
        Needs ``verify="always"`` (with "first" later calls have no agreement round). A one-element device
        tensor in a call decided on the device (``skip_on_device``, several ranks) is not read: it rides in the
        gathered signatures, and the host learns whether some rank's was nonzero from the step's
        :class:`~.inflight.Verdict` (``flagged``); elsewhere it is read.

        ``finite``: whether this rank's other data (e.g. the gradients of later buckets) is finite,
        ANDed into the agreement's finiteness bit (a bool, or a 0-d bool tensor left on its device):
        a NaN anywhere on any rank then fails this call on every rank with
        :class:`NonFiniteInputError` before any state is written, with no round of its own. Needs
        ``verify="always"``.

        ``defer``: stop after the result is gathered and checked, and return ``None``;
        :meth:`decode_pending` decodes it later (into ``out``), e.g. with a sink that updates the
        parameters in the same pass. Not when a flag was raised (``any_flag``): then the result is
        decoded now, so that the caller can act on it.
        """
        self.start(x, flag=flag, finite=finite)
        return self.complete(out, defer=defer)

    def start(self, x: torch.Tensor | Source, *, flag: int | torch.Tensor | None = None,
              finite: bool | torch.Tensor | None = None) -> None:
        """The first half of a call: :meth:`begin` and :meth:`send`, the stage-1 all-to-all left on the
        wire; :meth:`complete` does the rest. Between the two another collective's call may start
        (each object owns its buffers), so that its stage 1 fills the link while this one's server
        decodes and re-encodes, provided every rank interleaves the calls in the same order. A failed
        agreement raises here, on every rank, and leaves nothing in flight."""
        self.begin(x, flag=flag, finite=finite)
        self.send()

    # A call in phases, for callers that run several calls at once: each phase waits only for what its own
    # call put on the wire one phase earlier, so with the phases of k calls interleaved (every call's
    # begin, then every send, every relay, every complete) their round trips overlap: about 3 a step where
    # the calls one after another wait 3 k. Every rank must issue the phases in the same order.
    def begin(self, x: torch.Tensor | Source, *, flag: int | torch.Tensor | None = None,
              finite: bool | torch.Tensor | None = None) -> None:
        """Phase 1: the worker scales of ``x`` and the agreement round put on the wire; no state written."""
        if self._inflight is not None:
            raise RuntimeError(f"{type(self).__name__}.begin: the previous call was not completed")
        if self.numel is not None and x.numel() != self.numel:
            if self.world_size > 1:
                self._agree(x, True)  # ranks that disagree all raise here instead of hanging
            self.bind(x.numel(), x.device)  # every rank made the same mistake: raise the local explanation
        xp, scales, ok = self.prepare(x)
        # with several ranks once a call was verified on the host (the collective's geometry cannot change),
        # and where the signatures are gathered on the data's device (not a group with a CPU backend only)
        # (a flag then a device tensor, which the gathered signatures carry)
        flag_ok = flag is None or (isinstance(flag, torch.Tensor) and self.world_size > 1)
        on_device = (self.skip_on_device and flag_ok and self.num_pieces == 1 and self.mode != "markov"
                     and self.codec.predicates(xp.device) and (self.world_size == 1 or (
                         self._verified and collective_device(self.group, xp.device) == xp.device)))
        self._inflight = Call(x, xp, scales, self._agree_start(x, ok, flag, finite, on_device=on_device), on_device)

    @property
    def input_finite(self) -> bool | torch.Tensor:
        """The call begun: its input (and what it vouched for with ``finite=``) is finite on this rank, as
        its scale reduction found it (a 0-d bool tensor on the data's device; no host read). A caller
        passes it as the ``finite=`` of another call begun after it, so that one agreement round covers
        both inputs."""
        return self._in_phase("input_finite", "begun").agreement.ok

    def send(self) -> None:
        """Phase 2: wait for the agreement (a failed one raises on every rank and leaves nothing in
        flight), then encode stage 1 and put the all-to-all on the wire, piece k+1 encoded while piece
        k travels."""
        call = self._in_phase("send", "begun")
        try:
            self._agree_finish(call.agreement)
        except BaseException:
            self._inflight = None
            raise
        xp, scales = call.xp, call.scales
        call.xp = call.scales = call.agreement = None
        if self.numel and self.world_size > 1:
            for k in range(self.num_pieces):
                send = self.encode_stage(xp, scales, k, go=call.go)
                if self._twin is not None:
                    call.works.append(exchange_rows(self._recv[k], send, self.group, twin=self._twin, tag=1,
                                                    async_op=True))
                else:
                    call.works.append(dist.all_to_all_single(self._recv[k], send, group=self.group, async_op=True))
        elif self.numel:
            for k in range(self.num_pieces):
                self.encode_stage(xp, scales, k, go=call.go)
        call.phase = "sent"

    def relay(self) -> None:
        """Phase 3 (this rank as a server): decode each piece of its chunk as it arrives, re-encode
        the mean, and put the gather of the server rows on the wire."""
        call = self._in_phase("relay", "sent")
        remote = self.world_size > 1
        if self.numel:
            a2a, call.works = call.works, []
            for k in range(self.num_pieces):
                if remote:
                    a2a[k].wait()
                self.server_receive(self._recv[k] if remote else self._send[k], k, go=call.go)
            for k in range(self.num_pieces):
                srv = self.server_send(k)
                if remote:
                    call.works.append(all_gather_rows(self._gathered[k], srv, group=self.group, async_op=True,
                                                      fanout=self.fanout, send=self._fan[k], twin=self._twin))
        call.phase = "relayed"

    def complete(self, out: torch.Tensor | None = None, *, defer: bool = False) -> torch.Tensor | None:
        """The rest of a call (:meth:`relay`, if not done yet, then stage 4: decode the gathered pieces as
        they arrive); see :meth:`__call__` for ``out`` and ``defer``."""
        if self._inflight is not None and self._inflight.phase == "sent":
            self.relay()
        call = self._in_phase("complete", "relayed")
        self._inflight = None
        x = call.x
        if self.numel == 0:
            return x.detach().clone() if out is None else out
        remote = self.world_size > 1
        dst = self.result_buffer(out, x.dtype)
        gathered = self._gathered if remote else self._srv
        defer = defer and not self.any_flag and self.mode != "markov"
        if call.go is not None and not defer:
            raise RuntimeError(f"{type(self).__name__}: a call decided on the device needs defer=True (its "
                               "decode and the update after it are predicated on its flag)")
        for k in range(self.num_pieces):
            if remote:
                call.works[k].wait()
            if k == 0:
                srv_ok = self.check_gathered(gathered[0], on_device=call.go is not None)
            if not defer:
                self.finish_piece(gathered[k], dst, k)
        self.account()
        if defer:
            go = None
            if call.go is not None:  # the decode needs this call's server scales finite too
                key = (srv_ok.data_ptr(), self._flag_row.data_ptr())
                if self._decode_flags is None or self._decode_flags[0] != key:
                    flags = self._flag_row[:2]  # beside the input's flag (two_stage's bind)
                    decay = torch.ones(1, dtype=torch.float32, device=call.go.device)
                    self._decode_flags = (key, flags, flags[1:], srv_ok.view(1), decay, decay.view(()), flags[:1])
                _, flags, prev, srv1, decay, decay0, took = self._decode_flags
                go = Predicate(call.go, srv1, flags, decay, decay0, took)
                # the decode writes [go and srv_ok, srv_ok or not go]: the second for the next call, since a
                # skipped call's server read the worker's new scales beside its old codes and says nothing
                self._gathered_ok = prev
            self._keep_pending(gathered, dst, out, x.dtype, go=go)
            return None
        return self.finish(dst, out, x.dtype)

    def abandon(self) -> None:
        """Give up a call in flight (another call failed): wait for what it put on the wire, so that no
        transfer still reads or writes the buffers when the next call reuses them. Its state writes
        stand; the result is never produced. Every rank must abandon the same calls."""
        call, self._inflight = self._inflight, None
        if call is None:
            return
        pending = [] if call.agreement is None or call.agreement.work is None else [call.agreement.work]
        for work in pending + call.works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the group failed already; the caller raises that failure
                pass

    @property
    def in_flight(self) -> Call | None:
        """The call between :meth:`begin` and :meth:`complete`, if any (see :func:`.inflight.check_together`)."""
        return self._inflight

    def _in_phase(self, phase: str, after: str) -> Call:
        call = self._inflight
        if call is None or call.phase != after:
            raise RuntimeError(f"{type(self).__name__}.{phase}: needs a call {after}, "
                               f"{'none is in flight' if call is None else 'this one is ' + call.phase}")
        return call

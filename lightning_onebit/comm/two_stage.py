"""The two-stage compressed allreduce as arithmetic: one rank's local stages, no communication.

World size n; rank r is the "server" for chunk r of the (padded) flat input:

1. worker: encode the input chunk-wise (one row per destination rank), optionally with
   error feedback (``error_feedback``) or against a Markov estimate (``markov``);
2. exchange: row j goes to rank j, so rank r receives every worker's chunk r;
3. server r: average the n decoded rows (+ server error feedback), re-encode one row
   (``markov``: fold the workers' deltas into the server's running mean, then encode
   its difference to the shared estimate g_tilde);
4. exchange: every rank receives every server row and decodes the same bytes, so replicas
   stay bit-identical (:mod:`.stage4`: the decode, at once or deferred).

:class:`TwoStageRank` is one rank's part of this: the geometry (padding, chunks, scale blocks,
pipeline pieces), the error / Markov state, the packed message buffers, and the local work of
stages 1, 3 and 4. It moves no bytes and needs no process group. Two drivers run the same
methods in the same order, hence give the same bits:
:class:`~lightning_onebit.comm.CompressedAllreduce` does the exchanges with
``all_to_all_single`` and ``all_gather_into_tensor`` over a process group;
:class:`~lightning_onebit.comm.SimulatedCluster` copies the rows between n objects in one process.

Scales follow tensor boundaries: ``groups`` (the offsets of the parameter tensors in a flat
bucket) start a new scale block, so every row (rank r's chunk) carries one scale per piece of a
tensor inside it in both stages (``block_size`` cuts each piece further), and a tensor with
small gradients never shares a scale with a large one. DeepSpeed's 1-bit Adam scales each
tensor on its own too (one worker scale per tensor, a server scale per chunk of it). Every row
carries the same number of scales (the most any chunk needs; the others pad with empty
blocks), so rows keep one size on the wire. The padding (zeros up to n equal chunks of a multiple
of 8) does not count in a scale, decodes to 0 and keeps a zero state (the layout knows where it
starts).

Codes and scales travel in one packed uint8 row (``Codec.empty(..., packed=...)``), so each
exchange moves one buffer. The stages do not wait for the device: :meth:`TwoStageRank.prepare`
returns the input's finiteness as a device tensor, and the server's re-encoded rows are not
checked where they are made. They are finite unless a server's mean (+ error) overflows fp32,
which takes inputs near its limit (~3e38; Adam's second moment overflows at gradients of ~2e19,
long before); :meth:`TwoStageRank.gathered_finite` tells it from the gathered server scales, the
same bytes on every rank, and the driver decides when to read it and how to raise.

Pipelining: a row is cut into column pieces (``pieces``; automatic: one per ``MIN_PIECE``
elements of a row, at most ``MAX_PIECES``; one piece on CUDA, since every piece costs n encode
and n decode launches, each with Python dispatch, and the kernels share torch's one stream, and
one piece at world size 1 and in a simulation, which have no network to overlap).
Every stage works piece by piece, so a driver can put piece k on the wire while piece k+1 is
encoded, let the server decode each piece as it arrives, and encode and exchange the server row
piece by piece while earlier pieces are decoded (``CompressedAllreduce`` does). Only the scale
reductions need a whole row (the workers' before any piece, the server's after the last
piece arrived); everything that is split is elementwise, so the result is bit-identical for
every piece count, backend included. Piece 0 carries the row's scales; the other pieces are
bare codes, so the bytes on the wire do not change.

Bytes per rank and call: 2 (n-1) * row_bytes, with row_bytes ~ d / (8 n) + 4 * (scales per row)
for 1-bit codes: ~ 2 (n-1)/n * d/8, against 2 (n-1)/n * 4d for an fp32 ring allreduce (32x).

Trade-offs worth knowing: inputs are padded to n * seg elements (seg a multiple of 8) and
copied once unless the caller hands in a tensor of ``padded_numel`` elements; state is
fp32 whatever the input dtype; with n = 1 both stages still run (no communication), so
the compression error of the algorithm exists in one process exactly as in many.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compress import Codec, Encoded, flat_buffer
from ..compress.kernels.layout import Layout, is_sign, scale_shape
from ..compress.source import Source
from .accounting import ByteCounter
from .messages import MessageViews
from .pipeline import MAX_PIECES, MIN_PIECE, Piece, plan_pieces
from .rank_state import RankState
from .stage4 import Stage4

__all__ = ["MAX_PIECES", "MIN_PIECE", "MODES", "TwoStageRank"]

MODES = ("plain", "error_feedback", "markov")


class TwoStageRank(Stage4, RankState):
    """Rank ``rank`` of ``world_size`` in the two-stage compressed mean of a 1-D tensor, without
    the exchanges (see the module docstring).

    Args:
        codec: the codec of both stages (``SignCodec`` for 1-bit, ``MinMaxUInt8Codec`` for 8-bit).
        mode: ``"plain"`` (no feedback), ``"error_feedback"`` (worker + server error, 1-bit Adam)
            or ``"markov"`` (EF21 / CD-Adam Markov sequences both ways; returns g_tilde).
        rank, world_size: this rank and the number of ranks.
        counter: a :class:`ByteCounter` to report bytes to (e.g. shared by all buckets).
        pieces: column pieces per row for the pipeline (``None``: automatic, see the module
            docstring; codecs that are not elementwise, e.g. top-k, always use one).
        groups: offsets where the tensors of a flat multi-tensor input start (e.g. a bucket's
            parameters): no scale spans two of them. ``None``: one tensor.

    One object serves one tensor (one size): it owns that tensor's error / Markov state.
    A driver runs one call as follows (``recv_k``: row i from rank i's ``send_k``; ``gathered_k``:
    row i is rank i's ``srv_k``)::

        xp, scales, ok = prepare(x)               # nothing written yet; ok: x is finite
        send_k = encode_stage(xp, scales, k)      # for every piece k; row j goes to rank j
        server_receive(recv_k, k)                 # for every piece k
        srv_k = server_send(k)                    # for every piece k; goes to every rank
        dst = result_buffer(out, dtype)
        gathered_finite(gathered_0)               # the server scales (piece 0), before decoding
        finish_piece(gathered_k, dst, k)          # for every piece k
        result = finish(dst, out, dtype); account()
    """

    def __init__(self, codec: Codec, mode: str, rank: int, world_size: int, counter: ByteCounter | None = None,
                 pieces: int | None = None, groups: Sequence[int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a lightning_onebit.compress.Codec, got {type(codec).__name__}")
        if pieces is not None and (not isinstance(pieces, int) or pieces < 1):
            raise ValueError(f"pieces must be a positive int or None, got {pieces!r}")
        self.codec = codec
        self.pieces = pieces
        self.groups = tuple(sorted({int(g) for g in groups})) if groups is not None else ()
        self.mode = mode
        self.counter = counter if counter is not None else ByteCounter()
        self.rank, self.world_size = rank, world_size
        self.numel: int | None = None
        self.worker_device: torch.device | None = None  # where the state lives, set when a size is bound
        self.worker: torch.Tensor | None = None  # worker error, or worker Markov estimate g_hat_i
        self.server: torch.Tensor | None = None  # server error, or server running mean g_hat
        self.tilde: torch.Tensor | None = None  # markov: the shared estimate g_tilde
        self.plan: list[Piece] = []  # pipeline pieces of a row, set when a size is bound
        self.layout: Layout | None = None  # rows (chunks) and scale blocks of the padded input
        self.bytes_sent = 0
        self.calls = 0
        self._pending: tuple | None = None  # a deferred stage 4 (see decode_pending)

    # -- geometry ------------------------------------------------------------------------
    def padded_numel(self, numel: int) -> int:
        """Elements after padding: world_size equal chunks, each a multiple of 8."""
        n = self.world_size
        seg = -(-numel // n)
        seg = -(-seg // 8) * 8
        return seg * n

    @property
    def seg_len(self) -> int:
        return self.padded_numel(self.numel) // self.world_size

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes(self.layout)

    def make_layout(self, numel: int) -> Layout:
        """Chunks of the padded input, cut at the groups; the padding does not count in scales."""
        if self.groups and (self.groups[0] < 0 or self.groups[-1] > numel):
            raise ValueError(f"groups must lie in [0, {numel}] for a tensor of {numel} elements, "
                             f"got {self.groups[0]}..{self.groups[-1]}")
        return self.codec.layout(self.padded_numel(numel), self.world_size, (0, *self.groups), valid=numel)

    def _plan(self, seg: int) -> list[Piece]:
        """Cut a row of ``seg`` elements into pipeline pieces (see the module docstring)."""
        one = self.pieces is None and (self.worker_device.type == "cuda" or self.world_size == 1)
        return plan_pieces(self.codec, self.layout, seg, 1 if one else self.pieces)

    @property
    def num_pieces(self) -> int:
        """Pipeline pieces per call (0 until the first call binds a tensor size)."""
        return len(self.plan)

    def _row_scales(self, piece0: torch.Tensor) -> torch.Tensor:
        """The scales of every row of a pieced buffer: they travel in piece 0, after its codes."""
        b = piece0[:, self.plan[0].cb4 :].view(torch.float32)
        return b.view(b.shape[0], -1) if is_sign(self.codec.kind) else b.view(b.shape[0], -1, 2)

    def _piece(self, buf: torch.Tensor, k: int, rows: slice, row_scales: torch.Tensor, layout: Layout) -> Encoded:
        """Piece ``k`` of ``rows`` of a piece buffer as an Encoded: its codes, the rows' whole-row
        scales, and ``layout``: those rows' blocks clipped to the piece."""
        return Encoded(buf[rows, : self.plan[k].cb], row_scales[rows], layout, self.codec.kind)

    def bytes_per_call(self, numel: int) -> int:
        """Bytes this rank sends per call for a tensor of ``numel`` elements."""
        return 2 * (self.world_size - 1) * self.codec.row_bytes(self.make_layout(numel))

    # -- state ---------------------------------------------------------------------------
    def bind(self, numel: int, device: torch.device | str) -> None:
        """Allocate the state and buffers for tensors of ``numel`` elements on ``device`` (the
        first call does this too); binding again to another size or device raises."""
        device = torch.device(device)
        if self.numel is not None:
            if numel != self.numel:
                raise ValueError(
                    f"this {type(self).__name__} reduces tensors of {self.numel} elements (its error "
                    f"state is sized for them); got {numel}. Use one object per tensor."
                )
            if device != self.worker_device:
                raise ValueError(f"state lives on {self.worker_device}, input is on {device}")
            return
        self.layout = self.make_layout(numel)
        self.numel = numel
        self.worker_device = device
        D, seg, dev = self.padded_numel(self.numel), self.seg_len, device
        if self.mode != "plain":
            self.worker = flat_buffer(D, device=dev)
            self.server = flat_buffer(seg, device=dev)
        if self.mode == "markov":
            self.tilde = flat_buffer(D, device=dev)
        n, r = self.world_size, self.rank
        self.plan = self._plan(seg)
        # the layouts of the three messages: the chunks (sent, and gathered back), every worker's
        # chunk r (received by server r), server r's own row; and each clipped to each piece
        self._srv_layout = self.layout.row(r)
        self._recv_layout = self.layout.repeat_row(r, n)
        self._win_rows = [[self.layout.row(q).window(p.lo, p.hi) for q in range(n)] for p in self.plan]
        self._win_recv = [self._recv_layout.window(p.lo, p.hi) for p in self.plan]
        # the packed rows that stages 1 and 3 write: every chunk (to every rank), the server row
        self._send = [flat_buffer((n, p.rb), torch.uint8, dev) for p in self.plan]
        self._srv = [flat_buffer((1, p.rb), torch.uint8, dev) for p in self.plan]
        self._xpad = flat_buffer(D, device=dev) if D != self.numel else None
        # the server's mean of the workers' chunk (1/n of the tensor), reused every call:
        # a fresh buffer per call pays first-touch page faults (see Codec.server_step)
        self._mean = flat_buffer(seg, device=dev, zero=False) if self.mode != "markov" else None
        self._outpad = flat_buffer(D, device=dev, zero=False) if D != self.numel else None
        self._messages = MessageViews(self.codec)  # the packed buffers as messages, views made once
        self._messages.keep([*self._send, *self._srv])
        # the worker scales and the input's finiteness flag of a call, written in place every call: with
        # one piece where stage 1 sends them (its packed row); None for a codec whose messages carry
        # other values than block scales (top-k), which computes its own
        lay = self.layout
        shape = scale_shape(self.codec.kind, lay.nseg, lay.blocks_per_seg)
        sent = self._messages(lay, self._send[0]).scales if len(self.plan) == 1 else None
        if sent is not None:
            self._worker_scales = sent if tuple(sent.shape) == shape else None
        else:  # pieces: only block-scale codecs are cut into them
            self._worker_scales = torch.empty(shape, dtype=torch.float32, device=dev)
        # [a decode's two flags (see complete), this call's input finite]: the last call's server flag and this
        # call's input flag side by side, so the agreement copies both into its signature in one op
        self._flag_row = torch.ones(3, dtype=torch.bool, device=dev)
        self._ok, self._flag_pair = self._flag_row[2:], self._flag_row[1:]
        # one piece: the server row's scales are finite, written by the server encode's own reduction
        self._srv_ok = torch.ones(1, dtype=torch.bool, device=dev) if len(self.plan) == 1 else None
        self._srv_ok0 = None if self._srv_ok is None else self._srv_ok.view(())
        self._gathered_check: tuple | None = None  # gathered_finite's buffers, made at its first call

    # -- stage 1 (worker) ----------------------------------------------------------------
    def _padded_input(self, x: torch.Tensor | Source) -> torch.Tensor | Source:
        x = x.reshape(-1)
        if self._xpad is None:
            return x
        if isinstance(x, Source):
            return x.padded(self._xpad.numel())  # evaluated as zeros past its data: nothing copied
        self._xpad[: self.numel].copy_(x)
        return self._xpad

    def prepare(self, x: torch.Tensor | Source) -> tuple[torch.Tensor | Source, torch.Tensor, torch.Tensor]:
        """Bind to ``x``'s size and compute the worker scales; no state is written yet.

        Returns (padded input, worker scales, ok): ``ok`` a 0-d bool tensor on ``x``'s device,
        whether ``x`` is finite (no host sync; the scales of a non-finite input are meaningless).
        ``x`` may be a payload :class:`~lightning_onebit.compress.source.Source`, which the codec's
        kernels evaluate where they read it.
        """
        if not isinstance(x, torch.Tensor | Source) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point tensor")
        self.bind(x.numel(), x.device)
        xp = self._padded_input(x)
        out = self._worker_scales
        return (xp, *self.codec.compute_scales_unchecked(xp, self.worker, self.mode, layout=self.layout,
                                                         out=out, ok=None if out is None else self._ok))

    def encode_stage(self, xp: torch.Tensor, scales: torch.Tensor, k: int = 0, *,
                     go: torch.Tensor | None = None) -> torch.Tensor:
        """Stage 1 (worker): encode piece ``k`` of every chunk into its send buffer ``[n, rb_k]``; ``go``: a
        device flag the encode is predicated on (:meth:`~lightning_onebit.compress.Codec.encode`)."""
        n, seg, send = self.world_size, self.seg_len, self._send
        if self.num_pieces == 1:
            outs = [(xp, self.worker, self._messages(self.layout, send[0]), scales)]
        else:
            if k == 0:  # piece 0 may go on the wire before the others are encoded: all scales now
                self._row_scales(send[0]).copy_(scales)
            p = self.plan[k]
            outs = []
            for r in range(n):
                cols = slice(r * seg + p.lo, r * seg + p.hi)
                # out.scales views `scales` itself, not piece 0 (maybe in flight): the encode ops'
                # copy of their scales into out.scales is then a no-op
                enc = self._piece(send[k], k, slice(r, r + 1), scales, self._win_rows[k][r])
                outs.append((xp[cols], None if self.worker is None else self.worker[cols], enc, enc.scales))
        for x, state, enc, sc in outs:
            if self.mode == "error_feedback":
                self.codec.encode_error_feedback(x, state, out=enc, scales=sc, layout=enc.layout, go=go)
            elif self.mode == "markov":
                self.codec.encode_markov(x, state, out=enc, scales=sc, layout=enc.layout, go=go)
            else:
                self.codec.encode(x, out=enc, scales=sc, layout=enc.layout, go=go)
        return send[k]

    # -- stage 3 (server) ----------------------------------------------------------------
    def server_receive(self, recv: torch.Tensor, k: int = 0, *, go: torch.Tensor | None = None) -> None:
        """Stage 3a (server r): take in piece ``k`` of the n workers' chunk r.

        With one piece this is the whole server step; otherwise piece k of the workers'
        mean (``markov``: of the server's running mean) is decoded now, and the encode waits
        for the last piece, because the server scales need the whole chunk."""
        if go is not None and self.num_pieces != 1:
            raise ValueError(f"{type(self).__name__}: go= needs a call of one piece")
        if self.num_pieces == 1:
            msgs = self._messages(self._recv_layout, recv)
            out = self._messages(self._srv_layout, self._srv[0])
            if self.mode in ("error_feedback", "plain"):
                self.codec.server_step(msgs, self.server if self.mode == "error_feedback" else None,
                                       out=out, mean=self._mean, check_finite=False, ok=self._srv_ok, go=go)
            elif go is not None:
                raise ValueError(f"{type(self).__name__}: a server step predicated on go= needs error_feedback "
                                 "or plain mode")
            else:
                self.codec.decode_mean(msgs, out=self.server, accumulate=True)
                self.codec.encode_diff(self.server, self._my_tilde(), out=out, layout=self._srv_layout,
                                       check_finite=False, ok=self._srv_ok)
            return
        p = self.plan[k]
        if k == 0:  # the workers' scales travel in piece 0
            self._recv_scales = self._row_scales(recv).clone()
        msgs = self._piece(recv, k, slice(None), self._recv_scales, self._win_recv[k])
        if self.mode == "markov":
            self.codec.decode_mean(msgs, out=self.server[p.lo : p.hi], accumulate=True)
        else:
            self.codec.decode_mean(msgs, out=self._mean[p.lo : p.hi])

    def _my_tilde(self) -> torch.Tensor:
        seg = self.seg_len
        return self.tilde[self.rank * seg : (self.rank + 1) * seg]

    def server_send(self, k: int = 0) -> torch.Tensor:
        """Stage 3b (server r): piece ``k`` of the re-encoded server row ``[1, rb_k]``."""
        if self.num_pieces == 1:
            return self._srv[0]
        if k == 0:  # every piece has arrived: the server scales need the whole row
            lay, scales = self._srv_layout, self.codec.compute_scales_unchecked  # checked in stage 4
            if self.mode == "markov":
                self._srv_scales = scales(self.server, self._my_tilde(), "diff", layout=lay)[0]
            elif self.mode == "error_feedback":
                self._srv_scales = scales(self._mean, self.server, "error_feedback", layout=lay)[0]
            else:
                self._srv_scales = scales(self._mean, layout=lay)[0]
            self._row_scales(self._srv[0]).copy_(self._srv_scales)
        p = self.plan[k]
        cols = slice(p.lo, p.hi)
        # as in encode_stage
        enc = self._piece(self._srv[k], k, slice(0, 1), self._srv_scales, self._win_rows[k][self.rank])
        sc, lay = enc.scales, enc.layout
        if self.mode == "markov":
            self.codec.encode_diff(self.server[cols], self._my_tilde()[cols], out=enc, scales=sc, layout=lay)
        elif self.mode == "error_feedback":
            self.codec.encode_error_feedback(self._mean[cols], self.server[cols], out=enc, scales=sc, layout=lay)
        else:
            self.codec.encode(self._mean[cols], out=enc, scales=sc, layout=lay)
        return self._srv[k]

    def account(self) -> None:
        """Count one call's bytes (what this rank sent in both exchanges) here and in ``counter``."""
        nbytes = 2 * (self.world_size - 1) * self.row_bytes
        self.bytes_sent += nbytes
        self.calls += 1
        self.counter.add(nbytes, self.numel, self.world_size)

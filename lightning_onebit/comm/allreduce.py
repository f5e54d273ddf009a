"""Two-stage compressed allreduce over a torch.distributed process group.

World size n; rank r is the "server" for chunk r of the (padded) flat input:

1. worker: encode the input chunk-wise (one row per destination rank), optionally with
   error feedback (``error_feedback``) or against a Markov estimate (``markov``);
2. ``all_to_all_single``: row j goes to rank j, so rank r receives every worker's chunk r;
3. server r: average the n decoded rows (+ server error feedback), re-encode one row
   (``markov``: fold the workers' deltas into the server's running mean, then encode
   its difference to the shared estimate g_tilde);
4. ``all_gather_into_tensor`` of the server rows; every rank decodes the same bytes, so
   replicas stay bit-identical.

Codes and scales travel in one packed uint8 row (``Codec.empty(..., packed=...)``), so a
call is exactly two data collectives, plus one tiny ``all_gather`` that checks that the
ranks agree on the tensor size, codec and mode and that every rank's input is finite,
before any state is written. A mismatch or a NaN on any rank raises ``ValueError`` on
*every* rank instead of a hang or garbage. That check costs one small-message latency
per call; pass ``verify="first"`` where the caller guarantees agreement (DDP buckets are
verified by DDP itself), trading it for a process-group timeout if a rank goes astray.

Bytes per rank and call: 2 (n-1) * row_bytes, with row_bytes ~ d / (8 n) for 1-bit codes:
~ 2 (n-1)/n * d/8, against 2 (n-1)/n * 4d for an fp32 ring allreduce (32x).

Trade-offs worth knowing: inputs are padded to n * seg elements (seg a multiple of 8) and
copied once unless the caller hands in a tensor of ``padded_numel`` elements; state is
fp32 whatever the input dtype; with n = 1 both stages still run (no communication), so
the compression error of the algorithm exists in one process exactly as in many.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compress import Codec, Encoded
from .accounting import ByteCounter

__all__ = ["CompressedAllreduce", "MODES"]

MODES = ("plain", "error_feedback", "markov")
_MODE_ID = {m: i for i, m in enumerate(MODES)}
_DTYPE_ID = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_rows(out: torch.Tensor, row: torch.Tensor, group=None, async_op: bool = False):
    """Gather one 1-D ``row`` per rank into the rows of ``out`` ``[n, len]`` (rank order)."""
    return _all_gather_single(out.view(-1), row.reshape(-1), group=group, async_op=async_op)


def _group_rank_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class CompressedAllreduce:
    """Compressed estimate of the mean of a 1-D tensor over a process group.

    Args:
        codec: the codec of both stages (``SignCodec`` for 1-bit, ``MinMaxUInt8Codec`` for 8-bit).
        mode: ``"plain"`` (no feedback), ``"error_feedback"`` (worker + server error, 1-bit Adam)
            or ``"markov"`` (EF21 / CD-Adam Markov sequences both ways; returns g_tilde).
        group: process group (``None``: the default group, or a single process if
            torch.distributed is not initialized).
        counter: a :class:`ByteCounter` to report bytes to (e.g. shared by all buckets).
        verify: ``"always"`` (default) or ``"first"``: see the module docstring.

    One object serves one tensor (one size): it owns that tensor's error / Markov state.
    """

    def __init__(self, codec: Codec, mode: str = "error_feedback", group=None,
                 counter: ByteCounter | None = None, verify: str = "always",
                 _virtual: tuple[int, int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if verify not in ("always", "first"):
            raise ValueError(f"verify must be 'always' or 'first', got {verify!r}")
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a lightning_onebit.compress.Codec, got {type(codec).__name__}")
        self.codec = codec
        self.mode = mode
        self.group = group
        self.verify = verify
        self.counter = counter if counter is not None else ByteCounter()
        # _virtual = (rank, world_size): a worker of SimulatedCluster, which moves the rows itself
        self._virtual = _virtual
        self.rank, self.world_size = _virtual if _virtual is not None else _group_rank_size(group)
        self.numel: int | None = None
        self.worker: torch.Tensor | None = None  # worker error, or worker Markov estimate g_hat_i
        self.server: torch.Tensor | None = None  # server error, or server running mean g_hat
        self.tilde: torch.Tensor | None = None  # markov: the shared estimate g_tilde
        self._verified = False
        self.bytes_sent = 0
        self.calls = 0

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
        return self.codec.row_bytes(self.seg_len)

    def bytes_per_call(self, numel: int) -> int:
        """Bytes this rank sends per call for a tensor of ``numel`` elements."""
        seg = self.padded_numel(numel) // self.world_size
        return 2 * (self.world_size - 1) * self.codec.row_bytes(seg)

    # -- state ---------------------------------------------------------------------------
    def _bind(self, x: torch.Tensor) -> None:
        if self.numel is not None:
            if x.numel() != self.numel:
                raise ValueError(
                    f"this CompressedAllreduce reduces tensors of {self.numel} elements (its error "
                    f"state is sized for them); got {x.numel()}. Use one object per tensor."
                )
            if x.device != self.worker_device:
                raise ValueError(f"state lives on {self.worker_device}, input is on {x.device}")
            return
        self.numel = x.numel()
        self.worker_device = x.device
        D, seg, dev = self.padded_numel(self.numel), self.seg_len, x.device
        f32 = dict(dtype=torch.float32, device=dev)
        if self.mode != "plain":
            self.worker = torch.zeros(D, **f32)
            self.server = torch.zeros(seg, **f32)
        if self.mode == "markov":
            self.tilde = torch.zeros(D, **f32)
        n, rb = self.world_size, self.row_bytes
        u8 = dict(dtype=torch.uint8, device=dev)
        self._send = torch.zeros(n, rb, **u8)
        self._recv = torch.zeros(n, rb, **u8)
        self._srv = torch.zeros(1, rb, **u8)
        self._gathered = torch.zeros(n, rb, **u8)
        self._xpad = torch.zeros(D, **f32) if D != self.numel else None
        # the server's mean of the workers' chunk (1/n of the tensor), reused every call:
        # a fresh buffer per call pays first-touch page faults (see Codec.server_step)
        self._mean = torch.empty(seg, **f32) if self.mode != "markov" else None
        self._outpad = torch.empty(D, **f32) if D != self.numel else None

    def reset_state(self) -> None:
        """Zero the error / Markov state (e.g. at a phase switch)."""
        for t in (self.worker, self.server, self.tilde):
            if t is not None:
                t.zero_()

    def _zero_padding(self) -> None:
        # Padding elements are zeros of the input; keep their state at zero so they never
        # feed back into a chunk's scale.
        d, D, seg, r = self.numel, self.padded_numel(self.numel), self.seg_len, self.rank
        if d == D:
            return
        for t in (self.worker, self.tilde):
            if t is not None:
                t[d:].zero_()
        if self.server is not None and (r + 1) * seg > d:
            self.server[max(d - r * seg, 0):].zero_()

    def state_dict(self) -> dict:
        return {
            "mode": self.mode, "codec": repr(self.codec), "numel": self.numel,
            "world_size": self.world_size, "rank": self.rank,
            "worker": None if self.worker is None else self.worker.clone(),
            "server": None if self.server is None else self.server.clone(),
            "tilde": None if self.tilde is None else self.tilde.clone(),
            "bytes_sent": self.bytes_sent, "calls": self.calls,
        }

    def load_state_dict(self, sd: dict) -> None:
        for key, mine in (("mode", self.mode), ("codec", repr(self.codec)), ("world_size", self.world_size)):
            if sd[key] != mine:
                raise ValueError(f"state was saved with {key}={sd[key]!r}, this object has {key}={mine!r}")
        if sd["numel"] is not None:
            self._bind(torch.empty(sd["numel"], device=self.worker_device if self.numel else "cpu"))
            for name in ("worker", "server", "tilde"):
                if getattr(self, name) is not None:
                    getattr(self, name).copy_(sd[name])
        self.bytes_sent, self.calls = sd["bytes_sent"], sd["calls"]

    # -- the three local stages ----------------------------------------------------------
    def _padded_input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1)
        if self._xpad is None:
            return x
        self._xpad[: self.numel].copy_(x)
        return self._xpad

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Check ``x`` and compute the worker scales; nothing is written yet.

        Returns (padded input, scales) - scales is ``None`` if the input is not finite.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError("CompressedAllreduce expects a floating-point tensor")
        self._bind(x)
        xp = self._padded_input(x)
        mode = {"plain": "plain", "error_feedback": "error_feedback", "markov": "markov"}[self.mode]
        try:
            scales = self.codec.compute_scales(xp, self.worker, mode, nseg=self.world_size)
        except ValueError:
            scales = None
        return xp, scales

    def encode_stage(self, xp: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Stage 1 (worker): encode the chunks into the packed send buffer ``[n, row_bytes]``."""
        n, seg = self.world_size, self.seg_len
        enc = self.codec.empty(n, seg, xp.device, packed=self._send)
        if self.mode == "error_feedback":
            self.codec.encode_error_feedback(xp, self.worker, nseg=n, out=enc, scales=scales)
        elif self.mode == "markov":
            self.codec.encode_markov(xp, self.worker, nseg=n, out=enc, scales=scales)
        else:
            self.codec.encode(xp, nseg=n, out=enc, scales=scales)
        return self._send

    def server_stage(self, recv: torch.Tensor) -> torch.Tensor:
        """Stage 3 (server r): reduce the n workers' chunk r into one packed row ``[1, row_bytes]``."""
        seg, n = self.seg_len, self.world_size
        msgs = self.codec.empty(n, seg, recv.device, packed=recv)
        out = self.codec.empty(1, seg, recv.device, packed=self._srv)
        if self.mode in ("error_feedback", "plain"):
            self.codec.server_step(msgs, self.server if self.mode == "error_feedback" else None, out=out,
                                   mean=self._mean)
        else:
            self.codec.decode_mean(msgs, out=self.server, accumulate=True)
            mine = self.tilde[self.rank * seg : (self.rank + 1) * seg]
            self.codec.encode_diff(self.server, mine, out=out)
        return self._srv

    def finish_stage(self, gathered: torch.Tensor, out: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
        """Stage 4 (every rank): decode the gathered server rows into the result.

        ``out`` may have ``numel`` elements or, to skip a copy, ``padded_numel(numel)``.
        Without ``out`` a new tensor is returned (a fresh allocation costs page faults on
        first touch: pass ``out`` on hot paths)."""
        d, D, n, seg = self.numel, self.padded_numel(self.numel), self.world_size, self.seg_len
        msgs: Encoded = self.codec.empty(n, seg, gathered.device, packed=gathered)
        if self.mode == "markov":
            self.codec.decode(msgs, out=self.tilde, accumulate=True)
            self._zero_padding()
            result = self.tilde[:d]
            if out is None:
                return result.to(dtype=dtype, copy=True)
            out.view(-1)[:d].copy_(result)
            return out
        fp32_out = out is not None and out.dtype == torch.float32 and out.is_contiguous()
        if fp32_out and out.numel() == D:
            self.codec.decode(msgs, out=out.view(-1))
            self._zero_padding()
            return out
        if out is None and D == d and dtype == torch.float32:
            buf = torch.empty(d, dtype=torch.float32, device=gathered.device)
            self.codec.decode(msgs, out=buf)
            self._zero_padding()
            return buf
        buf = self._outpad if self._outpad is not None else torch.empty(D, dtype=torch.float32,
                                                                          device=gathered.device)
        self.codec.decode(msgs, out=buf)
        self._zero_padding()
        if out is None:
            return buf[:d].to(dtype=dtype, copy=True)
        out.view(-1)[:d].copy_(buf[:d])
        return out

    def _account(self) -> None:
        nbytes = 2 * (self.world_size - 1) * self.row_bytes
        self.bytes_sent += nbytes
        self.calls += 1
        self.counter.add(nbytes, self.numel, self.world_size)

    # -- the collective ------------------------------------------------------------------
    def _signature(self, x: torch.Tensor, ok: bool) -> torch.Tensor:
        bs = self.codec.block_size or 0
        return torch.tensor([x.numel(), _DTYPE_ID.get(x.dtype, 9), self.codec.kind, bs,
                             _MODE_ID[self.mode], int(getattr(self.codec, "scale", "l2") == "l1"), int(ok)],
                            dtype=torch.int64)

    def _agree(self, x: torch.Tensor, ok: bool) -> None:
        """All ranks exchange (size, dtype, codec, mode, finite) and raise together on disagreement."""
        if self.world_size == 1 or (self.verify == "first" and self._verified and ok):
            if not ok:
                raise ValueError("CompressedAllreduce: the input is not finite (NaN or inf); "
                                 "no state was changed")
            return
        sig = self._signature(x, ok)
        backend = dist.get_backend(self.group)
        dev = x.device if backend == "nccl" else torch.device("cpu")
        mine = sig.to(dev)
        allsig = torch.empty(self.world_size, sig.numel(), dtype=torch.int64, device=dev)
        all_gather_rows(allsig, mine, group=self.group)
        allsig = allsig.cpu()
        fields = ["numel", "dtype", "codec kind", "block_size", "mode", "l1 scale"]
        bad = [f for i, f in enumerate(fields) if not bool((allsig[:, i] == allsig[0, i]).all())]
        if bad:
            rows = "; ".join(
                f"rank {r}: " + ", ".join(f"{f}={int(allsig[r, i])}" for i, f in enumerate(fields))
                for r in range(self.world_size))
            raise ValueError(f"CompressedAllreduce: ranks disagree on {', '.join(bad)} ({rows})")
        nonfinite = [r for r in range(self.world_size) if not int(allsig[r, -1])]
        if nonfinite:
            raise ValueError(f"CompressedAllreduce: the input on rank(s) {nonfinite} is not finite "
                             "(NaN or inf); every rank skipped this call and no state was changed")
        self._verified = True

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Return the compressed mean of ``x`` over the group (bit-identical on all ranks)."""
        if self._virtual is not None:
            raise RuntimeError("a simulated worker is driven by SimulatedCluster, not called directly")
        if self.numel is not None and x.numel() != self.numel:
            if self.world_size > 1:
                self._agree(x, True)  # ranks that disagree all raise here instead of hanging
            self._bind(x)  # every rank made the same mistake: raise the local explanation
        xp, scales = self.prepare(x)
        self._agree(x, scales is not None)
        if self.numel == 0:
            return x.detach().clone() if out is None else out
        send = self.encode_stage(xp, scales)
        if self.world_size > 1:
            dist.all_to_all_single(self._recv, send, group=self.group)
            recv = self._recv
        else:
            recv = send
        srv = self.server_stage(recv)
        if self.world_size > 1:
            all_gather_rows(self._gathered, srv, group=self.group)
            gathered = self._gathered
        else:
            gathered = srv
        result = self.finish_stage(gathered, out, x.dtype)
        self._account()
        return result

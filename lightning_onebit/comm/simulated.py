"""An in-process n-worker cluster with exactly the arithmetic of the distributed path.

Each simulated worker is a :class:`~lightning_onebit.comm.two_stage.TwoStageRank` driven stage
by stage (piece by piece, like the pipelined distributed call); this module only moves the packed
rows between them the way ``all_to_all_single`` and ``all_gather_into_tensor`` would. No process
group is involved. Same kernels, same
chunking, same packed bytes, same order of summation: the result for n simulated workers is
bit-identical to a real n-process run on the same inputs, so algorithms can be studied with
20 workers on a laptop and tests can compare one process against many.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..compress import Codec
from .accounting import ByteCounter
from .stage4 import Predicate
from .two_stage import TwoStageRank

__all__ = ["SimulatedCluster", "record_flags"]


def record_flags(cluster, xs: Sequence[torch.Tensor], flags: Sequence[bool] | None, who: str) -> None:
    """A simulated call's inputs checked (one per ``who``, all of one size) after its flags are recorded as the
    distributed call records them (``flag_values`` in rank order, ``any_flag``)."""
    cluster.flag_values = [int(f or 0) for f in flags] if flags is not None else [0] * len(xs)
    cluster.any_flag = any(cluster.flag_values)
    if len(xs) != cluster.world_size:
        raise ValueError(f"expected {cluster.world_size} tensors (one per {who}), got {len(xs)}")
    if len({x.numel() for x in xs}) != 1:
        raise ValueError(f"{who}s disagree on numel: {[x.numel() for x in xs]}")


class SimulatedCluster:
    """``world_size`` simulated ranks sharing one compressed allreduce of one tensor size.

    >>> cluster = SimulatedCluster(SignCodec(), "error_feedback", world_size=4)
    >>> outs = cluster.allreduce([x0, x1, x2, x3])   # one output per worker (all equal)
    """

    def __init__(self, codec: Codec, mode: str, world_size: int, counter: ByteCounter | None = None,
                 pieces: int | None = None, groups: Sequence[int] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        # pieces pipeline the network; a simulation has none: one piece unless asked (same bits)
        pieces = 1 if pieces is None else pieces
        self.world_size = world_size
        self.counter = counter if counter is not None else ByteCounter()
        # every worker reports to its own counter; the cluster's counter gets rank 0's view
        self.any_flag = False  # the OR of the last call's flags (see allreduce)
        self.flag_values: list[int] = [0]  # every worker's flag in the last call, as in the distributed call
        self.workers = [
            TwoStageRank(codec, mode, r, world_size, counter=self.counter if r == 0 else None, pieces=pieces,
                         groups=groups)
            for r in range(world_size)
        ]

    def allreduce(self, xs: Sequence[torch.Tensor], flags: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Compressed mean of ``xs`` (one tensor per worker); returns each worker's result.
        ``flags`` (one per worker): ``flag_values`` and ``any_flag``, as in the distributed call."""
        return self._run(xs, flags, None)

    def allreduce_into(self, xs: Sequence[torch.Tensor], out: torch.Tensor,
                       flags: Sequence[bool] | None = None, defer: bool = False) -> torch.Tensor | None:
        """:meth:`allreduce` with the result written into ``out`` (fp32, ``xs[0]``'s size) and returned.
        Every worker decodes the same gathered bytes the same way, so worker 0's result stands for all;
        the others are decoded only where decoding updates their state (``markov``: g_tilde).
        ``defer``: as in :class:`~.allreduce.CompressedAllreduce` (``decode_pending`` decodes it)."""
        res = self._run(xs, flags, out, defer)
        return None if res is None else res[0]

    @property
    def pending(self) -> bool:
        return self.workers[0].pending

    @property
    def pending_predicate(self) -> Predicate | None:
        """Worker 0's (None: the host decides a simulated call; see :attr:`.stage4.Stage4.pending_predicate`)."""
        return self.workers[0].pending_predicate

    def decode_pending(self, sink=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Worker 0 decodes the deferred result (see :meth:`allreduce_into`)."""
        return self.workers[0].decode_pending(sink, out)

    def discard_pending(self) -> None:
        self.workers[0].discard_pending()

    def _run(self, xs: Sequence[torch.Tensor], flags: Sequence[bool] | None,
             out: torch.Tensor | None, defer: bool = False) -> list[torch.Tensor] | None:
        record_flags(self, xs, flags, "worker")
        prepared = [w.prepare(x) for w, x in zip(self.workers, xs, strict=True)]
        bad = [r for r, (_, _, ok) in enumerate(prepared) if not bool(ok)]
        if bad:
            raise ValueError(f"SimulatedCluster: the input of worker(s) {bad} is not finite (NaN or inf); "
                             "every worker skipped this call and no state was changed")
        if xs[0].numel() == 0:
            return [x.detach().clone() for x in xs] if out is None else [out]
        workers = self.workers
        for k in range(workers[0].num_pieces):
            sends = [w.encode_stage(xp, sc, k) for w, (xp, sc, _) in zip(workers, prepared, strict=True)]
            for w in workers:  # all_to_all_single: server r receives row r of every worker, in worker order
                w.server_receive(torch.stack([s[w.rank] for s in sends]), k)
        decoders = workers
        if out is not None and workers[0].mode != "markov":
            decoders = workers[:1]  # the others would decode the same bits into buffers nobody reads
        dsts = [w.result_buffer(out, xs[0].dtype) for w in decoders]
        defer = defer and out is not None and not self.any_flag and workers[0].mode != "markov"
        kept = []
        for k in range(workers[0].num_pieces):
            gathered = torch.cat([w.server_send(k) for w in workers])  # all_gather: rows in rank order
            if k == 0 and not bool(workers[0].gathered_finite(gathered)):  # a simulation may wait here
                for w in workers:
                    w.reset_state()
                raise ValueError("SimulatedCluster: a server's mean overflowed fp32, so the result is not "
                                 "finite (inputs near the fp32 limit); every worker reset its error/estimate state")
            if defer:
                kept.append(gathered)
                continue
            for w, dst in zip(decoders, dsts, strict=True):
                w.finish_piece(gathered, dst, k)
        if defer:
            workers[0]._keep_pending(kept, dsts[0], out, xs[0].dtype)
            for w in self.workers:
                w.account()
            return None
        if out is not None:
            outs = [workers[0].finish(dsts[0], out, out.dtype)]
        else:
            outs = [w.finish(dst, None, x.dtype) for w, dst, x in zip(workers, dsts, xs, strict=True)]
        for w in self.workers:
            w.account()
        return outs

    def bind(self, numel: int, device: torch.device | str) -> None:
        """Allocate every worker's state for tensors of ``numel`` elements (see TwoStageRank)."""
        for w in self.workers:
            w.bind(numel, device)

    def reset_state(self) -> None:
        """Zero every worker's error / Markov state (e.g. at a phase switch)."""
        for w in self.workers:
            w.reset_state()

    def zero_state_at(self, idx: torch.Tensor) -> None:
        for w in self.workers:
            w.zero_state_at(idx)

    def state_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Every worker's state views covering input elements ``[lo, hi)`` (see TwoStageRank)."""
        return [v for w in self.workers for v in w.state_views(lo, hi)]

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "workers": [w.state_dict() for w in self.workers]}

    def load_state_dict(self, sd: dict, device: torch.device | str | None = None) -> None:
        if sd["world_size"] != self.world_size:
            raise ValueError(f"state is for {sd['world_size']} workers, this cluster has {self.world_size}")
        for w, wsd in zip(self.workers, sd["workers"], strict=True):
            w.load_state_dict(wsd, device)

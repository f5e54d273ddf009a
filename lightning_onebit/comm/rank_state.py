"""The error / Markov state of one rank of the two-stage allreduce: reset, views, checkpoints.

:class:`RankState` is a mixin of :class:`~lightning_onebit.comm.two_stage.TwoStageRank`, which
allocates the state when a tensor size is bound: ``worker`` (the worker error, or the worker's
Markov estimate), ``server`` (this rank's server error or running mean, one chunk) and, in Markov
mode, ``tilde`` (the shared estimate).
"""

from __future__ import annotations

import torch

__all__ = ["RankState"]


class RankState:
    """Mixin: what a caller does with a rank's per-element state (see the module docstring)."""

    def reset_state(self) -> None:
        """Zero the error / Markov state (e.g. at a phase switch)."""
        for t in (self.worker, self.server, self.tilde):
            if t is not None:
                t.zero_()

    def state_views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Views of every per-element state buffer where it covers input elements ``[lo, hi)``
        (worker error / estimate, g_tilde, and the part of this rank's server chunk inside it)."""
        if self.numel is None:
            return []
        out = [t[lo:hi] for t in (self.worker, self.tilde) if t is not None]
        if self.server is not None:
            seg, r = self.seg_len, self.rank
            a, b = max(lo, r * seg), min(hi, (r + 1) * seg)
            if b > a:
                out.append(self.server[a - r * seg : b - r * seg])
        return out

    def zero_state_at(self, idx: torch.Tensor) -> None:
        """Zero the per-element state at input positions ``idx`` (int64): worker error / estimate,
        g_tilde, and this rank's server state where its chunk holds them."""
        if self.numel is None:
            return
        for t in (self.worker, self.tilde):
            if t is not None:
                t[idx] = 0.0
        if self.server is not None:
            seg, r = self.seg_len, self.rank
            mine = idx[(idx >= r * seg) & (idx < (r + 1) * seg)]
            self.server[mine - r * seg] = 0.0

    def state_dict(self) -> dict:
        return {
            "mode": self.mode, "codec": repr(self.codec), "numel": self.numel, "groups": list(self.groups),
            "world_size": self.world_size, "rank": self.rank,
            "worker": None if self.worker is None else self.worker.clone(),
            "server": None if self.server is None else self.server.clone(),
            "tilde": None if self.tilde is None else self.tilde.clone(),
            "bytes_sent": self.bytes_sent, "calls": self.calls,
        }

    def load_state_dict(self, sd: dict, device: torch.device | str | None = None) -> None:
        """Restore a :meth:`state_dict`. The state goes to ``device`` (default: where this object's
        state already lives, else the CPU): the device of the tensors it will reduce, which a
        fresh object cannot know, so callers on a GPU pass it."""
        for key, mine in (("mode", self.mode), ("codec", repr(self.codec)), ("world_size", self.world_size)):
            if sd[key] != mine:
                raise ValueError(f"state was saved with {key}={sd[key]!r}, this object has {key}={mine!r}")
        if sd["numel"] is not None:
            if device is None:
                device = self.worker_device if self.numel is not None else "cpu"
            if self.numel is not None and torch.device(device) != self.worker_device:
                raise ValueError(f"state lives on {self.worker_device}, cannot load it onto {device}")
            self.bind(sd["numel"], device)
            for name in ("worker", "server", "tilde"):
                if getattr(self, name) is not None:
                    getattr(self, name).copy_(sd[name])
        self.bytes_sent, self.calls = sd["bytes_sent"], sd["calls"]


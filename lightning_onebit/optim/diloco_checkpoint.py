"""Checkpoints of :class:`~lightning_onebit.optim.DiLoCo`: the state every rank shares (the anchor,
the outer momentum, the schedule's clock, the outer steps in flight) and what only one rank holds
(its replica, its AdamW moments, its compression error)."""

from __future__ import annotations

import torch

__all__ = ["DiLoCoCheckpoint"]


class DiLoCoCheckpoint:
    """Mixin of :class:`~lightning_onebit.optim.DiLoCo` (placed right before ``torch.optim.Optimizer``
    in its bases): the ``diloco`` section of the state dict and its loading, checked against this
    optimizer's settings and layout. Uses DiLoCo's flat views, schedule and collectives."""

    def local_state(self) -> dict:
        """What only this rank holds: its replica (flat fp32) and :meth:`state_dict` (its AdamW moments, its
        error state). A checkpoint keeps every rank's, so a resume continues bit for bit."""
        replica = self._replica_aside if self._replica_aside is not None else self._flat()
        return {"params": replica, "optimizer": self.state_dict()}

    def load_local_state(self, local: dict) -> None:
        """Restore :meth:`local_state` (after the model holds the anchor)."""
        self.load_state_dict(local["optimizer"])
        self._unflatten_into_params(local["params"])

    def _wait(self, f: int) -> torch.Tensor:
        """Fragment f's outer all-reduce in flight, completed (a checkpoint keeps its result)."""
        at, work, result = self._pending[f]
        if work is not None:
            work.wait()
            self._pending[f] = (at, None, result)
        return result

    def state_dict(self) -> dict:
        sd = super().state_dict()
        # first: an outer all-reduce on the sender thread writes its collective's error state
        pending = {f: (at, self._wait(f).clone()) for f, (at, _, _) in self._pending.items()}
        sd["diloco"] = {
            "sync_every": self.sync_every, "compression": self.compression, "fragments": self.fragments,
            "overlap": self.overlap, "mixing": self.mixing, "keep_local": self.keep_local,
            "t": self._t, "last_sync": list(self._last_sync),
            "inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "skipped_steps": self.skipped_steps,
            "outer": {k: v.clone() for k, v in self._outer.items()},
            "comm_counter": self.comm_counter.state_dict(),
            "collectives": {f: c.state_dict() for f, c in self._collectives.items()},
            "two_level": self.two_level(),
            "pending": pending,
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        mine = sd.pop("diloco", None)
        if mine is None:
            raise ValueError("not a DiLoCo state_dict (no 'diloco' section)")
        for key, default in (("sync_every", None), ("compression", None), ("fragments", None), ("overlap", 0),
                             ("keep_local", False)):
            if mine.get(key, default) != getattr(self, key):
                raise ValueError(f"state was saved with {key}={mine.get(key, default)!r}, this optimizer has "
                                 f"{key}={getattr(self, key)!r}")
        here = self.two_level()
        if mine.get("collectives") and mine.get("two_level") != here:
            def say(k):
                return "flat" if k is None else f"two-level with {k} ranks per node"
            raise ValueError(f"state was saved with a {say(mine.get('two_level'))} outer all-reduce, this run has "
                             f"a {say(here)} one: its error state does not fit (resume with the same layout)")
        super().load_state_dict(sd)
        self._t, self._last_sync, self.inner_steps = mine["t"], list(mine["last_sync"]), mine["inner_steps"]
        self.outer_steps, self.skipped_steps = mine["outer_steps"], mine["skipped_steps"]
        self._outer = {k: v.clone() for k, v in mine["outer"].items()}
        self._pending = {int(f): (at, None, r.clone()) for f, (at, r) in mine.get("pending", {}).items()}
        self.comm_counter.load_state_dict(mine["comm_counter"])
        self._collectives = {}
        for f, sd_f in mine["collectives"].items():
            self._collectives[f] = self._make_collective(f)
            self._collectives[f].load_state_dict(sd_f)

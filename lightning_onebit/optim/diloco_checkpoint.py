"""Checkpoints of :class:`~lightning_onebit.optim.DiLoCo`: the state every rank shares (the anchor,
the outer momentum, the schedule's clock, the outer steps in flight) and what only one rank holds
(its replica, its AdamW moments, its compression error).

Two ways to save it:

* :meth:`~DiLoCoCheckpoint.state_dict` is this rank's whole state but its replica (the parameters,
  which ``model.state_dict()`` saves next to it): what a plain PyTorch loop saves per rank.
* :meth:`~DiLoCoCheckpoint.shared_state_dict` (identical on every rank, its size independent of the
  number of ranks: one file for all) and :meth:`~DiLoCoCheckpoint.rank_state_dict` (this rank's own,
  replica included: a shard per rank), restored together by
  :meth:`~DiLoCoCheckpoint.load_split_state_dict`. Without this rank's part (another number of ranks,
  a lost shard) the rank starts from the anchor: replica = anchor, error state zero, AdamW moments
  given (another rank's) or fresh. ``DiLoCoStrategy`` writes its checkpoints so.
* :meth:`~DiLoCoCheckpoint.sharded_state_dict` (a model FSDP2 shards, ``mesh=``): the tensors named by
  parameter and sharded as the parameters are, for ``torch.distributed.checkpoint`` (which writes every
  rank's shards and reshards them on loading), a small shared part, and this rank's own part for a file of
  its own; :meth:`~DiLoCoCheckpoint.load_sharded_state_dict` restores them, on the same mesh exactly, on
  another from the anchor with node 0's inner moments resharded. ``DiLoCoFSDPStrategy`` writes them so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..comm.sharding import like, node_index

__all__ = ["DiLoCoCheckpoint"]

# keys of ``_outer`` that only this rank holds: bf16's error feedback, keep_local's replica as sent
_OWN_OUTER = ("error", "sent")
# settings a state must have been saved with (and their value in states older than the setting)
_SETTINGS = (("sync_every", None), ("compression", None), ("fragments", None), ("overlap", 0), ("keep_local", False))


class DiLoCoCheckpoint:
    """Mixin of :class:`~lightning_onebit.optim.DiLoCo` (placed right before ``torch.optim.Optimizer``
    in its bases): the ``diloco`` section of the state dict, its split into a shared and a per-rank
    part, and their loading, checked against this optimizer's settings and layout. Uses DiLoCo's flat
    views, schedule and collectives."""

    # -- saving ---------------------------------------------------------------------------------------
    def local_state(self) -> dict:
        """This rank's replica (flat fp32) and :meth:`state_dict` (its AdamW moments, its error state): the
        format of checkpoints that held every rank's state in one file (see :meth:`load_local_state`)."""
        replica = self._replica_aside if self._replica_aside is not None else self._flat()
        return {"params": replica, "optimizer": self.state_dict()}

    def _wait(self, f: int) -> torch.Tensor:
        """Fragment f's outer all-reduce in flight, completed (a checkpoint keeps its result)."""
        at, work, result = self._pending[f]
        if work is not None:
            work.wait()
            self._pending[f] = (at, None, result)
        return result

    def _pending_results(self) -> dict[int, tuple[int, torch.Tensor]]:
        # first: an outer all-reduce on the sender thread writes its collective's error state
        return {f: (at, self._wait(f).clone()) for f, (at, _, _) in self._pending.items()}

    def _shared_section(self) -> dict:
        return {
            "sync_every": self.sync_every, "compression": self.compression, "fragments": self.fragments,
            "overlap": self.overlap, "mixing": self.mixing, "keep_local": self.keep_local,
            "t": self._t, "last_sync": list(self._last_sync),
            "inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "skipped_steps": self.skipped_steps,
            "comm_counter": self.comm_counter.state_dict(),
            "two_level": self.two_level(),
            "pending": self._pending_results(),
        }

    def state_dict(self) -> dict:
        """torch's ``state`` (AdamW's moments) and ``param_groups``, and a ``diloco`` section: settings,
        clock, counters, the outer state (anchor, momentum, bf16's error, keep_local's sent replicas), the
        collectives' error state, the layout and the outer steps in flight. This rank's whole state but its
        replica, the parameters themselves."""
        sd = super().state_dict()
        sd["diloco"] = dict(self._shared_section(), outer={k: v.clone() for k, v in self._outer.items()},
                            collectives={f: c.state_dict() for f, c in self._collectives.items()})
        return sd

    def shared_state_dict(self) -> dict:
        """What every rank holds alike: ``param_groups`` and the ``diloco`` section of :meth:`state_dict`
        without this rank's own state (its outer state is the anchor and the momentum; ``collectives``
        lists the fragments that have one). Identical on every rank (the step counts and byte counter are
        this rank's), no per-parameter ``state``; its size does not depend on the number of ranks."""
        sd = super().state_dict()
        section = dict(self._shared_section(), collectives=sorted(self._collectives),
                       outer={k: v.clone() for k, v in self._outer.items() if not k.startswith(_OWN_OUTER)})
        return {"state": {}, "param_groups": sd["param_groups"], "diloco": section}

    def rank_state_dict(self) -> dict:
        """What only this rank holds: its replica (flat fp32; the one set aside while the anchor is in
        the parameters), its inner AdamW's ``state`` (moments and step counts, as torch's
        ``state_dict()`` packs them), its error state (the collectives' ``state_dict()``, bf16's error,
        keep_local's sent replicas) and its step counts and byte counter."""
        for f in list(self._pending):  # first: the sender thread is done with the collectives' error state
            self._wait(f)
        replica = self._replica_aside if self._replica_aside is not None else self._flat()
        return {"replica": replica, "inner": super().state_dict()["state"],
                "outer": {k: v.clone() for k, v in self._outer.items() if k.startswith(_OWN_OUTER)},
                "collectives": {f: c.state_dict() for f, c in self._collectives.items()},
                "inner_steps": self.inner_steps, "skipped_steps": self.skipped_steps,
                "comm_counter": self.comm_counter.state_dict()}

    # -- loading --------------------------------------------------------------------------------------
    def load_local_state(self, local: dict) -> None:
        """Restore :meth:`local_state` (after the model holds the anchor)."""
        self.load_state_dict(local["optimizer"])
        self._unflatten_into_params(local["params"])

    @staticmethod
    def split_state_dict(state_dict: Mapping[str, Any]) -> tuple[dict, dict]:
        """A whole :meth:`state_dict` as (its :meth:`shared_state_dict` part, its :meth:`rank_state_dict`
        part without the replica, which the parameters hold). No tensor is copied."""
        mine = state_dict.get("diloco")
        if mine is None:
            raise ValueError("not a DiLoCo state_dict (no 'diloco' section)")
        if not isinstance(mine.get("collectives"), Mapping):
            raise ValueError("this is the shared part of a DiLoCo state (shared_state_dict(), a strategy "
                             "checkpoint's main file): load it with load_split_state_dict(shared, rank_state)")
        outer = mine["outer"]
        shared = {"state": {}, "param_groups": state_dict["param_groups"],
                  "diloco": dict(mine, collectives=sorted(mine["collectives"]),
                                 outer={k: v for k, v in outer.items() if not k.startswith(_OWN_OUTER)})}
        own = {"inner": state_dict.get("state", {}), "collectives": mine["collectives"],
               "outer": {k: v for k, v in outer.items() if k.startswith(_OWN_OUTER)}}
        return shared, own

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` (the parameters are the caller's: ``model.load_state_dict``)."""
        self._load(*self.split_state_dict(state_dict), None)

    def load_split_state_dict(self, shared: Mapping[str, Any], rank: Mapping[str, Any] | None = None, *,
                              inner: Mapping[Any, Any] | None = None) -> None:
        """Restore :meth:`shared_state_dict` and this rank's :meth:`rank_state_dict` (after the model holds
        the anchor): the rank continues exactly where it was. ``rank=None``: the rank starts from the
        anchor instead (replica = anchor, error state zero, counters those of ``shared``) with ``inner``
        as its AdamW state (another rank's ``rank_state_dict()["inner"]``), or fresh moments without it.
        Raises ``ValueError`` for other settings, and for a ``rank`` part of another layout (flat vs
        two-level: its error state does not fit)."""
        section = shared.get("diloco")
        if section is None or isinstance(section.get("collectives"), Mapping):
            raise ValueError("not the shared part of a DiLoCo state (shared_state_dict()); a whole state_dict() "
                             "loads with load_state_dict")
        self._load(shared, rank, inner)

    def _load(self, shared: Mapping[str, Any], own: Mapping[str, Any] | None, inner: Mapping | None) -> None:
        """``own``: this rank's part (``replica`` optional: :meth:`load_state_dict` leaves the parameters
        alone); None: start from the anchor with ``inner``'s moments."""
        mine = shared["diloco"]
        for key, default in _SETTINGS:
            if mine.get(key, default) != getattr(self, key):
                raise ValueError(f"state was saved with {key}={mine.get(key, default)!r}, this optimizer has "
                                 f"{key}={getattr(self, key)!r}")
        here = self.two_level()
        if own is not None and own.get("collectives") and mine.get("two_level") != here:
            def say(k):
                return "flat" if k is None else f"two-level with {k} ranks per node"
            raise ValueError(f"state was saved with a {say(mine.get('two_level'))} outer all-reduce, this run has "
                             f"a {say(here)} one: its error state does not fit (resume with the same layout)")
        numel = sum(t.numel() for t in self._tensors())  # of a sharded model: this rank's shards
        for name, t in (("anchor", mine["outer"].get("anchor")), ("replica", (own or {}).get("replica"))):
            if t is not None and t.numel() != numel:
                raise ValueError(f"state's {name} has {t.numel()} elements, this optimizer's parameters {numel}")
        super().load_state_dict({"state": own["inner"] if own is not None else (inner or {}),
                                 "param_groups": shared["param_groups"]})
        counts = own if own is not None and "inner_steps" in own else mine
        self._t, self._last_sync = mine["t"], list(mine["last_sync"])
        self.inner_steps, self.skipped_steps = counts["inner_steps"], counts["skipped_steps"]
        self.outer_steps = mine["outer_steps"]
        self.comm_counter.load_state_dict(counts.get("comm_counter", mine["comm_counter"]))
        device = self._state_device()  # beside the parameters (a shard loads on CPU), or offloaded
        outer = {**mine["outer"], **(own["outer"] if own is not None else {})}
        self._outer = {k: v.to(device, copy=True) for k, v in outer.items()}
        self._pending = {int(f): (at, None, r.to(device, copy=True)) for f, (at, r) in mine.get("pending", {}).items()}
        self._collectives = {}
        for f in mine["collectives"]:  # every rank makes the same ones (two-level: collective)
            self._collectives[int(f)] = self._make_collective(int(f))
            if own is not None:
                self._collectives[int(f)].load_state_dict(own["collectives"][f], device=device)
        if own is None and "anchor" in self._outer:  # (without one, no step yet: the parameters are the anchor)
            anchor = self._outer["anchor"]
            self._unflatten_into_params(anchor)
            if self.keep_local:  # a step in flight lands on a replica sent from the anchor: anchor - sent = 0
                spans = self._fragment_spans()
                for f in self._pending:
                    self._outer[f"sent{f}"] = anchor[spans[f][0]:spans[f][1]].clone()
        elif own is not None and own.get("replica") is not None:
            self._unflatten_into_params(own["replica"])


def _kind(v: Any) -> tuple:
    """What a saved inner-state value was, to make a tensor of its form to load it into."""
    if isinstance(v, torch.Tensor):
        from ..comm.sharding import is_sharded

        return ("dtensor", v.dtype) if is_sharded(v) else ("tensor", tuple(v.shape), v.dtype)
    return ("value",)


class ShardedDiLoCoCheckpoint:
    """Mixin of :class:`~lightning_onebit.optim.DiLoCo` for sharded parameters (``mesh=``), after
    :class:`DiLoCoCheckpoint` in its bases: checkpoints through ``torch.distributed.checkpoint``.

    The tensors (:meth:`sharded_state_dict`'s first part), each keyed by parameter name and sharded as
    its parameter: ``anchor``, ``momentum`` (of the fragments that had an outer step), ``pending`` (the
    averaged pseudo-gradients of outer steps in flight) — identical on every node, so written once — and
    ``node<k>.inner``, node k's inner optimizer state (the nodes' replicas differ between outer steps, so
    each node's is kept). Fragments are cut on the whole parameters' sizes, so these names and fragments
    mean the same on any mesh."""

    def _views(self, flat: torch.Tensor, f: int | None = None) -> dict[int, torch.Tensor]:
        """Parameter index -> its part of ``flat`` (the flat view, or fragment f's span of it), shaped as
        this rank's shard."""
        tensors = self._tensors()
        out, o = {}, 0
        for i in (range(len(tensors)) if f is None else self.fragment_tensors()[f]):
            out[i] = flat[o:o + tensors[i].numel()].view(tensors[i].shape)
            o += tensors[i].numel()
        return out

    def _named(self, names: Sequence[str], anchor: torch.Tensor, momentum: Mapping[int, torch.Tensor],
               pending: Mapping[int, torch.Tensor], inner: dict, node: int) -> dict:
        params = self._params()

        def named(flat: torch.Tensor, f: int | None = None) -> dict[str, torch.Tensor]:
            return {names[i]: like(params[i], v) for i, v in self._views(flat, f).items()}

        out = {"anchor": named(anchor), "momentum": {}, "pending": {}, f"node{node}": {"inner": inner}}
        for key, flats in (("momentum", momentum), ("pending", pending)):
            for f, flat in flats.items():  # fragments hold disjoint parameters: one name space
                out[key].update(named(flat, f))
        return out

    def _check_names(self, names: Sequence[str]) -> None:
        if self.sharding is None:
            raise ValueError("sharded_state_dict is for sharded parameters (DiLoCo(..., mesh=)); use state_dict()")
        if len(names) != len(self._params()) or len(set(names)) != len(names):
            raise ValueError(f"names: one distinct name per parameter ({len(self._params())}), got {len(names)}")

    def sharded_state_dict(self, names: Sequence[str]) -> tuple[dict, dict, dict]:
        """``(tensors, shared, own)`` of a sharded DiLoCo, ``names`` naming its parameters in ``param_groups``
        order (``named_parameters()``'s names): ``tensors`` for ``torch.distributed.checkpoint`` (see the
        class docstring; they share this optimizer's memory: save them before the next step), ``shared``
        what every rank holds alike without tensors (settings, clock, counters, ``param_groups``, what
        ``tensors`` holds), ``own`` this rank's :meth:`rank_state_dict` without its inner state (its
        replica, its error state, its counters), for a file of its own."""
        self._check_names(names)
        for f in list(self._pending):  # the sender thread is done with the results and the error state
            self._wait(f)
        self._ensure_anchor()
        params, dev = self._params(), self._tensors()[0].device
        # on the parameters' device, as their mesh is (offloaded state copied there for the write; else the same)
        momentum = {f: self._outer[f"momentum{f}"].to(dev) for f in range(self.fragments)
                    if f"momentum{f}" in self._outer}
        pending = {f: r.to(dev) for f, (_, _, r) in self._pending.items()}
        inner = {names[i]: dict(self.state[p]) for i, p in enumerate(params) if self.state.get(p)}
        tensors = self._named(names, self._outer["anchor"].to(dev), momentum, pending, inner,
                              node_index(self.sharding.mesh))
        section = {k: v for k, v in self._shared_section().items() if k != "pending"}
        section.update(pending_at={f: at for f, (at, _, _) in self._pending.items()}, momentum=sorted(momentum),
                       collectives=sorted(self._collectives),
                       inner={n: {k: _kind(v) for k, v in st.items()} for n, st in inner.items()},
                       mesh=(self.sharding.nodes, self.sharding.ranks_per_node))
        shared = {"param_groups": torch.optim.Optimizer.state_dict(self)["param_groups"], "diloco": section}
        own = {k: v for k, v in self.rank_state_dict().items() if k != "inner"}
        return tensors, shared, own

    def load_sharded_state_dict(self, shared: Mapping[str, Any], read: Callable[[dict], None],
                                names: Sequence[str], own: Mapping[str, Any] | None = None, *,
                                node: int | None = None) -> None:
        """Restore :meth:`sharded_state_dict`: ``read(tensors)`` fills tensors of its form in place (a
        ``torch.distributed.checkpoint`` load, which reshards); every rank calls it together. With ``own``
        (this rank's part, saved on the same mesh) the rank continues exactly; without, it starts from the
        anchor (error state zero) with node ``node``'s inner moments (default 0), resharded to this mesh."""
        self._check_names(names)
        section = shared["diloco"]
        here = (self.sharding.nodes, self.sharding.ranks_per_node)
        if own is not None and tuple(section["mesh"]) != here:
            raise ValueError(f"state was saved on a mesh of {tuple(section['mesh'])} (nodes, ranks per node), this "
                             f"optimizer has {here}: this rank's own part does not fit (load without it)")
        node = node_index(self.sharding.mesh) if own is not None else (node or 0)
        self._ensure_anchor()
        # read on the parameters' device, as their mesh is (_load moves an offloaded state to the CPU)
        spans, device, params = self._fragment_spans(), self._tensors()[0].device, self._params()
        anchor = torch.empty(self._outer["anchor"].shape, dtype=torch.float32, device=device)

        def zeros(f: int) -> torch.Tensor:
            return torch.zeros(spans[f][1] - spans[f][0], device=device)

        momentum = {int(f): zeros(int(f)) for f in section["momentum"]}
        pending = {int(f): zeros(int(f)) for f in section["pending_at"]}
        by_name = dict(zip(names, params, strict=True))
        inner = {}
        for name, kinds in section["inner"].items():
            if name not in by_name:
                raise ValueError(f"state holds inner state for parameter {name!r}, which this optimizer does not have")
            p = by_name[name]
            inner[name] = {k: torch.zeros_like(p, dtype=kind[1]) if kind[0] == "dtensor" else
                           torch.zeros(kind[1], dtype=kind[2]) if kind[0] == "tensor" else None
                           for k, kind in kinds.items()}
        tensors = self._named(names, anchor, momentum, pending, inner, node)
        read(tensors)
        inner = tensors[f"node{node}"]["inner"]  # values that are not tensors come back in the dict
        state = {i: inner[n] for i, n in enumerate(names) if n in inner}
        outer = {"anchor": anchor, **{f"momentum{f}": m for f, m in momentum.items()}}
        section = dict(section, outer=outer, pending={f: (section["pending_at"][f], pending[f]) for f in pending})
        whole = {"state": {}, "param_groups": shared["param_groups"], "diloco": section}
        self._load(whole, None if own is None else dict(own, inner=state), state)

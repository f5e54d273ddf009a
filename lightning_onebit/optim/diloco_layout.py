"""The flat view of :class:`~lightning_onebit.optim.DiLoCo`'s parameters: the fp32 vector the anchor, the
outer momentum and the pseudo-gradients live in (every parameter in ``param_groups`` order), its fragments
(Streaming DiLoCo's slices) and their schedule (where the ranks stand in it: ``since_sync``, ``synced``),
the scratch the pseudo-gradients are taken in, and the anchor swapped into the parameters for validation.
Of sharded parameters (FSDP2's DTensors, DiLoCo's ``mesh``) the flat view holds this rank's shards only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..comm.agree import is_distributed
from ..comm.dense import backend_for, dist_backend
from ..comm.sharding import local

__all__ = ["DiLoCoLayout"]


class DiLoCoLayout:
    """Mixin of :class:`~lightning_onebit.optim.DiLoCo`: the flat view, the fragments, the scratch and the
    anchor in the parameters. Uses DiLoCo's ``param_groups``, settings (``fragments``, ``sync_every``,
    ``keep_local``, ``offload``), clock and outer state."""

    sharding = None  #: DiLoCo's ShardedLayout where its parameters are sharded (mesh=)
    offload = False  #: the outer state on the CPU (pinned beside CUDA parameters), not where the parameters are

    def _state_device(self) -> torch.device:
        """Where the flat outer state lives: the CPU when offloaded, else beside the parameters."""
        return torch.device("cpu") if self.offload else self._tensors()[0].device

    def _to_state(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (the parameters' flat view, made on their device) where the outer state lives: a copy in
        pinned CPU memory when offloaded beside CUDA parameters (the copies to and from the device go faster)."""
        if not self.offload or flat.device.type == "cpu":
            return flat
        out = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return out.copy_(flat)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _tensors(self) -> list[torch.Tensor]:
        """The parameters as this rank holds them: its shard of a sharded one, a plain one whole."""
        with torch.no_grad():
            return [local(p).detach() for p in self._params()]

    def _flat(self) -> torch.Tensor:
        """The parameters (this rank's shards) as one fp32 vector where the outer state lives."""
        return self._to_state(torch.cat([t.reshape(-1).float() for t in self._tensors()]))

    def _unflatten_into_params(self, flat: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Copy ``flat`` into the parameters whose span lies in ``[lo, hi)`` of the flat vector."""
        o = 0
        with torch.no_grad():
            for t in self._tensors():
                if o >= lo and (hi is None or o + t.numel() <= hi):
                    t.copy_(flat[o:o + t.numel()].view_as(t))
                o += t.numel()

    def _fragment_spans(self) -> list[tuple[int, int, list[int]]]:
        """The fragments: consecutive parameter tensors, cut where the running size passes k/F of the
        total (each at least one tensor); per fragment ``(lo, hi, tensor offsets relative to lo)`` in the flat
        view."""
        if self._spans is None:
            # cut on the whole parameters' sizes: of sharded ones every rank then cuts alike, whatever the mesh
            sizes = [p.numel() for p in self._params()]
            if len(sizes) < self.fragments:
                raise ValueError(f"fragments={self.fragments} but the optimizer holds {len(sizes)} tensors")
            total, cuts, o = sum(sizes), [0], 0
            for i, n in enumerate(sizes[:-1]):
                o += n
                left = len(sizes) - i - 1  # tensors after this one
                k = len(cuts)
                if k < self.fragments and (o >= k * total / self.fragments or left == self.fragments - k):
                    cuts.append(i + 1)
            cuts.append(len(sizes))
            held = [t.numel() for t in self._tensors()]  # the spans in the flat view: this rank's shards
            starts = [sum(held[:i]) for i in range(len(held) + 1)]
            self._spans = [(starts[a], starts[b], [starts[i] - starts[a] for i in range(a, b)])
                           for a, b in zip(cuts, cuts[1:], strict=False)]
        return self._spans

    def fragment_tensors(self) -> list[list[int]]:
        """The indices (in ``param_groups`` order) of each fragment's parameter tensors."""
        out, k = [], 0
        for _, _, offs in self._fragment_spans():
            out.append(list(range(k, k + len(offs))))
            k += len(offs)
        return out

    def _due(self, t: int) -> list[int]:
        """Fragments whose outer step follows inner step ``t``: fragment f at ``t = (f + 1) H / F`` mod H,
        so with F fragments one of them syncs every H / F steps (each still every H)."""
        h, f_count = self.sync_every, self.fragments
        return [f for f in range(f_count) if t % h == (h * (f + 1) // f_count) % h]

    def _ensure_anchor(self) -> None:
        if "anchor" not in self._outer:
            device = self._tensors()[0].device
            if (self.offload and device.type != "cpu" and is_distributed()
                    and backend_for(self.process_group, torch.device("cpu")) is None):
                raise ValueError(f"DiLoCo(offload=True) runs the outer all-reduce on CPU tensors, which the process "
                                 f"group's backend ({dist_backend(self.process_group)}) does not carry; initialise it "
                                 "with a CPU backend too, e.g. init_process_group('cpu:gloo,cuda:nccl')")
            flat = self._flat()
            if self.sharding is not None:  # once: the outer all-reduce's ranks must hold shards of one size
                self.sharding.check_sizes(flat.numel())
            self._outer["anchor"] = flat

    def _span_of_scratch(self, f: int) -> torch.Tensor:
        """Fragment f's slice of a flat fp32 buffer kept across outer steps: its pseudo-gradient, then its
        Nesterov sum (until the fragment's outer step lands, nothing else writes there)."""
        if self._scratch is None:  # (pinned where the anchor is: the replica is copied in from the device)
            anchor = self._outer["anchor"]
            self._scratch = torch.empty(anchor.shape, dtype=anchor.dtype, device=anchor.device,
                                        pin_memory=anchor.is_pinned())
        lo, hi, _ = self._fragment_spans()[f]
        return self._scratch[lo:hi]

    def _pseudo_gradient(self, f: int) -> torch.Tensor:
        """``anchor - replica`` over fragment f, in the scratch (a new 4 B per parameter each outer step
        costs as much as the arithmetic here: fresh pages)."""
        lo, hi, _ = self._fragment_spans()[f]
        out, params = self._span_of_scratch(f), self._tensors()
        if out.device == params[0].device:
            torch.cat([params[i].reshape(-1).float() for i in self.fragment_tensors()[f]], out=out)
        else:  # offloaded: each tensor copied off the device into its span (the same fp32 values as cat's)
            o = 0
            for i in self.fragment_tensors()[f]:
                n = params[i].numel()
                out[o:o + n].copy_(params[i].reshape(-1))
                o += n
        if self.keep_local:  # the replica this outer step starts from
            if f"sent{f}" not in self._outer:
                self._outer[f"sent{f}"] = torch.empty_like(out)
            self._outer[f"sent{f}"].copy_(out)
        return torch.sub(self._outer["anchor"][lo:hi], out, out=out)

    def anchor_views(self) -> dict[int, torch.Tensor]:
        """``id(parameter)`` -> the anchor of that parameter (a view of the flat anchor, fp32; of this rank's
        shard where the parameter is sharded)."""
        self._ensure_anchor()
        out, o, a = {}, 0, self._outer["anchor"]
        for p, t in zip(self._params(), self._tensors(), strict=True):
            out[id(p)] = a[o:o + t.numel()].view(t.shape)
            o += t.numel()
        return out

    @contextlib.contextmanager
    def anchor_in_params(self) -> Iterator[None]:
        """Inside: the parameters hold the anchor, the model every rank shares (what validation
        evaluates); on exit this rank's replica comes back. Of an FSDP2 model, call
        ``lightning_onebit.comm.sharding.reshard(model)`` before entering and before leaving: FSDP2's root keeps
        the parameters it gathered for a forward without backward, and would not see the swap."""
        local = self._replica_aside = self._flat()  # local_state() inside saves the replica, not the anchor
        self._unflatten_into_params(self._outer["anchor"] if "anchor" in self._outer else local)
        try:
            yield
        finally:
            self._replica_aside = None
            self._unflatten_into_params(local)

    @property
    def since_sync(self) -> int:
        """Inner steps since the oldest fragment's last outer step (the same on every rank)."""
        return self._t - min(self._last_sync)

    @property
    def synced(self) -> bool:
        """Whether every rank holds the anchor's values: no inner step since an outer step and none in
        flight (else ``outer_step()`` ends the interval: the strategy calls it when a fit ends)."""
        return self.since_sync == 0 and not self._pending

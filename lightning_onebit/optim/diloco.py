r"""DiLoCo: ``sync_every`` local steps (AdamW, or any inner optimizer), then one outer Nesterov step on the
averaged pseudo-gradient.

Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language Models* (arXiv 2311.08105).
Every rank ``r`` trains its own replica :math:`\theta_r` with the inner optimizer (``inner``: torch's
AdamW by default, by the kernel its ``foreach``/``fused`` options choose; its state per rank, never
averaged) and sends nothing. Every ``sync_every`` = H inner steps, with :math:`\theta` the anchor (the model every
rank held after the previous outer step):

.. math::
    \Delta_r &= \theta - \theta_r \qquad\text{(rank } r\text{'s pseudo-gradient)}\\
    \Delta &= C\big(\tfrac1n \textstyle\sum_r \Delta_r\big) \qquad\text{(the all-reduce, compressed or not)}\\
    b &\leftarrow \mu\, b + \Delta \qquad (b = \Delta \text{ at the first outer step})\\
    \theta &\leftarrow \theta - \eta\,(\Delta + \mu\, b) \qquad (\theta - \eta\, b \text{ without Nesterov})\\
    \theta_r &\leftarrow \theta

with :math:`\eta` = ``outer_lr`` (0.7) and :math:`\mu` = ``outer_momentum`` (0.9), the paper's
settings; the outer step is ``torch.optim.SGD(nesterov=True)``'s arithmetic on the anchor.

**Local SGD and post-local SGD** are DiLoCo with other inner and outer optimizers: ``inner=torch.optim.SGD``
(its arguments in ``inner_kwargs``) and the outer step plain averaging, ``outer_lr=1.0, outer_momentum=0.0,
nesterov=False`` (:math:`\theta \leftarrow \tfrac1n \sum_r \theta_r`, every ``sync_every`` steps), with any
``compression`` of the averaged difference.

``fragments`` = F > 1 is Streaming DiLoCo's schedule (Douillard et al., arXiv 2501.18512): the
parameter tensors are cut into F consecutive fragments of about equal size, each with its own outer
step every H inner steps, fragment f after inner steps ``(f + 1) H / F`` mod H, so one fragment
travels every H / F steps and the peak traffic drops F-fold. ``overlap`` = tau > 0 is its overlap: a
fragment's all-reduce starts after inner step t and its outer step is applied after inner step t + tau,
while the replicas go on training and the all-reduce runs meanwhile (fp32 and bf16 as an async
collective, the compressed modes on a sender thread: :mod:`.diloco_allreduce`). ``mixing`` = alpha is
its merge of the arriving global fragment into the replica:
:math:`\theta_r \leftarrow \alpha\,\theta_r + (1 - \alpha)\,\theta` (0, the default, replaces the
replica as DiLoCo does; the paper mixes local and global values when it overlaps). ``keep_local=True``
merges instead by moving the replica onto the new anchor with the tau inner steps it took while the step
was in flight: :math:`\theta_r \leftarrow \theta + (\theta_r - \theta_r^{sent})`, where
:math:`\theta_r^{sent}` is the replica the pseudo-gradient was taken from (kept per fragment, 4 B per
parameter); those steps then count in the next pseudo-gradient instead of being dropped.

``compression`` (what each rank puts on the wire per outer step and parameter, ``n`` ranks):

* ``"fp32"``: ``dist.all_reduce`` of the fp32 pseudo-gradients, exact (ring: 2 (n-1)/n x 4 B);
* ``"bf16"``: as PyTorch's ``bf16_compress_hook`` (each rank divides by n, casts to bf16, all-reduces
  in bf16: 2 (n-1)/n x 2 B), with error feedback: what the cast dropped is added to the next
  pseudo-gradient;
* ``"8bit"``, ``"4bit"``, ``"2bit"``, ``"1bit"``: the package's two-stage compressed all-reduce (min-max
  8-, 4- or 2-bit codes, or signs with l2 scales; every tensor its own scales), worker and server error
  feedback (about 2 (n-1)/n x 1, 1/2, 1/4 or 1/8 B, plus 8 or 4 B of scales per tensor and chunk); the
  outer update is the same on every rank. With several ranks per node (``ranks_per_node``, by default
  the launcher's ``LOCAL_WORLD_SIZE``) these use the two-level layout of
  :class:`~lightning_onebit.comm.HierarchicalAllreduce`: an fp32 mean inside each node, the compressed
  all-reduce between nodes only (``hierarchical=False`` forces the flat one). fp32 and bf16 are one
  flat all-reduce, as DDP runs them.

Memory per parameter beyond AdamW's (8 B): the anchor, the outer momentum and a scratch for the
pseudo-gradients (4 + 4 + 4 B, fp32), and for the compressed modes the error state (4 B, plus 4/n B on
the server side, or 4/N B with the two-level layout's N nodes, which also keeps fp32 buffers of a shard
inside the node); with ``offload=True`` all of it in CPU memory instead of the device's.
Non-finite gradients: an inner step with a NaN/inf gradient raises :class:`NonFiniteGradientError`
on its rank (``on_nonfinite="raise"``, the default) or is skipped there (``"skip"``; counted in
``skipped_steps``); nothing is exchanged in inner steps, so the ranks need not agree. A non-finite
pseudo-gradient fails the outer step on every rank before any state changes.
A rank that dies or stalls fails its peers' outer all-reduce with :class:`CollectiveError` (at once, or
after the process group's timeout), where it lands; that fragment's outer step is not applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..comm import (
    ByteCounter,
    CollectiveError,
    NonFiniteInputError,
    Topology,
    Wire,
    all_finite,
    all_finite_many,
    any_across,
    group_size,
)
from ..comm.sharding import ShardedLayout, local, sharded_kind
from .diloco_allreduce import OUTER_WIRES, OuterMeans
from .diloco_checkpoint import DiLoCoCheckpoint, ShardedDiLoCoCheckpoint
from .diloco_layout import DiLoCoLayout
from .functional import outer_nesterov_
from .nonfinite import NonFiniteGradientError

__all__ = ["COMPRESSIONS", "DiLoCo", "outer_nesterov_"]

COMPRESSIONS = OUTER_WIRES
#: the inner AdamW's defaults where ``inner`` is AdamW and the arguments are not given
_ADAMW = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _inner_optimizer(inner: type[torch.optim.Optimizer], params: Iterable, lr: float, adamw: dict[str, Any],
                     kwargs: Mapping[str, Any] | None) -> torch.optim.Optimizer:
    """The inner optimizer over ``params``: ``inner(params, lr=lr, **its arguments)``. AdamW's own arguments
    (``adamw``: ``None`` where not given) go to an AdamW; given to another inner optimizer they are an error
    (they would be dropped), as is an ``inner`` that is not a ``torch.optim.Optimizer`` class."""
    if not (isinstance(inner, type) and issubclass(inner, torch.optim.Optimizer)):
        raise ValueError(f"inner must be a torch.optim.Optimizer class (e.g. torch.optim.SGD), got {inner!r}")
    kw = dict(kwargs or {})
    if issubclass(inner, torch.optim.AdamW):
        given = {k: v for k, v in adamw.items() if v is not None}
        twice = sorted(set(given) & set(kw))
        if twice:
            raise ValueError(f"DiLoCo: {twice} given both as arguments and in inner_kwargs; give each once")
        kw = {**{k: v for k, v in _ADAMW.items() if k not in kw}, **given, **kw}
    else:
        given = sorted(k for k, v in adamw.items() if v is not None)
        if given:
            raise ValueError(f"DiLoCo: {given} are the inner AdamW's arguments, but inner is {inner.__name__}; "
                             f"pass {inner.__name__}'s arguments in inner_kwargs")
    if "lr" in kw:
        raise ValueError("DiLoCo: the inner learning rate is lr, not inner_kwargs['lr']")
    try:
        return inner(params, lr=lr, **kw)
    except TypeError as exc:
        raise ValueError(f"DiLoCo: {inner.__name__} does not take {sorted(kw)}: {exc}") from exc


class DiLoCo(DiLoCoLayout, ShardedDiLoCoCheckpoint, DiLoCoCheckpoint, torch.optim.Optimizer):
    """DiLoCo with an inner optimizer on every rank's replica (see the module docstring for the update rules).

    ``inner`` (keyword-only, default ``torch.optim.AdamW``): the inner optimizer's class; ``lr`` is its
    learning rate, which LR schedulers drive. With AdamW, ``betas``, ``eps``, ``weight_decay`` (default
    (0.9, 0.999), 1e-8, 1e-2), ``foreach`` and ``fused`` are its arguments (``fused=True`` runs torch's
    fused kernel, faster than its default for-loop on a CPU thread: ``benchmarks/optimizer_step.py``);
    another inner optimizer takes its arguments beyond ``lr`` in ``inner_kwargs`` (AdamW's arguments may
    go there too). The outer arguments are keyword-only. ``process_group``: the ranks that average
    (default: the world). Call ``step()`` on every rank after each backward, without DDP (or with DDP's
    allreduce skipped): the inner steps never communicate.

    ``mesh``: a 2-D ``DeviceMesh`` of (nodes, ranks per node) with named dimensions, for a model whose every
    parameter FSDP2 shards over its inner dimension (``fully_shard(module, mesh=mesh["shard"])``): the state
    is kept for this rank's shards, the outer all-reduce runs over the ranks holding the same shard on every
    node (instead of ``process_group``, ``ranks_per_node`` and ``hierarchical``), and the ranks of a node skip
    or raise on a non-finite step together (``docs/design/sharding.md``).

    ``offload=True`` keeps the outer state (the anchor, the outer momentum, the pseudo-gradients' scratch and
    the compressed modes' error state: 12-16 B per parameter) in CPU memory, pinned beside CUDA parameters,
    as INTELLECT-1 does: at an outer step the replica is copied off the device, the pseudo-gradient, the
    all-reduce (on the CPU, so the group must carry CPU tensors: gloo, or ``"cpu:gloo,cuda:nccl"``) and the
    Nesterov step run on the CPU, and the new anchor is copied back; the bits are those without offload.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, *,
                 inner: type[torch.optim.Optimizer] = torch.optim.AdamW, inner_kwargs: Mapping[str, Any] | None = None,
                 foreach: bool | None = None, fused: bool | None = None, sync_every: int = 16, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, compression: str = "fp32",
                 fragments: int = 1, on_nonfinite: str = "raise", process_group=None,
                 ranks_per_node: int | None = None, hierarchical: bool | None = None, overlap: int = 0,
                 mixing: float = 0.0, keep_local: bool = False, mesh=None, offload: bool = False) -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if nesterov and outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD)")
        if not isinstance(fragments, int) or isinstance(fragments, bool) or not 1 <= fragments <= sync_every:
            raise ValueError(f"fragments must be an int in [1, sync_every={sync_every}], got {fragments!r}")
        wire = Wire.parse(compression, option="compression", allowed=OUTER_WIRES)
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        topology = Topology(hierarchical=hierarchical, ranks_per_node=ranks_per_node, who="DiLoCo")  # validates
        if not isinstance(overlap, int) or isinstance(overlap, bool) or not 0 <= overlap < sync_every:
            raise ValueError(f"overlap must be an int in [0, sync_every={sync_every}), got {overlap!r}")
        if not 0 <= mixing < 1:
            raise ValueError(f"mixing must be in [0, 1), got {mixing!r}")
        if keep_local not in (True, False) or (keep_local and mixing):
            raise ValueError(f"keep_local must be True or False, and mixing 0 with it; got keep_local={keep_local!r}, "
                             f"mixing={mixing!r}")
        if offload not in (True, False):
            raise ValueError(f"offload must be True or False, got {offload!r}")
        self.sharding = None if mesh is None else ShardedLayout(mesh, who="DiLoCo")
        if self.sharding is not None:
            given = {k: v for k, v in (("process_group", process_group), ("ranks_per_node", ranks_per_node))
                     if v is not None}
            if given or hierarchical:
                raise ValueError(f"DiLoCo: mesh= sets the outer all-reduce's group (the ranks holding the same shard "
                                 f"on every node, one per node); drop {sorted(given) or ['hierarchical']}")
            process_group, topology = self.sharding.replica_group, Topology(hierarchical=False, who="DiLoCo")
        # the inner optimizer validates its arguments and gives its defaults; it shares DiLoCo's param groups
        self._inner = _inner_optimizer(inner, params, lr, dict(betas=betas, eps=eps, weight_decay=weight_decay,
                                                               foreach=foreach, fused=fused), inner_kwargs)
        super().__init__(self._inner.param_groups, self._inner.defaults)
        if self.sharding is not None:
            self.sharding.check_params(self._params())
        elif (kind := next((k for p in self._params() if (k := sharded_kind(p))), None)) is not None:
            raise ValueError(f"DiLoCo: a parameter is {kind}; for a model FSDP2 shards inside each node pass "
                             "mesh= (the 2-D mesh of nodes x ranks per node it was sharded over); FSDP1's flat "
                             "parameters (Lightning's FSDPStrategy) are not supported: in Lightning use "
                             "strategy='diloco_fsdp'")
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, float(outer_lr), float(outer_momentum)
        self.nesterov, self.compression, self.on_nonfinite = bool(nesterov), str(wire), on_nonfinite
        self.wire, self.process_group, self.topology = wire, process_group, topology
        self.overlap, self.mixing, self.keep_local = overlap, float(mixing), bool(keep_local)
        self.offload = bool(offload)
        # outer steps in flight (overlap > 0): per fragment, the clock at which it lands, the all-reduce's
        # handle (None once done) and its result
        self._pending: dict[int, tuple[int, object, torch.Tensor]] = {}
        self.intra_node_counter = ByteCounter()  # the two-level layout's fp32 traffic inside nodes
        # per inner step: the fp32 ring all-reduce DDP would have sent (the baseline) and what was sent;
        # steps = inner steps, rounds = outer steps
        self.comm_counter = ByteCounter()
        self._wire = ByteCounter()  # what the outer step sends from this thread
        self._coded_wire = ByteCounter()  # what the compressed collectives count, on whichever thread runs them
        self.inner_steps = 0  # inner steps taken on this rank (skipped ones not counted)
        self.skipped_steps = 0
        self.outer_steps = 0
        self.fragments = fragments
        self._t = 0  # inner steps so far, skipped ones included (the schedule's clock, equal on every rank)
        self._last_sync = [0] * fragments  # the clock at each fragment's last outer step
        # flat fp32: the anchor; per fragment f: "momentum{f}", and "error{f}" (bf16)
        self._outer: dict[str, torch.Tensor] = {}
        self._means = OuterMeans(wire, group=process_group, topology=topology, overlap=overlap > 0,
                                 wire_counter=self._wire, coded_counter=self._coded_wire,
                                 intra_counter=self.intra_node_counter)
        self._spans: list[tuple[int, int, list[int]]] | None = None  # per fragment: lo, hi, tensor offsets
        self._replica_aside: torch.Tensor | None = None  # this rank's replica while the anchor is in the params
        self._scratch: torch.Tensor | None = None  # flat fp32: pseudo-gradients and Nesterov sums

    # -- steps --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One inner step; after every ``sync_every`` of them, the outer step (all ranks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_anchor()
        grads = [local(p.grad) for p in self._params() if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise ValueError("DiLoCo does not support sparse gradients")
        finite = all_finite_many(grads) if grads else torch.ones((), dtype=torch.bool,
                                                                 device=self._outer["anchor"].device)
        # the ranks of a node hold shards of one model: they take (or skip) an inner step together
        if not (bool(finite) if self.sharding is None else not self.sharding.any_in_node(~finite)):
            if self.on_nonfinite == "raise":
                raise NonFiniteGradientError(f"DiLoCo: non-finite gradient at inner step {self.inner_steps + 1}")
            self.skipped_steps += 1
        else:
            self._inner_step()
            self.inner_steps += 1
        self._t += 1
        n = group_size(self.process_group)
        self.comm_counter.add_baseline(sum(t.numel() for t in self._tensors()), n)
        landed = [f for f, (at, _, _) in self._pending.items() if at == self._t]
        if landed:
            self._land(landed)
        due = self._due(self._t)
        if due:
            self.outer_step(due, _in_step=True)
        self.comm_counter.end_step()
        self.intra_node_counter.end_step()
        return loss

    def _inner_step(self) -> None:
        """The inner optimizer's step on this rank's replica (a converted ``AdamW(fused=True)`` stays fused)."""
        inner = self._inner
        inner.param_groups, inner.state = self.param_groups, self.state  # load_state_dict replaces both
        inner.step()

    # -- the outer all-reduce (optim.diloco_allreduce) ---------------------------------------------
    @property
    def ranks_per_node(self) -> int | None:
        """Ranks per node of the two-level outer all-reduce (``None``: the launcher's ``LOCAL_WORLD_SIZE``)."""
        return self.topology.ranks_per_node

    @ranks_per_node.setter
    def ranks_per_node(self, value: int | None) -> None:
        self.topology.set(hierarchical=self.topology.hierarchical, ranks_per_node=value)

    @property
    def hierarchical(self) -> bool | None:
        return self.topology.hierarchical

    @property
    def _collectives(self) -> dict[int, object]:
        """Fragment -> its compressed collective (its error state is this rank's)."""
        return self._means.collectives

    @_collectives.setter
    def _collectives(self, value: dict[int, object]) -> None:
        self._means.collectives = value

    def two_level(self) -> int | None:
        """Ranks per node when the compressed outer all-reduce runs two-level, else None (flat)."""
        return self._means.two_level()

    def _make_collective(self, f: int):
        return self._means.make(self._fragment_spans()[f][2])

    def _average(self, delta: torch.Tensor, f: int, asynchronous: bool = False,
                 finite: torch.Tensor | None = None):
        """(the mean's flight, whether it counts its own bytes when it lands): ``delta`` overwritten."""
        error = None
        if self.wire.is_dense and self.wire.dtype != torch.float32:  # what the cast drops goes into the next
            error = self._outer.setdefault(f"error{f}", torch.zeros_like(delta))
        return self._means.start(f, delta, self._fragment_spans()[f][2], asynchronous=asynchronous,
                                 finite=finite, error=error, counter=self.comm_counter)

    @torch.no_grad()
    def outer_step(self, fragments: list[int] | None = None, _in_step: bool = False) -> None:
        """Average the pseudo-gradients of ``fragments`` and take their outer steps; every rank ends on the
        same anchor. Called by :meth:`step` on the schedule (with ``overlap``, the steps land ``overlap``
        inner steps later), and by the strategy at the end of a fit (``fragments=None``: every outer step
        in flight lands, every fragment with inner steps since its last one is synced at once, and every
        replica takes the anchor's values, mixed or not). All ranks must call it together."""
        self._ensure_anchor()
        finish = fragments is None
        if finish:
            self._land(list(self._pending))
            fragments = [f for f in range(self.fragments) if self._last_sync[f] < self._t]
            if not fragments:
                self._unflatten_into_params(self._outer["anchor"])  # mixed replicas too end on the anchor
                return
        anchor = self._outer["anchor"]
        deltas = [self._pseudo_gradient(f) for f in fragments]
        bad = torch.stack([~all_finite(d) for d in deltas]).any() if deltas else torch.zeros((), dtype=torch.bool)
        if self.sharding is not None:  # every shard of the node takes its outer step, or none does
            bad = torch.tensor(self.sharding.any_in_node(bad), device=bad.device)
        before = self._wire.total.bytes_sent
        why = (f"DiLoCo: a non-finite pseudo-gradient at outer step {self.outer_steps + 1} on some rank; "
               "no state changed")
        # the compressed collective's agreement round carries the flag (it fails on every rank before
        # any write); fp32 and bf16 have no agreement round, so they OR it first
        finite = ~bad if not self.wire.is_dense and deltas else None
        if finite is None and bool(any_across(bad.reshape(1), self.process_group, self._wire)[0]):
            raise NonFiniteGradientError(why)
        delay = 0 if finish else self.overlap
        threaded = 0  # outer all-reduces sent to the sender thread: they count their bytes when they land
        for f, delta in zip(fragments, deltas, strict=True):
            try:  # every call carries the flag: an asynchronous one fails only when it lands
                flight, counts_itself = self._average(delta, f, asynchronous=delay > 0, finite=finite)
            except NonFiniteInputError as exc:
                raise NonFiniteGradientError(why) from exc
            except RuntimeError as exc:
                raise self._lost(f, self._t, exc) from exc
            threaded += counts_itself
            self._pending[f] = (self._t + delay, flight, flight.result)
            self._last_sync[f] = self._t
        if delay == 0:
            self._land(fragments)
        if finish:
            self._unflatten_into_params(anchor)
        self.outer_steps += 1
        if threaded < len(fragments):
            self.comm_counter.add(self._wire.total.bytes_sent - before, 0, group_size(self.process_group))
        if not _in_step:
            self.comm_counter.end_round()

    def _land(self, fragments: list[int]) -> None:
        """The outer steps of ``fragments`` (in flight) on the anchor, and the anchor into the replica
        (mixed with it when ``mixing`` > 0, or with the replica's inner steps since it was sent:
        ``keep_local``)."""
        anchor, spans = self._outer["anchor"], self._fragment_spans()
        mixed = self._flat() if self.mixing or self.keep_local else anchor
        for f in sorted(fragments):
            at, work, delta = self._pending.pop(f)
            if work is not None:
                try:
                    work.wait()
                except NonFiniteInputError as exc:  # on every rank, before this fragment's outer step
                    raise NonFiniteGradientError(f"DiLoCo: a non-finite pseudo-gradient on some rank in the outer "
                                                 f"step of fragment {f} sent after inner step {at - self.overlap}; "
                                                 "it is not applied") from exc
                except RuntimeError as exc:  # gloo's and NCCL's errors; its outer step is not applied
                    raise self._lost(f, at - self.overlap, exc) from exc
            lo, hi, _ = spans[f]
            key = f"momentum{f}"
            self._outer[key] = outer_nesterov_(anchor[lo:hi], delta.float(), self._outer.get(key), lr=self.outer_lr,
                                               momentum=self.outer_momentum, nesterov=self.nesterov,
                                               scratch=self._span_of_scratch(f))
            if self.mixing:
                mixed[lo:hi].mul_(self.mixing).add_(anchor[lo:hi], alpha=1 - self.mixing)
            elif self.keep_local:
                mixed[lo:hi].sub_(self._outer[f"sent{f}"]).add_(anchor[lo:hi])
            self._unflatten_into_params(mixed, lo, hi)

    @staticmethod
    def _lost(f: int, sent_after: int, exc: RuntimeError) -> CollectiveError:
        return CollectiveError.lost(f"DiLoCo: the outer all-reduce of fragment {f}, sent after inner step "
                                    f"{sent_after}, failed", exc, ". Its outer step is not applied")

    # -- conversion, the anchor, the end of an interval ---------------------------------------------
    @classmethod
    def from_optimizer(cls, opt: torch.optim.Optimizer, **kwargs) -> DiLoCo:
        """A DiLoCo with an inner AdamW over ``opt``'s parameter groups with its hyperparameters (every key of a
        group, also those an LR scheduler added, is kept). ``opt``: ``torch.optim.AdamW``, or ``Adam`` without
        weight decay (Adam's is L2, not decoupled). For another inner optimizer build
        ``DiLoCo(params, inner=..., inner_kwargs=...)`` itself."""
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            raise ValueError(f"DiLoCo converts an AdamW; cannot convert {type(opt).__name__} (for another inner "
                             f"optimizer return DiLoCo(params, inner=torch.optim.{type(opt).__name__}, "
                             "inner_kwargs=...) from configure_optimizers)")
        for g in opt.param_groups:
            if type(opt) is torch.optim.Adam and g["weight_decay"] and not g.get("decoupled_weight_decay"):
                raise ValueError("Adam's weight_decay is L2 regularisation, which DiLoCo's AdamW does not run; "
                                 "return torch.optim.AdamW (decoupled weight decay) instead")
        d = opt.defaults
        new = cls([dict(g) for g in opt.param_groups], lr=d["lr"], betas=d["betas"], eps=d["eps"],
                  weight_decay=d["weight_decay"], **kwargs)
        for p, st in opt.state.items():  # a resumed AdamW's moments, if any
            new.state[p] = dict(st)
        return new

    @property
    def compressing(self) -> bool:
        """Always: DiLoCo has no uncompressed warm-up (``CommunicationMonitor``'s phase)."""
        return True

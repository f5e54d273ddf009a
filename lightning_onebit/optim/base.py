"""The algorithm base of the compressed optimizers: phases, the synchronisation of a bucket, the
step (checkpoints: :mod:`.checkpointing`; the DDP hook path: :mod:`.ddp`; buckets: :mod:`.buckets`).
Every compressed optimizer here works the same way (docs/design.md, "Data flow of one bucket"):

* Parameters live in fixed **buckets** with flat fp32 state (:mod:`.buckets`); the collective
  gives every parameter tensor of a bucket scales of its own.
* **Warm-up** (``step <= warmup_steps`` and no external switch): the gradient is averaged
  in full precision (by DDP's allreduce when a DDP model is attached, else by ``step()``
  itself) and the warm-up rule (AdamW, LAMB) runs, with per-parameter step counts as
  ``torch.optim.AdamW`` keeps them.
* **Compression**: per bucket, the subclass forms the local payload (momentum or gradient),
  a :class:`~lightning_onebit.comm.CompressedAllreduce` synchronises it and the subclass
  absorbs the result into its state. With DDP this happens in the communication hook
  during backward (:mod:`.ddp`); otherwise in ``step()``, so the algorithm, compression error
  included, is the same in one process as in many.
* ``simulate_workers=n`` runs n workers in one process (``step_workers``): the same
  buckets and kernels through :class:`~lightning_onebit.comm.SimulatedCluster`.

A parameter with no gradient on any rank is skipped as torch's optimizers skip it: not moved,
its step count, moments and compression state unchanged. A param group added with
``add_param_group`` gets buckets of its own; added after the switch of a warm-up algorithm,
it runs its own exact warm-up (as long as the optimizer's was) before it compresses, because
its variance has not been estimated yet.

A subclass describes itself with class attributes (``strategy_name``, ``has_warmup``,
``comm_mode``, ``flat_state``, ``from_adam``) and defines the codec, the payload, how the
result is absorbed, and the two update rules. The optimizer never calls torch.distributed
directly; it goes through the comm layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..comm import (
    ByteCounter,
    CompressedAllreduce,
    HierarchicalAllreduce,
    SimulatedCluster,
    SimulatedHierarchicalCluster,
    all_finite,
    any_across,
    group_size,
    mean_allreduce,
    node_groups,
    ring_allreduce_bytes,
)
from ..compress import Codec, flat_buffer
from ..compress.kernels import apply_thread_budget
from ..compress.source import Source
from .buckets import Bucket, BucketState, _simulated_mean
from .checkpointing import OptimizerCheckpoint
from .ddp import DDPHookPath
from .functional import decoupled_update_

log = logging.getLogger(__name__)

__all__ = ["CollectiveError", "CompressedOptimizer", "NonFiniteGradientError"]


def _thread_budget_from_launcher() -> None:
    """Under torchrun (``LOCAL_WORLD_SIZE`` set), the ranks on this host share its cores: give the
    kernels their share, as the strategies do (logged once, by local rank 0)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        msg = apply_thread_budget(int(local))
        if msg and os.environ.get("LOCAL_RANK", "0") == "0":
            log.info(msg)


class NonFiniteGradientError(ValueError):
    """A gradient contained NaN/inf on some rank; every rank raises at the same step. Parameters and
    moments are untouched; in the DDP hook path with the policy "raise", buckets synchronised earlier
    in that backward have already updated their error state (the policy "skip" checks first)."""


class CollectiveError(RuntimeError):
    """A collective of the optimizer failed (another rank died, stalled past the process group's
    timeout, or the network broke); the message names the collective, the bucket and the step."""


def check_nonfinite_policy(policy: str, max_consecutive: int) -> None:
    """Validate an ``on_nonfinite`` policy and its bound (the optimizers' and the strategies')."""
    if policy not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {policy!r}")
    if not isinstance(max_consecutive, int) or max_consecutive < 1:
        raise ValueError(f"max_consecutive must be a positive int, got {max_consecutive!r}")


def check_hyperparameters(*, lr: float | None = None, betas: Sequence[float] | None = None,
                          **non_negative: float | None) -> None:
    """The argument checks the optimizers share: ``lr >= 0``, betas a pair in [0, 1), and every other
    keyword (eps, nu, weight_decay, ...) non-negative. Raises ``ValueError`` naming the argument."""
    if lr is not None and not lr >= 0:
        raise ValueError(f"invalid learning rate {lr!r}: it must be >= 0")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"invalid betas {tuple(betas)!r}: two values in [0, 1)")
    for name, value in non_negative.items():
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be non-negative, got {value!r}")


_ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW)


def _is_lamb(opt: Optimizer) -> bool:
    return "lamb" in type(opt).__name__.lower()


class CompressedOptimizer(BucketState, DDPHookPath, OptimizerCheckpoint, Optimizer):
    """Base class. Subclasses define the flat state, the payload, and the update rules."""

    #: the Lightning strategy name this optimizer registers under (``None``: an abstract base)
    strategy_name: ClassVar[str | None] = None
    #: names of per-parameter fp32 state kept in flat bucket buffers
    flat_state: tuple[str, ...] = ()
    #: the algorithm has an uncompressed warm-up (1-bit Adam, 1-bit LAMB, QAdam)
    has_warmup: ClassVar[bool] = True
    #: how the collective treats its state: "plain", "error_feedback" or "markov"
    comm_mode: str = "error_feedback"
    #: Adam's hyperparameters (torch.optim.Adam/AdamW names) -> this optimizer's names, for
    #: :meth:`from_optimizer`; Adam's that are missing here are not carried over
    from_adam: ClassVar[dict[str, str]] = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
    #: besides Adam and AdamW, a LAMB optimizer converts to this one
    converts_lamb: ClassVar[bool] = False
    #: the ranks take local steps, so their replicas differ between rounds (see sync_replicas)
    has_local_steps: ClassVar[bool] = False
    #: a NaN/inf gradient always makes the payload non-finite, so the collective's own check (its
    #: scale reduction, on every rank) finds it and no extra pass over the gradient is needed
    payload_shows_nonfinite: ClassVar[bool] = True

    _registry: ClassVar[dict[str, type[CompressedOptimizer]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        name = cls.__dict__.get("strategy_name")
        if name is not None:
            if name in CompressedOptimizer._registry:
                raise ValueError(f"strategy name {name!r} is taken by {CompressedOptimizer._registry[name].__name__}")
            CompressedOptimizer._registry[name] = cls

    @staticmethod
    def algorithms() -> dict[str, type[CompressedOptimizer]]:
        """Strategy name -> optimizer class, for every optimizer that names its strategy."""
        return dict(CompressedOptimizer._registry)

    @classmethod
    def from_optimizer(cls, opt: Optimizer, **overrides: Any) -> CompressedOptimizer:
        """This optimizer over ``opt``'s parameter groups with its hyperparameters (``from_adam``
        maps the names; ``overrides`` are further keyword arguments). Warm-up algorithms get
        ``warmup_steps=None`` unless overridden: a phase switch (e.g. the callback) decides."""
        what = f"{cls.__name__}.from_optimizer"
        if not (isinstance(opt, _ADAM_LIKE) or (cls.converts_lamb and _is_lamb(opt))):
            raise ValueError(
                f"{what} needs an Adam-family optimizer: torch.optim.AdamW (or Adam"
                f"{', or a LAMB' if cls.converts_lamb else ''}); got {type(opt).__name__}")
        d = opt.defaults
        if d.get("amsgrad"):
            raise ValueError(f"{what}: Adam(amsgrad=True) cannot be converted; use CDAdam (AMSGrad) or amsgrad=False")
        decoupled = isinstance(opt, torch.optim.AdamW) or d.get("decoupled_weight_decay", False) or _is_lamb(opt)
        if any(g.get("weight_decay", 0) for g in opt.param_groups) and not decoupled:
            raise ValueError(f"{what}: torch.optim.Adam with weight_decay is L2-regularised Adam, which the "
                             "compressed optimizers do not implement; use torch.optim.AdamW (decoupled)")
        kw = {mine: d[theirs] for theirs, mine in cls.from_adam.items() if theirs in d}
        if cls.has_warmup:
            kw["warmup_steps"] = None
        kw.update(overrides)
        groups = []
        for g in opt.param_groups:
            ng = {k: g[k] for k in ("params", "initial_lr") if k in g}
            ng.update({mine: g[theirs] for theirs, mine in cls.from_adam.items() if theirs in g})
            groups.append(ng)
        new = cls(groups, **kw)
        # keys an LR scheduler added to the groups (initial_lr; OneCycleLR's max_lr, min_lr,
        # base_momentum, max_momentum; ...): the scheduler reads them from its optimizer's groups
        for g_old, g_new in zip(opt.param_groups, new.param_groups, strict=True):
            for k, v in g_old.items():
                if k != "params" and k not in opt.defaults and k not in g_new:
                    g_new[k] = v
        return new

    @classmethod
    def conversion_advice(cls, opt: Optimizer) -> str | None:
        """What a user should know when ``opt`` (an Adam, AdamW or LAMB) is converted to this
        algorithm with its hyperparameters (``None``: nothing; the strategies warn with it)."""
        return None

    def __init__(self, params: Iterable, defaults: dict, *, warmup_steps: int | None,
                 bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None,
                 simulate_workers: int | None = None) -> None:
        super().__init__(params, defaults)
        if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
            raise ValueError(f"warmup_steps must be a non-negative int or None, got {warmup_steps!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if simulate_workers is not None and simulate_workers < 1:
            raise ValueError(f"simulate_workers must be >= 1, got {simulate_workers}")
        self.warmup_steps = warmup_steps
        self.bucket_cap_mb = bucket_cap_mb
        self.process_group = group
        self.simulate_workers = simulate_workers
        _thread_budget_from_launcher()
        self.comm_counter = ByteCounter()
        self._step = 0
        self._compressing = not self.has_warmup
        self._switch_at: int | None = None  # optimizer steps taken when the compression phase began
        self._buckets: list[Bucket] = []
        self._nbucketed = 0  # param groups that have buckets
        self._param_bucket: dict[int, tuple[Bucket, int]] = {}
        self._ddp_attached = False
        self._ddp_params: set[int] = set()
        self._ddp_find_unused = False
        #: with DDP, synchronise in step() instead of the backward hook (fp16 + GradScaler:
        #: the hook would see scaled gradients; also lets clipping act before compression)
        self.defer_sync_to_step = False
        #: two-level collective (fp32 inside a node, compressed between nodes): None = automatic,
        #: on with several nodes of several ranks each; see set_topology
        self.hierarchical: bool | None = None
        self.ranks_per_node: int | None = None  # None: the launcher's LOCAL_WORLD_SIZE
        self._node_groups: tuple | None = None
        #: fp32 bytes inside the node of the two-level collective (comm_counter: between nodes)
        self.intra_node_counter = ByteCounter()
        self.on_nonfinite = "raise"  # see set_nonfinite_policy
        self.max_consecutive_skips = 10
        self.skipped_steps = 0  #: steps skipped for a non-finite gradient (policy "skip")
        self._skip_run: list[int] = []  # optimizer steps of the current run of skips

    def set_nonfinite_policy(self, policy: str = "raise", *, max_consecutive: int = 10) -> None:
        """What a NaN/inf gradient on any rank does: ``"raise"`` :class:`NonFiniteGradientError` on every
        rank, or ``"skip"`` the step on every rank - no parameter, moment or error state changes, the skip
        is counted (``skipped_steps``) and logged - until ``max_consecutive`` steps in a row were skipped,
        which raises with their step numbers. "skip" checks every gradient before the first collective
        (one tiny OR across ranks per step), so with DDP the compressed sync moves from the backward hook
        to ``step()`` (``defer_sync_to_step``), as GradScaler needs too."""
        check_nonfinite_policy(policy, max_consecutive)
        self.on_nonfinite, self.max_consecutive_skips = policy, max_consecutive
        if policy == "skip":
            self.defer_sync_to_step = True

    def set_topology(self, *, hierarchical: bool | None = None, ranks_per_node: int | None = None) -> None:
        """Choose the flat or the two-level collective before the first compressed step.

        ``hierarchical=None`` (automatic) uses the two-level one when the default group spans several
        nodes of several ranks each; ``ranks_per_node`` defaults to the launcher's ``LOCAL_WORLD_SIZE``
        (ranks laid out ``node * ranks_per_node + local_rank``, as torchrun and Lightning lay them out).
        A layout whose ranks per node do not divide the world size falls back to flat, logged."""
        if (hierarchical, ranks_per_node) == (self.hierarchical, self.ranks_per_node):
            return
        if any(b.comm is not None for b in self._buckets):
            raise RuntimeError(f"{type(self).__name__}.set_topology: the collectives exist already; call it "
                               "before the first compressed step (or before loading a state_dict)")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")
        self.hierarchical, self.ranks_per_node = hierarchical, ranks_per_node

    def _groups_of_nodes(self, ranks_per_node: int) -> tuple:
        """(node group, cross-node group) of this rank, created once (creation is collective)."""
        if self._node_groups is None:
            self._node_groups = node_groups(ranks_per_node)
        return self._node_groups

    def _ranks_per_node(self) -> int | None:
        """Ranks per node when buckets use the two-level collective, else None (flat)."""
        if self.hierarchical is False:
            return None
        local = self.ranks_per_node
        if local is None and self.simulate_workers is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None
        n = self.world_size
        why = None
        if self.simulate_workers is None and not _spans_the_world(self.process_group):
            why = "it runs on a group of every rank only (node groups are cut from the default group)"
        elif local is None:
            why = "the ranks per node are unknown (set_topology(ranks_per_node=...) or LOCAL_WORLD_SIZE)"
        elif n % local:
            why = f"{local} ranks per node do not divide the world size {n}"
        elif self.hierarchical is None and (local == 1 or local == n):
            return None  # one node, or one rank per node: nothing to gain
        if why is not None:
            if self.hierarchical:
                log.warning(f"{type(self).__name__}: the two-level collective falls back to flat: {why}")
            return None
        return local

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does). Its parameters get buckets of their own at the next step;
        after the switch of a warm-up algorithm they warm up on their own first (see the module
        docstring)."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.is_sparse or p.is_complex():
                raise ValueError(f"{type(self).__name__} supports dense real parameters only")

    # -- phases --------------------------------------------------------------------------
    @property
    def optimizer_steps(self) -> int:
        """Steps this optimizer has taken (skipped ones not counted)."""
        return self._step

    @property
    def compressing(self) -> bool:
        """True once the compression phase has started (it never goes back)."""
        return self._compressing

    def start_compression(self) -> None:
        """Compress from the next synchronisation on (the public switch callbacks use)."""
        if self._compressing:
            return
        if self._step == 0:
            raise RuntimeError(f"{type(self).__name__} needs at least one warm-up step to estimate the "
                               "variance before compression starts (warmup_steps >= 1)")
        self._compressing = True
        self._switch_at = self._step
        self._on_start_compression()
        for b in self._buckets:
            if b.switch_step is None:
                self._switch_bucket(b)

    def _update_phase(self) -> None:
        """Switch what is due before the next step's synchronisation (idempotent within a step)."""
        if not self._compressing and self.warmup_steps is not None and self._step + 1 > self.warmup_steps:
            self.start_compression()
        for b in self._buckets:
            if not b.compressing and b.switch_step is not None and self._step >= b.switch_step:
                self._switch_bucket(b)

    def _switch_bucket(self, b: Bucket) -> None:
        b.compressing = True
        b.cache.clear()
        for p in b.params:
            st = self.state[p]
            st["frozen_step"] = st.get("step", 0)
        self._on_switch(b)

    # -- replicas ------------------------------------------------------------------------
    def sync_replicas(self) -> bool:
        """Make every rank hold the same model now; True if that took communication.

        Every algorithm here keeps the replicas identical after each step, so this does nothing;
        one with local steps (:class:`~lightning_onebit.optim.ZeroOneAdam`) synchronises what the
        ranks did since their last round. The strategies call it on every rank before
        validation, before a checkpoint is taken and at the end of fit. Collective: call it on
        every rank at the same point."""
        return False

    def set_total_steps(self, total_steps: int) -> None:
        """Tell the optimizer how many steps the run has (the strategies pass Lightning's
        ``estimated_stepping_batches``): schedules given as fractions of the run resolve here."""

    def worker_parameters(self, worker: int) -> contextlib.AbstractContextManager:
        """Simulated cluster: a context in which the parameters hold simulated ``worker``'s copy, for
        computing its gradient. Here all workers share one copy; algorithms whose workers take
        local steps (``ZeroOneAdam``) swap theirs in."""
        if self.simulate_workers is None or not 0 <= worker < self.simulate_workers:
            raise ValueError(f"worker must be in [0, {self.simulate_workers}) on a simulated cluster, got {worker!r}")
        return contextlib.nullcontext()

    def _on_start_compression(self) -> None:
        """Hook for subclasses: called once when the optimizer's compression phase begins."""

    def _on_switch(self, b: Bucket) -> None:
        """Hook for subclasses: freeze the variance etc. of bucket ``b``, before its first compressed sync."""

    # -- layout --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        if self.simulate_workers is not None:
            return self.simulate_workers
        return group_size(self.process_group)

    # -- gradients -----------------------------------------------------------------------
    def _check_finite(self, t: torch.Tensor | Sequence[torch.Tensor], what: str) -> None:
        # a sum is one cheap reduction and is non-finite whenever an element is (or it overflows:
        # then the element-wise check decides); isfinite(t).all() writes a bool per element
        ts = [t] if isinstance(t, torch.Tensor) else list(t)
        if not ts or bool(torch.isfinite(torch.stack([x.sum() for x in ts]).sum())):
            return
        if not all(bool(torch.isfinite(x).all()) for x in ts):
            raise NonFiniteGradientError(
                f"{type(self).__name__}: the {what} contains NaN or inf; the step was skipped on every "
                "rank and no optimizer state was changed (lower the learning rate, use gradient "
                "clipping, or a GradScaler with fp16)"
            )

    def _average_warmup(self, b: Bucket, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Full-precision mean gradient of a bucket (fp32), exactly as DDP would compute it."""
        if worker_grads is not None:  # simulation: (g_0 / n) + (g_1 / n) + ... in worker order
            _simulated_mean(worker_grads, out=b.grad, scratch=b.worker_buffers("quotient", 1)[0])
            n = len(worker_grads)  # counted as the real path counts its fp32 allreduce
            self.comm_counter.add(ring_allreduce_bytes(b.numel, n), b.numel, n)
        elif not b.via_ddp:
            with self._collective("fp32 allreduce (warm-up)", b):
                mean_allreduce(b.grad, self.process_group, self.comm_counter)
        return b.grad

    @contextlib.contextmanager
    def _collective(self, what: str, b: Bucket | None = None) -> Iterator[None]:
        """Name the collective, bucket and step in a failure of the process group (a rank that died
        fails its peers' next collective at once, one that stalls after the group's timeout)."""
        try:
            yield
        except (ValueError, CollectiveError):  # agreement mismatches and non-finite inputs say it already
            raise
        except RuntimeError as exc:
            where = "" if b is None else f" of bucket {self._buckets.index(b)} ({b.numel} elements)"
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            raise CollectiveError(
                f"{type(self).__name__}: the {what}{where} failed at optimizer step {self._step + 1} on rank "
                f"{rank}: {exc}. Another rank has probably died or stalled; the process group's timeout bounds "
                "the wait") from exc

    # -- the compressed synchronisation of one bucket ------------------------------------
    def _make_codec(self, b: Bucket) -> Codec:
        raise NotImplementedError

    def _comm_for(self, b: Bucket):
        if b.comm is None:
            codec = self._make_codec(b)
            # groups: one scale never spans two parameter tensors of the bucket
            if self.simulate_workers is not None and (local := self._ranks_per_node()) is not None:
                b.comm = SimulatedHierarchicalCluster(codec, self.comm_mode, self.simulate_workers // local, local,
                                                      counter=self.comm_counter,
                                                      intra_counter=self.intra_node_counter, groups=b.offsets)
            elif self.simulate_workers is not None:
                b.comm = SimulatedCluster(codec, self.comm_mode, self.simulate_workers, counter=self.comm_counter,
                                          groups=b.offsets)
            elif (local := self._ranks_per_node()) is not None:
                lg, cg = self._groups_of_nodes(local)
                b.comm = HierarchicalAllreduce(codec, self.comm_mode, local_group=lg, cross_group=cg,
                                               counter=self.comm_counter, intra_counter=self.intra_node_counter,
                                               groups=b.offsets)
            else:
                # verify="always": the per-call agreement is also how every rank learns that
                # some rank's gradient was not finite, so they all skip the step together
                b.comm = CompressedAllreduce(codec, self.comm_mode, group=self.process_group,
                                             counter=self.comm_counter, verify="always", groups=b.offsets)
            b.comm.bind(b.numel, b.device)  # state exists before the first sync (see _snapshot)
        return b.comm

    #: the payload reads the gradients where they are (a Source over the parameters' ``.grad``), so the
    #: compression phase copies no gradient into the bucket (outside DDP's hook)
    payload_reads_grads: ClassVar[bool] = False

    def _payload(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None],
                 out: torch.Tensor) -> Source | None:
        """The local quantity to synchronise, from the local gradient (``b.grad``-like and flat, or one
        tensor per parameter where ``payload_reads_grads``): a :class:`~..compress.source.Source` the
        codec evaluates where it reads it, or ``None`` after writing it (fp32) to ``out``, which also
        serves as the buffer a Source is materialised into by a backend that cannot read it."""
        raise NotImplementedError

    def _sync_target(self, b: Bucket) -> torch.Tensor:
        """Where the collective writes its result. The collective writes only after every rank
        agreed the inputs are finite, so a state buffer may be the target directly (one full
        copy per step less); a failed call leaves it untouched."""
        return b.synced

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        """Fold the synchronised quantity into the bucket's state (e.g. momentum <- synced)."""

    def _flag(self, b: Bucket, grad: torch.Tensor | Sequence[torch.Tensor | None]) -> bool | None:
        """A bit the collective agrees on at no cost (OR over ranks), e.g. "a gradient reached a
        coordinate the optimizer masks"; ``None``: no flag."""
        return None

    def _on_flag(self, b: Bucket, grads: Sequence, simulated: bool) -> None:
        """Called on every rank when some rank's flag was set (``grads``: the local gradient, or with
        ``simulated`` every simulated worker's; each flat, or one tensor per parameter)."""

    def _sync_bucket(self, b: Bucket, worker_grads: Sequence | None = None,
                     grad: torch.Tensor | Sequence[torch.Tensor | None] | None = None) -> None:
        """The compressed synchronisation of ``b``: this rank's gradient (``b.grad``, or ``grad``: one
        tensor per parameter), or every simulated worker's (``worker_grads``, flat or per parameter)."""
        comm = self._comm_for(b)
        target = self._sync_target(b)
        if worker_grads is not None:
            payloads = []
            for g, out in zip(worker_grads, b.worker_buffers("payload", len(worker_grads)), strict=True):
                src = self._payload(b, g, out)
                payloads.append(out if src is None else src)
            flags = [self._flag(b, g) for g in worker_grads]
            try:
                comm.allreduce_into(payloads, target, flags=None if flags[0] is None else flags, **self._defer_kw(b))
            except ValueError as exc:
                raise NonFiniteGradientError(str(exc)) from exc
            grads: Sequence = worker_grads
        else:
            grads = b.grad if grad is None else grad
            if b.payload is None:
                b.payload = flat_buffer(b.numel, device=b.device, zero=False)
            src = self._payload(b, grads, b.payload)
            try:
                with self._collective(f"compressed allreduce ({type(comm).__name__})", b):
                    comm(b.payload if src is None else src, out=target, flag=self._flag(b, grads), **self._defer_kw(b))
            except ValueError as exc:
                if "not finite" in str(exc):
                    raise NonFiniteGradientError(
                        f"{type(self).__name__}: {exc}. Lower the learning rate or clip gradients.") from exc
                raise
        if not getattr(comm, "pending", False):  # a deferred result is absorbed by the update
            self._absorb(b, target)
        if comm.any_flag:
            self._on_flag(b, grads, simulated=worker_grads is not None)
        b.done = True

    #: the update decodes the synchronised result itself (``_update_compressed`` calls the collective's
    #: ``decode_pending``), so that the decode and the parameter update are one pass over the bucket
    decodes_in_update: ClassVar[bool] = False

    def _defer_kw(self, b: Bucket) -> dict:
        """Ask the collective to leave its decode to the update, where the subclass does that and the
        collective can (not the two-level one, whose result is an fp32 sum)."""
        if self.decodes_in_update and hasattr(b.comm, "decode_pending") and self._sink_targets(b) is not None:
            return {"defer": True}
        return {}

    @staticmethod
    def _sink_targets(b: Bucket) -> list[torch.Tensor] | None:
        """The bucket's parameters as a decode sink updates them (contiguous fp32), else None."""
        ps = [p.detach() for p in b.params]
        return ps if all(p.dtype == torch.float32 and p.is_contiguous() for p in ps) else None

    def _flush_pending(self) -> None:
        """Decode every result a bucket left for its update (before anything reads the state)."""
        for b in self._buckets:
            if b.comm is not None and getattr(b.comm, "pending", False):
                b.comm.decode_pending()
                self._absorb(b, self._sync_target(b))

    # -- DDP ---------------------------------------------------------------------------
    # -- updates (subclasses) ------------------------------------------------------------
    def _update_warmup(self, b: Bucket, grad: torch.Tensor | list[torch.Tensor], group: dict,
                       has_grad: list[bool]) -> None:
        """The warm-up rule on the averaged gradient: the bucket's flat one, or the list
        :meth:`_warmup_on_own_grads` returned (one per parameter with a gradient)."""
        raise NotImplementedError

    def _warmup_on_own_grads(self, b: Bucket, has_grad: list[bool]) -> list[torch.Tensor] | None:
        """The averaged gradients of the parameters with one, if the warm-up rule can read them where
        they are (no copy into the bucket); ``None``: copy them (the default)."""
        return None

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        raise NotImplementedError

    def _apply(self, b: Bucket, update: torch.Tensor, group: dict, has_grad: list[bool],
               decoupled_wd: float = 0.0, step_size: float | Sequence[float] | None = None,
               denom: torch.Tensor | None = None, params: Sequence[torch.Tensor] | None = None) -> None:
        """p <- p * (1 - lr * wd) - step_size * update [/ denom] (step_size defaults to lr; a
        sequence gives one per parameter of the bucket), for the params that had a gradient.
        With ``denom`` the division is fused like ``torch.optim.AdamW``'s ``addcdiv_``, which
        rounds differently from a division followed by an add. ``params``: other tensors of the
        bucket's shapes to update instead (a simulated worker's own copy)."""
        lr = group["lr"]
        step_size = lr if step_size is None else step_size
        keep = [i for i, h in enumerate(has_grad) if h]
        if not keep:
            return
        params = [(b.params if params is None else params)[i] for i in keep]
        ups = [b.views(update)[i] for i in keep]
        dens = [b.views(denom)[i] for i in keep] if denom is not None else None
        sizes = [step_size] * len(keep) if isinstance(step_size, float | int) else [step_size[i] for i in keep]
        decoupled_update_(params, ups, dens, sizes, lr=lr, weight_decay=decoupled_wd)

    # -- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimisation step (synchronising first, unless a DDP hook already did)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.simulate_workers is not None:
            raise RuntimeError("with simulate_workers, call step_workers(grads) instead of step()")
        self._run_step(None)
        return loss

    @torch.no_grad()
    def step_workers(self, grads: Sequence[Sequence[torch.Tensor | None]]) -> None:
        """Simulated cluster: one step with ``grads[w][i]`` = worker w's gradient of
        ``params_in_order()[i]`` (all workers share the parameters and synced state)."""
        if self.simulate_workers is None:
            raise RuntimeError("step_workers needs simulate_workers=n at construction")
        if len(grads) != self.simulate_workers:
            raise ValueError(f"expected gradients of {self.simulate_workers} workers, got {len(grads)}")
        self._run_step(grads)

    def _has_grad(self, buckets: list[Bucket], worker_grads) -> list[list[bool]]:
        """Which parameters of each bucket have a gradient on some rank (or simulated worker)."""
        if worker_grads is not None:
            return [[any(wg[i] is not None for wg in worker_grads) for i in b.ids] for b in buckets]
        has = [[p.grad is not None for p in b.params] for b in buckets]
        # DDP leaves grad None on every rank for a parameter no rank used; others must agree here
        local = [i for i, b in enumerate(buckets) if not b.via_ddp]
        if local and self.world_size > 1:
            flags = torch.tensor([h for i in local for h in has[i]], dtype=torch.bool)
            with self._collective("agreement on which parameters have gradients"):
                agreed = any_across(flags, self.process_group).tolist()
            for i in local:
                has[i], agreed = agreed[: len(has[i])], agreed[len(has[i]) :]
        return has

    def _nonfinite_anywhere(self, buckets: list[Bucket], worker_grads) -> bool:
        """Does any rank (or simulated worker) hold a NaN/inf gradient? One OR across ranks."""
        if worker_grads is not None:
            grads = [g for w in worker_grads for g in w if g is not None]
        else:
            grads = [p.grad for b in buckets for p in b.params if p.grad is not None]
        # the flags stay on the device until the one host read below (no sync per tensor on a GPU)
        if grads:
            bad = ~torch.stack([all_finite(g) for g in grads]).all().reshape(1)
        else:
            bad = torch.zeros(1, dtype=torch.bool, device=buckets[0].device if buckets else "cpu")
        if worker_grads is None and self.world_size > 1:
            with self._collective("agreement on finite gradients"):
                bad = any_across(bad, self.process_group)
        return bool(bad[0])

    def _skip_step(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            b.done, b.ready, b.pending = False, 0, []
        self.skipped_steps += 1
        self._skip_run.append(self._step + 1)
        if len(self._skip_run) >= self.max_consecutive_skips:
            steps, self._skip_run = self._skip_run, []
            raise NonFiniteGradientError(
                f"{type(self).__name__}: {len(steps)} consecutive steps had a NaN/inf gradient on some rank and "
                f"were skipped (optimizer steps {steps}); lower the learning rate, clip gradients, or check the data")
        log.warning(f"{type(self).__name__}: a gradient contains NaN or inf on some rank; optimizer step "
                    f"{self._step + 1} skipped on every rank, no state changed ({self.skipped_steps} skipped so far)")

    def _run_step(self, worker_grads) -> None:
        buckets = self._build_buckets()
        self._update_phase()
        if self.on_nonfinite == "skip" and self._nonfinite_anywhere(buckets, worker_grads):
            self._skip_step(buckets)
            return
        self._skip_run = []
        try:
            plan = self._synchronise(buckets, worker_grads)
        except BaseException:
            for b in buckets:  # the next step starts from scratch (the hook's work included)
                b.done, b.ready, b.pending = False, 0, []
                if b.comm is not None and getattr(b.comm, "pending", False):
                    b.comm.discard_pending()
            raise
        # Pass 2: updates.
        self._step += 1
        for b, has, grad, saved in plan:
            b.done, b.ready, b.pending = False, 0, []
            if not any(has):
                continue
            for p, h in zip(b.params, has, strict=True):
                if h:
                    self.state[p]["step"] = self.state[p].get("step", 0) + 1
            group = self.param_groups[b.group_index]
            if b.compressing:
                self._update_compressed(b, group, has)
            else:
                self._update_warmup(b, grad, group, has)
            self._restore(saved)
        self.comm_counter.end_step()
        self.intra_node_counter.end_step()

    def _synchronise(self, buckets: list[Bucket], worker_grads) -> list[tuple]:
        """Pass 1 of a step: every bucket's gradient synchronised (a NaN anywhere raises before any
        update); returns (bucket, has_grad, averaged warm-up gradient, state to put back) per bucket."""
        has_all = self._has_grad(buckets, worker_grads)
        plan = []
        for b, has in zip(buckets, has_all, strict=True):
            # a compressed sync whose payload reads the gradients where they are copies none of them
            in_place = (b.compressing and self.payload_reads_grads and not b.done
                        and not (b.via_ddp and b.ready))
            wflat = None
            if worker_grads is not None:
                wflat = ([[wg[i] for i in b.ids] for wg in worker_grads] if in_place
                         else self._worker_flat(b, worker_grads))
            own = self._own_grads(b) if in_place and wflat is None else None
            # a warm-up whose gradient is averaged already (one rank, or DDP's allreduce) may run on
            # the parameters' own gradients: no copy into the bucket
            direct = None
            if wflat is None and not b.compressing and (b.via_ddp or self.world_size == 1) and any(has):
                direct = self._warmup_on_own_grads(b, has)
            if (wflat is None and direct is None and own is None and not b.done
                    and not (b.via_ddp and b.compressing and b.ready)):
                self._gather_grads(b)
            skipped = [i for i, h in enumerate(has) if not h]
            grad, saved = None, []
            if not any(has):
                pass
            elif b.compressing:
                if b.done:  # synchronised in the DDP hook, which kept the state of locally unused params
                    saved = [s for s in b.pending if not has[s[0]]]
                else:
                    if wflat is None and self.world_size == 1 and not self.payload_shows_nonfinite:
                        # else the collective's scale check sees it
                        self._check_finite([g for g in own if g is not None] if own is not None else b.grad,
                                           "gradient")
                    saved = self._snapshot(b, skipped)
                    self._sync_bucket(b, wflat, own)
            elif direct is not None:
                self._check_finite(direct, "averaged gradient")
                grad = direct
            else:
                saved = self._snapshot(b, skipped)
                grad = self._average_warmup(b, wflat)
                self._check_finite(grad, "averaged gradient")
            plan.append((b, has, grad, saved))
        return plan

def _spans_the_world(group) -> bool:
    """``group`` holds every rank in rank order (the default group, or DDP's handle of it)."""
    if group is None:
        return True
    return dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))

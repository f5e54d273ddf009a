"""The algorithm base of the compressed optimizers: phases and the step. Its parts have modules of
their own: buckets (:mod:`.buckets`), the compressed sync of a bucket (:mod:`.sync`), non-finite
gradients (:mod:`.nonfinite`), the DDP hook path (:mod:`.ddp`), checkpoints (:mod:`.checkpointing`),
converting a user's AdamW (:mod:`.conversion`) and the update rules (:mod:`.functional`).
Every compressed optimizer here works the same way (docs/design/dataflow.md, "Data flow of one bucket"):

* Parameters live in fixed **buckets** with flat fp32 state (:mod:`.buckets`); the collective
  gives every parameter tensor of a bucket scales of its own.
* **Warm-up** (``step <= warmup_steps`` and no external switch): the gradient is averaged
  in full precision (by DDP's allreduce when a DDP model is attached, else by ``step()``
  itself) and the warm-up rule (AdamW, LAMB) runs, with per-parameter step counts as
  ``torch.optim.AdamW`` keeps them. ``warmup_comm_dtype`` (bf16, fp16) sends that mean as
  PyTorch's ``bf16_compress_hook`` does, for half the bytes of the phase that costs the most, or
  (uint8) as QAdam's 8-bit codes through the optimizer's buckets, for a quarter.
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
result is absorbed, and the two update rules; what the compressed mean sends is its ``wire``. The
optimizer never calls torch.distributed directly; it goes through the comm layer: every bucket's
:class:`~.sync.BucketSync` makes its collectives through :func:`~lightning_onebit.comm.make_mean`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from ..comm import Topology, Verdict, Wire
from ..comm.sharding import sharded_kind
from ..compress.kernels import apply_thread_budget
from .buckets import Bucket, BucketState
from .checkpointing import OptimizerCheckpoint
from .conversion import AdamConversion, check_hyperparameters
from .ddp import DDPHookPath
from .functional import decoupled_update_
from .nonfinite import (
    DeviceStep,
    NonFiniteGradientError,
    NonFinitePolicy,
    SkippedEverywhere,
    check_nonfinite_policy,
)
from .plumbing import SyncPlumbing
from .sync import CollectiveError, SyncContext

log = logging.getLogger(__name__)

__all__ = ["WARMUP_WIRES", "CollectiveError", "CompressedOptimizer", "NonFiniteGradientError", "check_hyperparameters",
           "check_nonfinite_policy"]

#: what ``warmup_comm_dtype`` may name: a dense mean, or 8-bit codes
WARMUP_WIRES = ("fp32", "bf16", "fp16", "uint8")


def _thread_budget_from_launcher() -> None:
    """Under torchrun (``LOCAL_WORLD_SIZE`` set), the ranks on this host share its cores: give the
    kernels their share, as the strategies do (logged once, by local rank 0)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        msg = apply_thread_budget(int(local))
        if msg and os.environ.get("LOCAL_RANK", "0") == "0":
            log.info(msg)


class CompressedOptimizer(SyncPlumbing, BucketState, NonFinitePolicy, DDPHookPath, OptimizerCheckpoint, AdamConversion,
                          Optimizer):
    """Base class. Subclasses define the flat state, the payload, and the update rules.

    Args (keyword-only in every subclass):
        bucket_cap_mb: the most fp32 megabytes of parameters per bucket.
        group: the process group (``None``: the default group, or DDP's once attached).
        simulate_workers: run that many workers in one process (see :meth:`step_workers`).
        warmup_comm_dtype: the dtype the full-precision mean of the warm-up (and of 0/1 Adam's
            variance refreshes) is sent and summed in: fp32 (default, exact), or ``"bf16"``/``"fp16"``
            (or the torch dtypes): half the bytes, each rank's g / n rounded once and the sum in that
            dtype, as with PyTorch's ``bf16_compress_hook``. The variance that the compression phase
            freezes is then estimated from those gradients (bf16 keeps 8 significant bits, the
            precision DeepSpeed's 1-bit Adam warms up in when it trains in half precision).
            ``"uint8"``: a quarter of fp32's bytes, as 8-bit min-max codes (QAdam's, one (min, max)
            per 128 elements of a tensor) through the two-stage compressed allreduce without error
            feedback, in ``step()``, or with DDP from its hook on a sender thread while backward runs
            (``p.grad`` then holds the mean after backward, as with DDP's all-reduce): the mean is
            off by at most half a code step (1/510 of a block's range) per stage; all-zero blocks
            stay exactly zero.
    """

    #: the Lightning strategy name this optimizer registers under (``None``: an abstract base)
    strategy_name: ClassVar[str | None] = None
    #: names of per-parameter fp32 state kept in flat bucket buffers
    flat_state: tuple[str, ...] = ()
    #: the algorithm has an uncompressed warm-up (1-bit Adam, 1-bit LAMB, QAdam)
    has_warmup: ClassVar[bool] = True
    #: how the collective treats its state: "plain", "error_feedback" or "markov"
    comm_mode: str = "error_feedback"
    #: what the compressed mean sends (its codec; every param group's ``block_size`` cuts its scales)
    wire: Wire = Wire.sign()
    #: the ranks take local steps, so their replicas differ between rounds (see sync_replicas)
    has_local_steps: ClassVar[bool] = False
    #: a NaN/inf gradient always makes the payload non-finite, so the collective's own check (its
    #: scale reduction, on every rank) finds it and no extra pass over the gradient is needed
    payload_shows_nonfinite: ClassVar[bool] = True
    #: the compressed update of a deferred result writes only where the call's flag holds (the collective's
    #: sink, or kernels predicated on it), so a compression step may be decided on the device on the cuda
    #: backend (:mod:`.nonfinite`)
    skips_on_device: ClassVar[bool] = False
    #: ``(sums, maxima) -> (sums, maxima)`` of per-tensor statistics over every shard of each tensor, for rules
    #: that need whole tensors (1-bit LAMB's norms); ``None``: each tensor is whole on this rank. Set by
    #: :class:`~.sharded.ShardedCompressed` (the node's ranks hold the shards)
    whole_tensor_stats: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

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

    def __init__(self, params: Iterable, defaults: dict, *, warmup_steps: int | None,
                 bucket_cap_mb: float = 25.0, group: Any = None, simulate_workers: int | None = None,
                 warmup_comm_dtype: torch.dtype | str | None = None) -> None:
        super().__init__(params, defaults)
        if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
            raise ValueError(f"warmup_steps must be a non-negative int or None, got {warmup_steps!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if simulate_workers is not None and simulate_workers < 1:
            raise ValueError(f"simulate_workers must be >= 1, got {simulate_workers}")
        self.warmup_steps = warmup_steps
        self.warmup_wire = Wire.parse(warmup_comm_dtype, option="warmup_comm_dtype", allowed=WARMUP_WIRES)
        self.bucket_cap_mb = bucket_cap_mb
        #: the group, topology and byte counters every bucket's synchronisation shares
        self.sync_context = SyncContext(type(self).__name__, group=group, simulate_workers=simulate_workers,
                                        topology=Topology(who=type(self).__name__), step=lambda: self._step + 1)
        _thread_budget_from_launcher()
        self._step = 0
        self._compressing = not self.has_warmup
        self._switch_at: int | None = None  # optimizer steps taken when the compression phase began
        self._buckets: list[Bucket] = []
        self._nbucketed = 0  # param groups that have buckets
        self._param_bucket: dict[int, tuple[Bucket, int]] = {}
        self._ddp_attached = False
        self._coded_warmup = None  # the DDP hook's sender of the 8-bit warm-up mean, made at its first use
        self._ddp_params: set[int] = set()
        self._ddp_find_unused = False
        #: with DDP, synchronise in step() instead of the backward hook (fp16 + GradScaler:
        #: the hook would see scaled gradients; also lets clipping act before compression)
        self.defer_sync_to_step = False
        self.on_nonfinite = "raise"  # see set_nonfinite_policy
        self.max_consecutive_skips = 10
        self.skipped_steps = 0  #: steps skipped for a non-finite gradient (policy "skip")
        self._device_steps: list = []  # steps decided on the device whose verdict the host has not read
        self._verdict = None  # the last sync's, if it was decided on the device
        self._verdict_bufs: dict = {}  # what the hook's verdicts go to the host through (Verdict.send_together)
        self._skip_run: list[int] = []  # optimizer steps of the current run of skips

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does). Its parameters get buckets of their own at the next step;
        after the switch of a warm-up algorithm they warm up on their own first (see the module
        docstring)."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.is_sparse or p.is_complex():
                raise ValueError(f"{type(self).__name__} supports dense real parameters only")
            if (kind := sharded_kind(p)) is not None:  # its buckets would hold shards as if whole tensors
                raise ValueError(f"{type(self).__name__}: a parameter of shape {tuple(p.shape)} is {kind}; its "
                                 "buckets would hold shards as whole tensors. For FSDP2 inside each node use "
                                 f"ShardedCompressed({self.strategy_name!r}, params, mesh=mesh) (in Lightning: "
                                 f"strategy='{self.strategy_name}_fsdp'; docs/design/sharding.md), or "
                                 "DiLoCo(..., mesh=mesh)")
        self.wire.codec(self.param_groups[-1].get("block_size"))  # its block size, validated now

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
        b.sync.end_warmup()  # the warm-up's codes are done: free their collective and its result buffer
        b.drop_buffers("warm-up mean")
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

    def _finish_updates(self) -> None:
        """Hook for subclasses: called once a step after every bucket's update, for what an update left to
        do with all of the step's buckets at once (1-bit LAMB reads its per-layer statistics here, once)."""

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
        ups = [b.view(update, i) for i in keep]
        dens = [b.view(denom, i) for i in keep] if denom is not None else None
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

    def _run_step(self, worker_grads) -> None:
        self.settle_device_skips(wait=False)
        buckets = self._build_buckets()
        self._update_phase()
        finite, check = None, None
        if self.on_nonfinite == "skip":
            check = self._finiteness_check(buckets, worker_grads)
            if check == "first call":
                finite = self._locally_finite(buckets)  # ORed over ranks by the first call's agreement
            elif check is None and self._nonfinite_anywhere(buckets, worker_grads):
                self._skip_step(buckets)
                return
        self._verdict = None
        try:
            plan = self._synchronise(buckets, worker_grads, finite, carry_finite=check == "payloads")
        except SkippedEverywhere:
            self._skip_step(buckets)
            return
        except BaseException:
            for b in buckets:  # the next step starts from scratch (the hook's work included)
                b.reset_step(discard=True)
            raise
        # Pass 2: updates.
        self._step += 1
        counted, decided = [], []  # decided: (verdict of a sync in DDP's hook, its bucket's counted params)
        for b, has, grad, saved in plan:
            hook_verdict = b.sync.verdict if b.sync is not None else None
            # a state read between DDP's hook and step() found the device skipped this bucket's call: its update
            # would run on the momentum as it was (the verdict still counts the step back a step later)
            refused = b.sync is not None and b.sync.refused
            b.reset_step()
            if not any(has):
                continue
            mine = [p for p, h in zip(b.params, has, strict=True) if h]
            for p in mine:
                self.state[p]["step"] = self.state[p].get("step", 0) + 1
            if hook_verdict is not None:
                decided.append((hook_verdict, mine))
            else:
                counted += mine
            group = self.param_groups[b.group_index]
            if b.compressing and not refused:
                self._update_compressed(b, group, has)
            elif not b.compressing:
                self._update_warmup(b, grad, group, has)
            self._restore(saved)
        self._finish_updates()
        if self._verdict is not None:
            decided.append((self._verdict, counted))
        Verdict.send_together([v for v, _ in decided], self._verdict_bufs)  # DDP's hook's, one copy for all
        if decided:  # settle_device_skips learns a step later what the device decided
            self._device_steps.append(DeviceStep(decided, self._step))
        else:
            self._skip_run = []
        self.comm_counter.end_step()
        self.intra_node_counter.end_step()

    def second_moments(self) -> list[torch.Tensor]:
        """The flat fp32 second-moment buffers (``exp_avg_sq``) of the buckets, in bucket order, as
        kept (not copies); empty before the first step builds the buckets. Read by the "auto"
        :class:`~lightning_onebit.callbacks.PhaseSwitch` to see when the variance has settled."""
        return [b.flat["exp_avg_sq"] for b in self._buckets if "exp_avg_sq" in b.flat]

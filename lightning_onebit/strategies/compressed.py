"""Lightning strategies: DDP whose gradient traffic is compressed by a lightning_onebit optimizer.

``Trainer(strategy="onebit_adam")`` is ``DDPStrategy`` (same launchers, cluster environments,
``num_nodes``, ``process_group_backend``, timeouts) plus three things:

1. **Optimizer**: ``configure_optimizers`` may return ``torch.optim.Adam``/``AdamW`` (or a
   LAMB for ``onebit_lamb``); it is converted to the strategy's algorithm with the same
   hyperparameters and param groups, LR schedulers (nested ones too, and the keys schedulers
   added to the param groups) are re-pointed at the new optimizer (:mod:`.schedulers`),
   and the conversion is logged once. The package's matching optimizer is used as is; a
   strategy option that it sets otherwise (``optimizer_kwargs``, ``warmup`` against its
   ``warmup_steps``, ``hierarchical`` against its ``set_topology``, ``on_nonfinite`` against its
   ``set_nonfinite_policy``) fails at setup naming both values (:mod:`.options`).
   Anything else fails at setup with a message that says what to do. Several optimizers
   (manual optimization, e.g. a GAN's generator and discriminator) are each converted and keep
   their own buckets, phase, error state and checkpoint section.
2. **Communication**: one optimizer is attached to the DDP model through a comm hook, on
   CPU (gloo) as on GPU (Lightning registers hooks only on CUDA; we always do). With several,
   DDP sends nothing and each optimizer synchronises its parameters in its ``step()``
   (:func:`~lightning_onebit.optim.ddp.attach_several`): a gradient is final only when its
   optimizer steps.
3. **Checkpoints** (:mod:`.checkpoints`): the main file holds what every rank shares (model,
   moments, phase); each rank writes its own error-feedback state to a shard next to it and reads
   back only its own. A resume on the same world size and layout continues bit for bit.

Precision: ``32`` and ``bf16-mixed`` need nothing special (state and compression are fp32).
With ``16-mixed`` the compressed sync moves from the backward hook to ``step()`` (after the
GradScaler has unscaled the local gradients), and the scaler's overflow check is agreed
across ranks so that every rank skips the same steps.

Runs that cannot save anything say so on rank 0: one process (nothing to compress), a warm-up
as long as the run (at the start of fit), no compressed step in the whole fit (at its end), and
a conversion whose learning rate is known to be wrong for the algorithm (LAMB; the AMSGrad-style
algorithms without warm-up).

Non-finite gradients (``on_nonfinite``): by default a step with a NaN/inf gradient on any rank
is skipped on every rank without any state change, like GradScaler's skips; ``"raise"`` stops.

Gradient clipping: during warm-up it clips the averaged gradient, as with plain DDP. In the
compression phase the synchronisation runs in ``step()`` (``on_nonfinite="skip"``, ``16-mixed``
or several optimizers), so clipping acts on this rank's local gradient before compression; with
``on_nonfinite="raise"`` and 32/bf16 it runs inside backward, before Lightning clips, and
clipping does not affect the update. With a frozen variance a clip that triggers shrinks the step,
so the default warns, and ``clip_when_compressing=False`` clips during warm-up only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from ..callbacks.phase import DEFAULT_WARMUP, PhaseSwitch, check_warmup, set_run_length
from ..callbacks.replicas import ReplicaSync
from ..comm.agree import gather_objects, is_distributed, max_across_
from ..compress import compile_kernels
from ..compress.kernels import apply_thread_budget
from ..optim import CompressedOptimizer
from ..optim.ddp import attach_several
from .checkpoints import SHARD_DIR, ErrorStateShards, shard_path
from .launch import BaseDDPStrategy, destroy_process_group_at_exit
from .options import (
    check_bool,
    check_choice,
    check_int,
    check_warmup_kept,
    checked_optimizer_kwargs,
    compressed_conflicts,
    sharded_variant,
)
from .schedulers import repoint_scheduler

__all__ = ["ALGORITHMS", "SHARD_DIR", "CompressedDDPStrategy", "destroy_process_group_at_exit", "repoint_scheduler",
           "shard_path"]

#: strategy name -> optimizer class (each optimizer names its strategy, see CompressedOptimizer)
ALGORITHMS: dict[str, type[CompressedOptimizer]] = CompressedOptimizer.algorithms()


def _compressed_fsdp() -> type:
    from .compressed_fsdp import CompressedFSDPStrategy  # (imported late: it imports this package's optimizers)

    return CompressedFSDPStrategy


class _AgreeingGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow check is agreed across ranks (MAX of found_inf).

    With compressed synchronisation the gradients a rank unscales are its own, so one rank
    can overflow while another does not; skipping on one rank only would desynchronise them.
    """

    group = None

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        for t in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            max_across_(t, self.group)


#: the clip_gradients wrappers the strategies installed on precision plugins: a second fit wraps the
#: original (``__wrapped__``), not the wrapper
_CLIP_WRAPPERS: weakref.WeakSet = weakref.WeakSet()

#: the defaults of the options left unset when nothing else sets them
_DEFAULT_ON_NONFINITE, _DEFAULT_MAX_SKIPS = "skip", 10

class CompressedDDPStrategy(ErrorStateShards, BaseDDPStrategy):
    """DDP with compressed communication by a lightning_onebit algorithm.

    The options the optimizer has too (``warmup``, ``optimizer_kwargs``, ``hierarchical``,
    ``on_nonfinite``, ``max_consecutive_skips``) default to ``None``, "not set": an optimizer from
    ``configure_optimizers`` that is already the strategy's algorithm keeps its own value, and where
    nothing sets an option the default named below applies (to an optimizer the strategy converts,
    always: it takes the strategy's options). An option set here that the returned optimizer sets
    otherwise fails at setup, on every rank, naming both values; equal values are fine. Every
    option is checked here, before any rank starts.

    Args:
        algorithm: one of :data:`ALGORITHMS` (``"onebit_adam"``, ``"qadam"``, ...).
        warmup: for the warm-up algorithms, when compression starts: an int (steps), a float in
            (0, 1) (a fraction of ``trainer.estimated_stepping_batches``) or ``"auto"`` (when the
            variance has stabilised). Implemented by adding a
            :class:`~lightning_onebit.callbacks.PhaseSwitch` callback unless one is present. Unset:
            the optimizer's ``warmup_steps``, or the callback's, else 0.15 (the 1-bit Adam paper's
            advice). Set, it must agree with either of them.
        optimizer_kwargs: further arguments of the algorithm's optimizer (e.g. ``eps_inside_sqrt``,
            ``block_size``, ``bucket_cap_mb``, ``warmup_comm_dtype``), checked here against its
            signature and by building one. A converted optimizer takes them; a returned one must
            have the same values. The hyperparameters a conversion carries over (``lr``, ``betas``,
            ``eps``, ``weight_decay``) come from the returned optimizer and cannot be given here.
        hierarchical: the two-level collective (fp32 inside a node, compressed between nodes);
            unset: the optimizer's ``set_topology``, else on with several nodes of several ranks
            each (``num_nodes`` > 1, devices > 1). The ranks per node are the trainer's devices
            unless the optimizer's ``set_topology`` gave them.
        strict_resume: raise, instead of resetting the error state with a warning, when a resume on
            the same world size finds this rank's error-state shard missing, unreadable or stale.
        on_nonfinite: ``"skip"`` (the default when neither this nor the optimizer's
            ``set_nonfinite_policy`` sets it, like GradScaler): a step whose gradient holds NaN/inf
            on any rank is skipped on every rank with no state change, counted and logged, and
            ``max_consecutive_skips`` (default 10) skips in a row raise; ``"raise"``: the first one
            raises :class:`~lightning_onebit.optim.NonFiniteGradientError`. "skip" synchronises in
            ``step()`` rather than in the backward hook (see the optimizer's ``set_nonfinite_policy``).
        clip_when_compressing: ``False``: Lightning's gradient clipping (``gradient_clip_val``) runs
            only during warm-up for the algorithms whose variance freezes at the switch (1-bit Adam,
            1-bit LAMB, QAdam). In their compression phase clipping acts on each rank's *local*
            gradient, which is larger than the averaged one DDP clips, and with the variance frozen a
            clip that triggers shrinks the step itself (Adam's denominator no longer follows); see
            docs/results.md for the measurement. ``True``: clip as asked; ``None`` (default): clip as
            asked, with a warning.
        sharding: ``None`` (every rank holds the whole model: DDP) or ``"fsdp"``, which builds a
            :class:`~lightning_onebit.strategies.compressed_fsdp.CompressedFSDPStrategy` instead (FSDP2 inside
            each node, ``strategy="onebit_adam_fsdp"``), for the algorithms with a sharded form.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes;
            ``gradient_as_bucket_view`` defaults to ``True`` here.
    """

    algorithm: str = "onebit_adam"

    def __new__(cls, *args: Any, sharding: str | None = None, **kwargs: Any):
        target = sharded_variant(cls.__name__, sharding, _compressed_fsdp, kwargs)
        if target is None:
            return super().__new__(cls)
        if len(args) > 3:
            raise ValueError(f"{cls.__name__}(sharding='fsdp'): pass the options after optimizer_kwargs by keyword")
        algorithm = kwargs.pop("algorithm", None) or (args[0] if args else None) or cls.algorithm
        return target(algorithm, *args[1:], **kwargs)  # (not a subclass: Python does not call __init__ again)

    def __init__(self, algorithm: str | None = None, warmup: int | float | str | None = None,
                 optimizer_kwargs: Mapping[str, Any] | None = None, hierarchical: bool | None = None,
                 strict_resume: bool = False, on_nonfinite: str | None = None,
                 max_consecutive_skips: int | None = None, clip_when_compressing: bool | None = None,
                 sharding: None = None, **kwargs: Any) -> None:
        owner = type(self).__name__
        algorithm = algorithm or type(self).algorithm
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(ALGORITHMS)}")
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError(f"{owner} installs its own DDP comm hook; ddp_comm_hook cannot be set")
        # every option checked before any rank starts (a bad one would otherwise fail only at fit)
        if warmup is not None:
            try:
                check_warmup(warmup)
            except ValueError as exc:
                raise ValueError(f"{owner}: {exc}") from None
            check_warmup_kept(owner, algorithm, warmup)
        optimizer_kwargs = checked_optimizer_kwargs(owner, ALGORITHMS[algorithm], optimizer_kwargs)
        check_bool(owner, "hierarchical", hierarchical, none=True)
        check_bool(owner, "strict_resume", strict_resume)
        if on_nonfinite is not None:
            check_choice(owner, "on_nonfinite", on_nonfinite, ("skip", "raise"))
        if max_consecutive_skips is not None:
            check_int(owner, "max_consecutive_skips", max_consecutive_skips, minimum=1)
        check_bool(owner, "clip_when_compressing", clip_when_compressing, none=True)
        # Gradients as views of DDP's buckets: DDP then skips copying every bucket back into
        # fresh .grad tensors after the hook (a full copy plus first-touch page faults per step;
        # in the compression phase .grad is not even read). Pass False to get DDP's default.
        kwargs.setdefault("gradient_as_bucket_view", True)
        super().__init__(**kwargs)
        self.algorithm = algorithm
        self.optimizer_cls = ALGORITHMS[algorithm]
        self.warmup = warmup
        self.optimizer_kwargs = optimizer_kwargs
        self.hierarchical = hierarchical
        self.strict_resume = strict_resume
        self.on_nonfinite, self.max_consecutive_skips = on_nonfinite, max_consecutive_skips
        self.clip_when_compressing = clip_when_compressing
        self.phase_switch: PhaseSwitch | None = None  #: the PhaseSwitch this strategy added, if any

    # -- setup ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        # The PhaseSwitch goes in before Lightning restores a checkpoint's callbacks (which happens
        # before setup): a resume then restores its state, and Lightning does not ask the user to
        # add a callback they never added.
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._add_phase_switch(trainer)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        # ranks on one host share its cores: give the compression kernels their share (logged once)
        msg = apply_thread_budget(self.num_processes)
        if msg:
            rank_zero_info(msg)
        compile_kernels(self.root_device)  # once per host: one rank compiles, the others load numba's cache

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        returned = self._convert_optimizers(trainer)
        opts: list[CompressedOptimizer] = list(self.optimizers)
        # every rank checks the same options, so with the same optimizers every rank raises here,
        # before the strategy's first collective
        problems = compressed_conflicts(self, trainer, opts, returned)
        if problems:
            raise ValueError("\n".join(problems))
        fp16 = getattr(self.precision_plugin, "scaler", None) is not None
        if fp16:
            self._install_agreeing_scaler()
        for opt in opts:
            opt.defer_sync_to_step = fp16
            if opt.nonfinite_policy_set:  # the optimizer's own (it also makes "skip" sync in step())
                opt.set_nonfinite_policy(opt.on_nonfinite, max_consecutive=opt.max_consecutive_skips)
            else:
                opt.set_nonfinite_policy(self.on_nonfinite or _DEFAULT_ON_NONFINITE,
                                         max_consecutive=self.max_consecutive_skips or _DEFAULT_MAX_SKIPS)
            hierarchical = opt.hierarchical if self.hierarchical is None else self.hierarchical
            opt.set_topology(hierarchical=hierarchical, ranks_per_node=opt.ranks_per_node or self.num_processes)
        self._agree_on_settings(opts, fp16)
        if len(opts) == 1:
            opts[0].attach(self.model)
        else:
            attach_several(self.model, opts)
        self._ensure_phase_switch(trainer, opts)
        ReplicaSync.ensure(trainer, opts)
        self._place_clipping(trainer, opts)

    def _place_clipping(self, trainer, opts: list[CompressedOptimizer]) -> None:
        """Warn about gradient clipping in the compression phase, or leave it to the warm-up."""
        if not trainer.gradient_clip_val or not any(o.has_warmup for o in opts):
            return
        name = self.algorithm
        if self.clip_when_compressing:
            return
        if self.clip_when_compressing is None:
            rank_zero_warn(f"strategy {name!r} with gradient_clip_val={trainer.gradient_clip_val}: in the compression "
                           "phase clipping acts on each rank's local gradient (larger than the averaged one DDP "
                           "clips), and with the variance frozen since the warm-up a clip that triggers shrinks the "
                           "step itself, which costs loss (measured in docs/results.md, \"Gradient clipping with the "
                           "variance frozen\"). clip_when_compressing=False on the strategy clips during warm-up "
                           "only (longer compressed steps instead); True clips and silences this.")
            return
        plugin = self.precision_plugin
        clip = plugin.clip_gradients
        clip = clip.__wrapped__ if clip in _CLIP_WRAPPERS else clip

        @functools.wraps(clip)
        def clip_during_warmup(optimizer: Optimizer, *args: Any, **kw: Any) -> None:
            opt = getattr(optimizer, "_optimizer", optimizer)
            if isinstance(opt, CompressedOptimizer) and opt.has_warmup and opt.compressing:
                return None
            return clip(optimizer, *args, **kw)

        _CLIP_WRAPPERS.add(clip_during_warmup)
        plugin.clip_gradients = clip_during_warmup

    def _agree_on_settings(self, opts: list[CompressedOptimizer], fp16: bool) -> None:
        """Compare the settings every rank must share before the first collective: ranks that differ
        (say, in warm-up length or codec) would otherwise hang or silently diverge. Raises on every
        rank, naming each setting that differs and its value per rank."""
        if not is_distributed() or self.world_size == 1:
            return
        mine = dict(strategy=self.algorithm, warmup=repr(self.warmup), fp16_scaler=repr(fp16),
                    on_nonfinite=",".join(o.on_nonfinite for o in opts), optimizers=repr(len(opts)),
                    num_nodes=repr(self.num_nodes), devices_per_node=repr(self.num_processes))
        for k, opt in enumerate(opts):
            mine.update({(key if len(opts) == 1 else f"optimizer {k} {key}"): v for key, v in opt.settings().items()})
        every = gather_objects(mine)  # a few hundred bytes per rank, once
        keys = sorted(set().union(*every), key=lambda k: (k not in mine, k))
        diff = [k for k in keys if len({r.get(k) for r in every}) > 1]
        if diff:
            lines = [f"  {k}: " + ", ".join(f"rank {r} {every[r].get(k, '(unset)')}" for r in range(self.world_size))
                     for k in diff]
            raise ValueError(f"{type(self).__name__}: the ranks disagree on the training setup:\n" + "\n".join(lines))

    def _convert_optimizers(self, trainer) -> list[int]:
        """Every optimizer becomes the strategy's algorithm: an Adam/AdamW (or LAMB) is converted and
        its LR schedulers re-pointed; the package's matching optimizer is kept. Returns the indices
        of the kept ones (their settings are the user's, see :func:`.options.compressed_conflicts`)."""
        name, cls = self.algorithm, self.optimizer_cls
        if not self.optimizers:
            raise ValueError(f"strategy {name!r} needs an optimizer; configure_optimizers returned none")
        several = len(self.optimizers) > 1
        converted, kept, out = [], [], []
        for k, opt in enumerate(self.optimizers):
            which = f"optimizer {k} of {len(self.optimizers)} ({type(opt).__name__})" if several else None
            if isinstance(opt, CompressedOptimizer):
                if type(opt) is not cls:
                    raise ValueError(f"strategy {name!r} runs {cls.__name__}, but configure_optimizers returned "
                                     f"{which or type(opt).__name__}; return {cls.__name__} (or torch.optim.AdamW, "
                                     "which is converted) or use the strategy matching your optimizer")
                out.append(opt)
                kept.append(k)
                continue
            new = self._convert(opt, which)
            for cfg in self.lr_scheduler_configs:
                repoint_scheduler(cfg.scheduler, opt, new)
            out.append(new)
            converted.append(type(opt).__name__)
        self.optimizers = out
        if converted:
            rank_zero_info(f"lightning_onebit: converted {', '.join(converted)} to {cls.__name__} "
                           f"(same hyperparameters) for strategy {name!r}")
        return kept

    def _convert(self, opt: Optimizer, which: str | None = None) -> CompressedOptimizer:
        name, cls = self.algorithm, self.optimizer_cls
        try:
            new = cls.from_optimizer(opt, **self.optimizer_kwargs)
        except ValueError as exc:
            raise ValueError(f"strategy {name!r}{': ' + which if which else ''}: {exc}. Return {cls.__name__} (or an "
                             "optimizer it converts from) from configure_optimizers; for SGD-style training use "
                             "strategy='ef21' or plain 'ddp'.") from exc
        advice = cls.conversion_advice(opt)
        if advice:
            rank_zero_warn(f"strategy {name!r} converts {type(opt).__name__} to {cls.__name__} with the same lr "
                           f"({opt.defaults['lr']}): {advice}")
        return new

    def _install_agreeing_scaler(self) -> None:
        old = self.precision_plugin.scaler
        new = _AgreeingGradScaler(device=self.root_device.type)
        new.load_state_dict(old.state_dict())
        self.precision_plugin.scaler = new

    def _add_phase_switch(self, trainer) -> None:
        """Add a PhaseSwitch with the strategy's warm-up (or the default) unless one is there."""
        if any(isinstance(cb, PhaseSwitch) for cb in trainer.callbacks) or not self.optimizer_cls.has_warmup:
            return
        self.phase_switch = PhaseSwitch(DEFAULT_WARMUP if self.warmup is None else self.warmup)
        trainer.callbacks.append(self.phase_switch)

    def _ensure_phase_switch(self, trainer, opts: list[CompressedOptimizer]) -> None:
        if all(opt.compressing or opt.warmup_steps is not None for opt in opts):
            if self.phase_switch is not None and self.phase_switch in trainer.callbacks:
                trainer.callbacks.remove(self.phase_switch)  # the optimizers switch by themselves
            self.phase_switch = None
            return
        self._add_phase_switch(trainer)

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        opts = [o for o in self.optimizers if isinstance(o, CompressedOptimizer)]
        self._warn_about_waste(trainer, opts, set_run_length(trainer, opts))

    def _warn_about_waste(self, trainer, opts: list[CompressedOptimizer], total: float) -> None:
        """Say once (rank 0) when a run's compression cannot save anything."""
        name = self.algorithm
        if self.world_size == 1:
            rank_zero_warn(f"strategy {name!r} runs on one process: there is no communication to compress, so it "
                           "saves nothing (it runs the same algorithm, compression error included, as on many "
                           "processes). Use several devices or nodes, or strategy='auto' for a single process.")
        if all(o.compressing for o in opts) or total == float("inf"):
            return
        switch = next((cb for cb in trainer.callbacks if isinstance(cb, PhaseSwitch)), None)
        warmups = [o.warmup_steps for o in opts if o.warmup_steps is not None]
        if switch is not None and switch.warmup != "auto" and switch.target is not None:
            warmups.append(switch.target)
        if warmups and min(warmups) >= total:
            rank_zero_warn(f"strategy {name!r}: the warm-up ({min(warmups)} steps) is as long as the run or longer "
                           f"({int(total)} optimizer steps), so compression never starts and every step sends "
                           "fp32 as DDP does. Shorten the warm-up (a float warmup is a fraction of the run).")

    def on_train_end(self) -> None:
        super().on_train_end()
        trainer = self.lightning_module.trainer
        opts = [o for o in self.optimizers if isinstance(o, CompressedOptimizer)]
        idle = [k for k, o in enumerate(opts) if not o.compressing]
        if idle and trainer.global_step > 0 and self.world_size > 1:
            which = "" if len(opts) == 1 else f" (optimizer {', '.join(map(str, idle))})"
            rank_zero_warn(f"strategy {self.algorithm!r}: compression never started in this fit{which}: all "
                           f"{trainer.global_step} steps were warm-up steps and sent fp32, as DDP does")

    # -- checkpoints ---------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model of a checkpoint: with local steps pending, the ranks synchronise first (the
        checkpoint is then one model on every rank, and a resume continues from it exactly)."""
        for opt in self.optimizers:
            if isinstance(opt, CompressedOptimizer):
                opt.sync_replicas()
        return super().lightning_module_state_dict()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name in ALGORITHMS:
            for suffix, start in (("", "popen"), ("_spawn", "spawn"), ("_forkserver", "forkserver")):
                strategy_registry.register(
                    name + suffix, cls, description=f"DDP with {ALGORITHMS[name].__name__} compressed communication",
                    algorithm=name, start_method=start, override=True)

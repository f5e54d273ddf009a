"""``strategy="diloco"``: DDP whose gradients stay on their rank, for :class:`~lightning_onebit.DiLoCo`.

DDP's allreduce is replaced by a hook that leaves each rank's gradients in place (the inner steps
send nothing); an ``AdamW`` from ``configure_optimizers`` becomes a ``DiLoCo`` with the same
hyperparameters and its LR schedulers follow it. Between outer steps the ranks' replicas differ, so:

* validation evaluates the anchor, the model of the last outer step, identical on every rank (no
  extra round); training resumes on each rank's own replica afterwards;
* a checkpoint's model is the anchor; its main file holds what the ranks share (the anchor, the outer
  momentum, the clock, the counters, the outer steps in flight: its size does not grow with the number
  of ranks), and every rank writes its own replica, AdamW moments and error state to a shard of its own
  next to it (:mod:`.checkpoints`; no rank's own state crosses the network). A resume on the same
  number of ranks and layout continues bit for bit mid-interval; on another, every rank starts from
  the anchor with rank 0's moments (one warning, on rank 0), as a rank whose shard is missing,
  unreadable or stale does (a warning naming it); ``strict_resume=True`` raises instead;
* the fit's last step (or its end, if stopped early) takes one last outer step over a partial interval,
  so every rank ends on one model;
* buffers (BatchNorm's running statistics, BERT's position ids) stay on their rank too: DDP's
  ``broadcast_buffers`` defaults to ``False`` here (else DDP would broadcast them in every forward, a
  round per inner step), and after every outer step the ranks take their mean (one all-reduce in fp64;
  integer buffers are rounded). Validation and the checkpoint's model use the mean of the ranks'
  current buffers, and every rank's shard keeps its own, so a resume continues bit for bit.
  ``broadcast_buffers=True`` restores DDP's behaviour instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from ..comm.accounting import ring_allreduce_bytes
from ..comm.agree import is_distributed, sum_across_
from ..comm.ddp_hook import register_local_hook
from ..comm.duplex import enable_duplex
from ..compress import compile_kernels
from ..optim.diloco import COMPRESSIONS, DiLoCo
from .checkpoints import RankShards
from .launch import BaseDDPStrategy
from .options import check_bool, check_choice, check_int, check_real, conflict, sharded_variant
from .schedulers import repoint_scheduler

__all__ = ["DiLoCoFit", "DiLoCoStrategy", "check_diloco_options"]


def check_diloco_options(options: dict[str, Any], owner: str = "DiLoCoStrategy") -> None:
    """The types here (naming the option), the ranges by DiLoCo itself: built on a dummy parameter."""
    for k in ("sync_every", "fragments"):
        if k in options:
            check_int(owner, k, options[k], minimum=1)
    if "overlap" in options:
        check_int(owner, "overlap", options["overlap"], minimum=0)
    for k in ("outer_lr", "outer_momentum", "mixing"):
        if k in options:
            check_real(owner, k, options[k])
    for k in ("nesterov", "keep_local", "hierarchical", "offload"):
        if k in options:
            check_bool(owner, k, options[k])
    if "compression" in options:
        check_choice(owner, "compression", options["compression"], COMPRESSIONS)
    if "on_nonfinite" in options:
        check_choice(owner, "on_nonfinite", options["on_nonfinite"], ("raise", "skip"))
    try:
        DiLoCo([torch.zeros(1, requires_grad=True)], **options)  # the ranges, and the options together
    except ValueError as exc:
        raise ValueError(f"{owner}: {exc}") from exc


def _diloco_fsdp() -> type:
    from .diloco_fsdp import DiLoCoFSDPStrategy  # (imported late: it builds on this module)

    return DiLoCoFSDPStrategy


class DiLoCoFit:
    """What a Lightning fit with :class:`~lightning_onebit.DiLoCo` needs, replicated or sharded: the options'
    agreement with a returned DiLoCo, validation on the anchor, the last outer step, buffers averaged at outer
    steps. Mixed into a strategy before its Lightning base; the strategy sets ``diloco_kwargs``,
    ``_average_buffers_too``, ``_in_anchor = []`` and ``_own_buffers = None``."""

    diloco_kwargs: dict[str, Any]
    strategy_name = "diloco"

    def _layout_kwargs(self) -> dict[str, Any]:
        """DiLoCo's layout arguments of a converted AdamW: here the ranks per node are the trainer's devices."""
        return {"ranks_per_node": self.num_processes}

    def _adopt(self, opt: DiLoCo) -> None:
        """A DiLoCo from ``configure_optimizers``, fitted to the strategy's layout where it left it open."""
        opt.ranks_per_node = opt.ranks_per_node or self.num_processes

    def _before_param_write(self) -> None:
        """Called before the strategy writes into the parameters outside a training step (the anchor in or
        out around validation, the last outer step of a fit stopped early); a sharded strategy reshards."""

    def _convert_optimizers(self) -> None:
        if not self.optimizers:
            raise ValueError(f"strategy '{self.strategy_name}' needs an optimizer; configure_optimizers returned none")
        # every rank has the same options, so with the same optimizers every rank raises here, before
        # the strategy's first collective
        problems = [msg for k, opt in enumerate(self.optimizers) if isinstance(opt, DiLoCo)
                    for msg in self._conflicts(opt, f" as optimizer {k} of {len(self.optimizers)}"
                                               if len(self.optimizers) > 1 else "")]
        if problems:
            raise ValueError("\n".join(problems))
        out = []
        for opt in self.optimizers:
            if isinstance(opt, DiLoCo):
                self._adopt(opt)
                out.append(opt)
                continue
            try:
                new = DiLoCo.from_optimizer(opt, **self._layout_kwargs(), **self.diloco_kwargs)
            except ValueError as exc:
                raise ValueError(f"strategy '{self.strategy_name}': {exc}. Return torch.optim.AdamW (or DiLoCo) "
                                 "from configure_optimizers") from exc
            for cfg in self.lr_scheduler_configs:
                repoint_scheduler(cfg.scheduler, opt, new)
            rank_zero_info(f"lightning_onebit: converted {type(opt).__name__} to DiLoCo (same hyperparameters, "
                           f"{self.diloco_kwargs}) for strategy '{self.strategy_name}'")
            out.append(new)
        self.optimizers = out

    def _conflicts(self, opt: DiLoCo, where: str = "") -> list[str]:
        """The options set on this strategy that the returned ``opt`` has otherwise, one message each."""
        if not self.diloco_kwargs:
            return []
        probe = DiLoCo([torch.zeros(1, requires_grad=True)], **self.diloco_kwargs)  # DiLoCo's normal form
        return [conflict(type(self).__name__, k, v, "DiLoCo", f"{k}={getattr(opt, k)!r}", where)
                for k, v in self.diloco_kwargs.items() if getattr(probe, k) != getattr(opt, k)]

    def _dilocos(self) -> list[DiLoCo]:
        return [o for o in self.optimizers if isinstance(o, DiLoCo)]

    # -- one model where one is wanted ---------------------------------------------------------
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._before_param_write()
            self._in_anchor = [opt.anchor_in_params() for opt in self._dilocos()]
            for ctx in self._in_anchor:
                ctx.__enter__()
            mean = self._mean_buffers()
            if mean is not None:
                self._own_buffers = [b.clone() for b in self._buffers()]
                self._copy_into_buffers(mean)

    def on_validation_end(self) -> None:
        if self._in_anchor:
            self._before_param_write()
        for ctx in reversed(self._in_anchor):
            ctx.__exit__(None, None, None)
        self._in_anchor = []
        if self._own_buffers is not None:
            for b, own in zip(self._buffers(), self._own_buffers, strict=True):
                b.copy_(own)
            self._own_buffers = None
        super().on_validation_end()

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        before = self._outer_steps()
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer
        if trainer.global_step + 1 >= trainer.estimated_stepping_batches:  # the fit's last step
            self._finish_interval()
        if self._outer_steps() != before:  # the same on every rank: the schedule is
            mean = self._mean_buffers()
            if mean is not None:
                self._copy_into_buffers(mean)
        return out

    def on_train_end(self) -> None:
        if any(not opt.synced for opt in self._dilocos()):
            self._before_param_write()
        self._finish_interval()  # a fit stopped early (the last step already did it otherwise)
        super().on_train_end()

    def _finish_interval(self) -> None:
        """An outer step over a partial interval, so that the fit ends on one model on every rank
        (``synced`` is the same everywhere: all ranks take it together)."""
        for opt in self._dilocos():
            if not opt.synced:
                opt.outer_step()

    def _outer_steps(self) -> int:
        return sum(opt.outer_steps for opt in self._dilocos())

    def _as_anchor(self, sd: dict[str, Any], wrap: Any = None) -> dict[str, Any]:
        """``sd`` (the module's state dict) with the anchor for the parameters (``wrap(param, view)``: as the
        parameter holds it, e.g. sharded) and the mean of the ranks' buffers for the buffers. All ranks call it."""
        views: dict[int, torch.Tensor] = {}
        for opt in self._dilocos():
            views.update(opt.anchor_views())
        for name, p in self.lightning_module.named_parameters():
            if id(p) in views and name in sd:
                v = views[id(p)].to(p.dtype)
                sd[name] = v if wrap is None else wrap(p, v)
        mean = self._mean_buffers()
        if mean is not None:
            o = 0
            for name, b in self._named_buffers():
                if name in sd:
                    sd[name] = self._mean_as(b, mean, o)
                o += b.numel()
        return sd

    # -- buffers: each rank's own between outer steps, their mean at them -----------------------------
    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Real-valued buffers (a complex one would lose its imaginary part in the fp64 mean)."""
        return [(n, b) for n, b in self.lightning_module.named_buffers() if not b.is_complex()]

    def _buffers(self) -> list[torch.Tensor]:
        return [b for _, b in self._named_buffers()]

    @staticmethod
    def _mean_as(b: torch.Tensor, flat: torch.Tensor, o: int) -> torch.Tensor:
        """Buffer ``b``'s part of the flat fp64 mean at offset ``o``, in its dtype (integers rounded)."""
        part = flat[o:o + b.numel()].view(b.shape)
        return (part if b.is_floating_point() else part.round()).to(b.dtype)

    def _mean_buffers(self) -> torch.Tensor | None:
        """The mean over ranks of every buffer, flat in fp64 (exact for fp32 and for integers below
        2**53); ``None`` when buffers are DDP's business, there are none, or one rank. All ranks call it."""
        bufs = self._buffers()
        if not (self._average_buffers_too and bufs and is_distributed() and self.world_size > 1):
            return None
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in bufs])
        sum_across_(flat)
        flat /= self.world_size
        dilocos = self._dilocos()
        if dilocos:  # an out-of-step round of the first optimizer's account
            dilocos[0].comm_counter.add(ring_allreduce_bytes(flat.numel(), self.world_size, 8), 0, self.world_size)
            dilocos[0].comm_counter.end_round()
        return flat

    @torch.no_grad()
    def _copy_into_buffers(self, flat: torch.Tensor) -> None:
        o = 0
        for b in self._buffers():
            b.copy_(self._mean_as(b, flat, o))
            o += b.numel()


class DiLoCoStrategy(RankShards, DiLoCoFit, BaseDDPStrategy):
    """DDP + :class:`~lightning_onebit.DiLoCo` (see the module docstring).

    Args:
        sync_every, outer_lr, outer_momentum, nesterov, compression, fragments, on_nonfinite, hierarchical,
        overlap, mixing, keep_local, offload:
            DiLoCo's (checked here, before any rank starts). ``None``, the default, is "not set": a
            ``DiLoCo`` returned by ``configure_optimizers`` keeps its own value, and an ``AdamW`` the strategy
            converts gets DiLoCo's default (16, 0.7, 0.9, True, ``"fp32"``, 1, ``"raise"``, automatic, 0, 0.0,
            False, False: the paper's outer step, its state beside the parameters). An option set here must
            equal the returned DiLoCo's, else setup fails naming both. The ranks per node are the trainer's
            devices (unless the DiLoCo has its own), so a compressed outer all-reduce over several nodes of
            several devices runs two-level.
        strict_resume: raise instead of warning when a resume cannot continue each rank's own state exactly:
            another world size or layout, or this rank's shard missing, unreadable or of another save.
        sharding: ``None`` (every rank holds the whole model: DDP) or ``"fsdp"``, which builds a
            :class:`~lightning_onebit.strategies.diloco_fsdp.DiLoCoFSDPStrategy` instead (FSDP2 inside each node;
            the same as ``strategy="diloco_fsdp"``), passing it the other arguments.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes;
            ``gradient_as_bucket_view`` defaults to ``True`` and ``broadcast_buffers`` to ``False``
            (buffers are averaged with the outer steps instead; see the module docstring).
    """

    def __new__(cls, *args: Any, sharding: str | None = None, **kwargs: Any):
        target = sharded_variant(cls.__name__, sharding, _diloco_fsdp, kwargs)
        # (not a subclass: Python does not call __init__ again)
        return super().__new__(cls) if target is None else target(*args, **kwargs)

    def __init__(self, sync_every: int | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, nesterov: bool | None = None, compression: str | None = None,
                 fragments: int | None = None, on_nonfinite: str | None = None, hierarchical: bool | None = None,
                 overlap: int | None = None, mixing: float | None = None, keep_local: bool | None = None,
                 offload: bool | None = None, strict_resume: bool = False, sharding: None = None,
                 **kwargs: Any) -> None:
        check_bool("DiLoCoStrategy", "strict_resume", strict_resume)
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("DiLoCoStrategy installs its own DDP comm hook; ddp_comm_hook cannot be set")
        given = {"sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                 "nesterov": nesterov, "compression": compression, "fragments": fragments,
                 "on_nonfinite": on_nonfinite, "hierarchical": hierarchical, "overlap": overlap,
                 "mixing": mixing, "keep_local": keep_local, "offload": offload}
        #: the options set here (the others are the returned DiLoCo's, or DiLoCo's defaults)
        self.diloco_kwargs = {k: v for k, v in given.items() if v is not None}
        check_diloco_options(self.diloco_kwargs)
        kwargs.setdefault("gradient_as_bucket_view", True)
        kwargs.setdefault("broadcast_buffers", False)
        super().__init__(**kwargs)
        self._average_buffers_too = not kwargs["broadcast_buffers"]
        self.strict_resume = strict_resume
        self._in_anchor: list = []
        self._own_buffers: list[torch.Tensor] | None = None  # this rank's, while validation holds the mean

    def setup_distributed(self) -> None:
        super().setup_distributed()
        enable_duplex()  # gloo: the compressed outer mean at the link's rate both ways (comm.duplex)
        compile_kernels(self.root_device)  # the compressed outer all-reduce's numba kernels, compiled once per host

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if getattr(self.precision_plugin, "scaler", None) is not None:
            # GradScaler skips steps per rank: the ranks' schedules would drift apart and the outer
            # all-reduce would wait forever for a rank that is a step behind
            raise ValueError("strategy 'diloco' does not run with precision='16-mixed' (GradScaler skips steps on "
                             "each rank on its own); use '32-true' or 'bf16-mixed'")
        self._convert_optimizers()
        register_local_hook(self.model)

    # -- checkpoints -------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The anchor as the checkpoint's model (identical on every rank), not this rank's replica."""
        sd = super().lightning_module_state_dict()
        return self._as_anchor(sd)

    # the per-rank shards (strategies/checkpoints.py): what goes in them and where it goes back
    _shard_name = "DiLoCo"
    _section, _marker, _slot, _clock_key = "diloco", "per_rank", "rank_state", "t"
    _reset_note = ("the anchor, outer momentum, clock and counters are kept; this rank starts from the anchor "
                   "(error state zero, rank 0's AdamW moments, or fresh ones if its shard cannot be read either)")

    def _shard_states(self) -> dict[int, Any]:
        """This rank's replica, AdamW state, error state (and, with the first optimizer, its own buffers)."""
        out: dict[int, Any] = {}
        for i, opt in enumerate(self.optimizers):
            if isinstance(opt, DiLoCo):
                out[i] = opt.rank_state_dict()
                if self._average_buffers_too and len(out) == 1:  # the module's buffers, once
                    out[i]["buffers"] = [b.detach().clone() for b in (self._own_buffers or self._buffers())]
        return out

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """What the ranks share (the main file); this rank's own state goes to its shard (``_shard_states``)."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, DiLoCo):
            return super().optimizer_state(optimizer)
        sd = opt.shared_state_dict()
        sd["diloco"] = dict(sd["diloco"], world_size=self.world_size, per_rank="shards")
        return sd

    @staticmethod
    def _layout(two_level: int | None) -> str:
        return "flat" if two_level is None else f"two-level with {two_level} ranks per node"

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank its own replica, moments and error state from its shard, or, on another world size or
        layout, from the anchor with rank 0's moments (see the module docstring). Also reads checkpoints
        that held every rank's state in the main file (``diloco["ranks"]``)."""
        states = list(checkpoint["optimizer_states"])
        if len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(states)} optimizer states, strategy 'diloco' runs "
                             f"{len(self.optimizers)} optimizers")
        plans, changed = [], []
        for opt, st in zip(self.optimizers, states, strict=True):
            section = st.get("diloco") if isinstance(st, dict) else None
            if section is None:
                raise ValueError("this checkpoint's optimizer state was not written by DiLoCo; it cannot be "
                                 "resumed with strategy 'diloco'")
            gathered = section.get("ranks")  # the format before shards: every rank's state in the main file
            if gathered is not None:
                saved_ws, saved_layout = len(gathered), gathered[0]["optimizer"]["diloco"].get("two_level")
            else:
                saved_ws, saved_layout = section.get("world_size"), section.get("two_level")
            fits = saved_ws == self.world_size and saved_layout == opt.two_level()
            if not fits and not changed:
                layouts = "" if saved_layout == opt.two_level() else \
                    f" ({self._layout(saved_layout)} outer all-reduce; this run: {self._layout(opt.two_level())})"
                changed.append(f"checkpoint was written on {saved_ws} ranks, resuming on {self.world_size}{layouts}")
            plans.append((opt, st, section, gathered, saved_ws, fits))
        if changed:
            msg = (f"{changed[0]}: the anchor, the outer momentum, the clock and the counters are kept; every rank "
                   "starts from the anchor (error state zero) with rank 0's AdamW moments")
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            rank_zero_warn(msg)
        for i, (opt, st, section, gathered, saved_ws, fits) in enumerate(plans):
            if gathered is not None:
                if fits:
                    opt.load_local_state(gathered[self.global_rank])
                    self._put_back_buffers(gathered[self.global_rank].get("buffers"))
                else:
                    shared, own = DiLoCo.split_state_dict(gathered[0]["optimizer"])
                    opt.load_split_state_dict(shared, None, inner=own["inner"])
                continue
            shared = {k: v for k, v in st.items() if k != "diloco"}
            shared["diloco"] = {k: v for k, v in section.items() if k != "rank_state"}
            own = section.get("rank_state")  # this rank's shard (load_checkpoint), when it was usable
            if fits and own is not None:
                opt.load_split_state_dict(shared, own)
                self._put_back_buffers(own.get("buffers"))
                continue
            if own is not None and self.global_rank == 0:
                inner = own["inner"]
            else:  # rank 0's moments; fresh ones when its shard cannot be read here
                zero = self._rank_shard(checkpoint, 0, saved_ws)
                inner = zero["optimizers"][i]["inner"] if zero is not None else None
            opt.load_split_state_dict(shared, None, inner=inner)

    @torch.no_grad()
    def _put_back_buffers(self, own: list[torch.Tensor] | None) -> None:
        """This rank's own buffers over the mean the model state gave every rank."""
        if own is not None:
            for b, saved in zip(self._buffers(), own, strict=True):
                b.copy_(saved)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for suffix, start in (("", "popen"), ("_spawn", "spawn"), ("_forkserver", "forkserver")):
            strategy_registry.register("diloco" + suffix, cls, description="DDP with DiLoCo (local AdamW steps, "
                                       "compressed outer updates)", start_method=start, override=True)

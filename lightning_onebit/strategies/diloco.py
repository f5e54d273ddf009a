"""``strategy="diloco"``: DDP whose gradients stay on their rank, for :class:`~lightning_onebit.DiLoCo`.

DDP's allreduce is replaced by a hook that leaves each rank's gradients in place (the inner steps
send nothing); an ``AdamW`` from ``configure_optimizers`` becomes a ``DiLoCo`` with the same
hyperparameters and its LR schedulers follow it. Between outer steps the ranks' replicas differ, so:

* validation evaluates the anchor, the model of the last outer step, identical on every rank (no
  extra round); training resumes on each rank's own replica afterwards;
* a checkpoint's model is the anchor, and its optimizer state holds every rank's replica, AdamW
  moments and error state (gathered to rank 0: about 16 B per parameter and rank on CPU), so a resume
  on the same number of ranks continues bit for bit mid-interval; on another number of ranks it
  starts from the anchor with rank 0's moments (a warning says so);
* the fit's last step (or its end, if stopped early) takes one last outer step over a partial interval,
  so every rank ends on one model;
* buffers (BatchNorm's running statistics, BERT's position ids) stay on their rank too: DDP's
  ``broadcast_buffers`` defaults to ``False`` here (else DDP would broadcast them in every forward, a
  round per inner step), and after every outer step the ranks take their mean (one all-reduce in fp64;
  integer buffers are rounded). Validation and the checkpoint's model use the mean of the ranks'
  current buffers, and the checkpoint's optimizer state keeps every rank's own, so a resume continues
  bit for bit. ``broadcast_buffers=True`` restores DDP's behaviour instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

from ..comm.accounting import ring_allreduce_bytes
from ..comm.ddp_hook import register_local_hook
from ..comm.duplex import enable_duplex
from ..compress.kernels import compile_kernels
from ..optim.diloco import DiLoCo
from .launch import BaseDDPStrategy
from .schedulers import repoint_scheduler

__all__ = ["DiLoCoStrategy"]


class DiLoCoStrategy(BaseDDPStrategy):
    """DDP + :class:`~lightning_onebit.DiLoCo` (see the module docstring).

    Args:
        sync_every, outer_lr, outer_momentum, nesterov, compression, fragments, on_nonfinite, hierarchical,
        overlap, mixing, keep_local:
            DiLoCo's (checked here, before any rank starts). The ranks per node are the trainer's devices,
            so a compressed outer all-reduce over several nodes of several devices runs two-level.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes;
            ``gradient_as_bucket_view`` defaults to ``True`` and ``broadcast_buffers`` to ``False``
            (buffers are averaged with the outer steps instead; see the module docstring).
    """

    def __init__(self, sync_every: int = 16, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, compression: str = "fp32", fragments: int = 1,
                 on_nonfinite: str = "raise", hierarchical: bool | None = None, overlap: int = 0,
                 mixing: float = 0.0, keep_local: bool = False, **kwargs: Any) -> None:
        if kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("DiLoCoStrategy installs its own DDP comm hook; ddp_comm_hook cannot be set")
        kwargs.setdefault("gradient_as_bucket_view", True)
        kwargs.setdefault("broadcast_buffers", False)
        super().__init__(**kwargs)
        self._average_buffers_too = not kwargs["broadcast_buffers"]
        self.diloco_kwargs = {"sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                              "nesterov": nesterov, "compression": compression, "fragments": fragments,
                              "on_nonfinite": on_nonfinite, "hierarchical": hierarchical, "overlap": overlap,
                              "mixing": mixing, "keep_local": keep_local}
        DiLoCo([torch.zeros(1, requires_grad=True)], **self.diloco_kwargs)  # bad options fail here
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

    def _convert_optimizers(self) -> None:
        if not self.optimizers:
            raise ValueError("strategy 'diloco' needs an optimizer; configure_optimizers returned none")
        out = []
        for opt in self.optimizers:
            if isinstance(opt, DiLoCo):
                opt.ranks_per_node = opt.ranks_per_node or self.num_processes
                out.append(opt)
                continue
            try:
                new = DiLoCo.from_optimizer(opt, ranks_per_node=self.num_processes, **self.diloco_kwargs)
            except ValueError as exc:
                raise ValueError(f"strategy 'diloco': {exc}. Return torch.optim.AdamW (or DiLoCo) from "
                                 "configure_optimizers") from exc
            for cfg in self.lr_scheduler_configs:
                repoint_scheduler(cfg.scheduler, opt, new)
            rank_zero_info(f"lightning_onebit: converted {type(opt).__name__} to DiLoCo (same hyperparameters, "
                           f"{self.diloco_kwargs}) for strategy 'diloco'")
            out.append(new)
        self.optimizers = out

    def _dilocos(self) -> list[DiLoCo]:
        return [o for o in self.optimizers if isinstance(o, DiLoCo)]

    # -- one model where one is wanted ---------------------------------------------------------
    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._in_anchor = [opt.anchor_in_params() for opt in self._dilocos()]
            for ctx in self._in_anchor:
                ctx.__enter__()
            mean = self._mean_buffers()
            if mean is not None:
                self._own_buffers = [b.clone() for b in self._buffers()]
                self._copy_into_buffers(mean)

    def on_validation_end(self) -> None:
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
        if not (self._average_buffers_too and bufs and dist.is_available() and dist.is_initialized()
                and self.world_size > 1):
            return None
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in bufs])
        dist.all_reduce(flat)
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

    # -- checkpoints -------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The anchor as the checkpoint's model (identical on every rank), not this rank's replica."""
        sd = super().lightning_module_state_dict()
        views: dict[int, torch.Tensor] = {}
        for opt in self._dilocos():
            views.update(opt.anchor_views())
        for name, p in self.lightning_module.named_parameters():
            if id(p) in views and name in sd:
                sd[name] = views[id(p)].to(p.dtype)
        mean = self._mean_buffers()
        if mean is not None:
            o = 0
            for name, b in self._named_buffers():
                if name in sd:
                    sd[name] = self._mean_as(b, mean, o)
                o += b.numel()
        return sd

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, DiLoCo):
            return super().optimizer_state(optimizer)
        sd = opt.state_dict()
        local = opt.local_state()
        if self._average_buffers_too and opt is self._dilocos()[0]:  # the module's buffers, once
            local["buffers"] = [b.detach().clone() for b in (self._own_buffers or self._buffers())]
        ranks = [local]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, local)
        sd["diloco"] = dict(sd["diloco"], ranks=ranks)
        return sd

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank its own replica, moments and error state (see the module docstring)."""
        for opt, st in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            section = st.get("diloco") if isinstance(st, dict) else None
            if section is None:
                raise ValueError("this checkpoint's optimizer state was not written by DiLoCo; it cannot be "
                                 "resumed with strategy 'diloco'")
            ranks = section.get("ranks") or []
            if len(ranks) == self.world_size:
                opt.load_local_state(ranks[self.global_rank])
                own = ranks[self.global_rank].get("buffers")
                if own is not None:  # the model state gave every rank the mean
                    with torch.no_grad():
                        for b, saved in zip(self._buffers(), own, strict=True):
                            b.copy_(saved)
            else:
                warnings.warn(f"checkpoint was written on {len(ranks)} ranks, resuming on {self.world_size}: every "
                              "rank starts from the anchor with rank 0's AdamW moments", stacklevel=2)
                opt.load_state_dict(ranks[0]["optimizer"])

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for suffix, start in (("", "popen"), ("_spawn", "spawn"), ("_forkserver", "forkserver")):
            strategy_registry.register("diloco" + suffix, cls, description="DDP with DiLoCo (local AdamW steps, "
                                       "compressed outer updates)", start_method=start, override=True)

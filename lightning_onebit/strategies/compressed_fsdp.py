"""``strategy="onebit_adam_fsdp"`` (and ``"qadam_fsdp"``, ``"onebit_lamb_fsdp"``, ``"cd_adam_fsdp"``,
``"zero_one_adam_fsdp"``): FSDP2 inside each node, the compressed optimizer on the shards between nodes.

The mesh, the sharding and the checkpoint directory are :class:`~.fsdp.NodeShardedStrategy`'s. An ``AdamW``
from ``configure_optimizers`` becomes a :class:`~lightning_onebit.ShardedCompressed` of the algorithm with the
same hyperparameters and param groups (LR schedulers follow it): FSDP's reduce-scatter averages the
gradients inside a node, the warm-up averages each shard over the nodes in fp32 (FSDP + AdamW to rounding),
and the compression phase sends each shard's momentum through the two-stage compressed all-reduce, between
the ranks that hold that shard on every node. ``warmup`` is steps or a fraction of the run (``"auto"``,
which reads the variance, would see a different shard on each rank of a node: not offered; CD-Adam compresses
from the first step and has none, 0/1 Adam follows its own schedule). With 0/1 Adam's local steps the nodes'
models part between rounds: the strategy synchronises them before validation, at the end of fit
(:class:`~lightning_onebit.ReplicaSync`) and before a checkpoint, as the unsharded strategy does.

Checkpoints: the model, the moments, the frozen variance (one copy, identical on every node) through
``torch.distributed.checkpoint``, each rank's error state in its own file. On the same mesh a resume is
exact; on another the model, moments, variance and phase reshard and the error state starts at zero, with a
warning (``strict_resume=True``: an error).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..callbacks.phase import DEFAULT_WARMUP, check_warmup, resolve_warmup, set_run_length
from ..callbacks.replicas import ReplicaSync
from ..optim import CompressedOptimizer, ShardedCompressed
from ..optim.sharded import SOUND
from .fsdp import NodeShardedStrategy
from .options import check_choice, check_warmup_kept, checked_optimizer_kwargs, conflict
from .schedulers import repoint_scheduler

__all__ = ["CompressedFSDPStrategy"]


class CompressedFSDPStrategy(NodeShardedStrategy):
    """FSDP2 inside each node + ``algorithm`` on the shards between nodes (see the module docstring).

    Args:
        algorithm: ``"onebit_adam"``, ``"qadam"``, ``"onebit_lamb"``, ``"cd_adam"`` or ``"zero_one_adam"`` (the
            algorithms with a sound sharded form; the others fail here with the reason).
        warmup: steps (an int) or a fraction of the run (a float in (0, 1)) of exact, fp32-averaged warm-up;
            default 0.15. A returned ``ShardedCompressed`` with other ``warmup_steps`` fails at setup naming both.
        optimizer_kwargs: the algorithm's further options (``eps_inside_sqrt``, ``bucket_cap_mb``, ...),
            checked against its signature.
        on_nonfinite: ``"skip"`` (default) or ``"raise"``.
        ranks_per_node, auto_wrap_policy, strict_resume, start_method, process_group_backend, timeout:
            :class:`~lightning_onebit.strategies.fsdp.NodeShardedStrategy`'s.
    """

    _optimizer_type = ShardedCompressed
    _reshard_note = ("the model, the moments, the frozen variance and the phase are resharded; the error state starts "
                     "at zero")
    _lost_note = "their error state starts at zero (the model, moments, variance and phase are the checkpoint's)"

    def __init__(self, algorithm: str = "onebit_adam", warmup: int | float | None = None,
                 optimizer_kwargs: Mapping[str, Any] | None = None, on_nonfinite: str | None = None, *,
                 ranks_per_node: int | None = None, auto_wrap_policy: Iterable[type[nn.Module]] | None = None,
                 strict_resume: bool = False, start_method: str = "popen", process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        owner = type(self).__name__
        if algorithm not in SOUND:
            try:
                ShardedCompressed(algorithm, [], mesh=None)
            except ValueError as exc:  # its reason
                raise ValueError(f"{owner}: {exc}") from None
        if warmup is not None:
            check_warmup(warmup)
            if warmup == "auto":
                raise ValueError(f"{owner}: warmup='auto' reads the variance, which each rank of a node holds a "
                                 "different shard of; give steps or a fraction of the run")
            check_warmup_kept(owner, algorithm, warmup)
        self.optimizer_kwargs = checked_optimizer_kwargs(owner, CompressedOptimizer.algorithms()[algorithm],
                                                         optimizer_kwargs)
        for k in ("group", "simulate_workers", "warmup_steps"):
            if k in self.optimizer_kwargs:
                raise ValueError(f"{owner}: optimizer_kwargs cannot set {k!r} (the mesh sets the group; warmup= "
                                 "the warm-up)")
        if on_nonfinite is not None:
            check_choice(owner, "on_nonfinite", on_nonfinite, ("skip", "raise"))
        super().__init__(ranks_per_node=ranks_per_node, auto_wrap_policy=auto_wrap_policy,
                         strict_resume=strict_resume, start_method=start_method,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.algorithm, self.warmup, self.on_nonfinite = algorithm, warmup, on_nonfinite
        self.strategy_name = f"{algorithm}_fsdp"

    def setup(self, trainer) -> None:
        super().setup(trainer)
        ReplicaSync.ensure(trainer, self.optimizers)  # 0/1 Adam's nodes meet before validation and at the end

    def on_train_start(self) -> None:
        super().on_train_start()
        set_run_length(self.lightning_module.trainer, self.optimizers)  # (0/1 Adam's schedule in fractions)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model as this rank's shards; with local steps pending, the nodes synchronise first (the
        checkpoint is then one model, and a resume continues from it exactly)."""
        for opt in self.optimizers:
            opt.sync_replicas()
        return super().lightning_module_state_dict()

    def _warmup_steps(self) -> int | None:
        if not CompressedOptimizer.algorithms()[self.algorithm].has_warmup:
            return None
        trainer = self.lightning_module.trainer
        return resolve_warmup(DEFAULT_WARMUP if self.warmup is None else self.warmup,
                              trainer.estimated_stepping_batches)

    def _convert_optimizers(self) -> None:
        if not self.optimizers:
            raise ValueError(f"strategy '{self.strategy_name}' needs an optimizer; configure_optimizers returned none")
        owner, out = type(self).__name__, []
        for opt in self.optimizers:
            if isinstance(opt, ShardedCompressed):
                problems = []
                if opt.algorithm != self.algorithm:
                    problems.append(f"strategy '{self.strategy_name}' runs {self.algorithm}; configure_optimizers "
                                    f"returned ShardedCompressed({opt.algorithm!r})")
                if (opt.sharding.nodes, opt.sharding.ranks_per_node) != self.mesh_shape:
                    problems.append(f"strategy '{self.strategy_name}' runs on a {self.mesh_shape} mesh; the returned "
                                    "optimizer's differs: pass mesh=self.device_mesh")
                if self.warmup is not None and opt.warmup_steps != self._warmup_steps():
                    problems.append(conflict(owner, "warmup", self.warmup, "ShardedCompressed",
                                             f"warmup_steps={opt.warmup_steps!r}"))
                if problems:
                    raise ValueError("\n".join(problems))
                out.append(opt)
                continue
            try:
                warmup = self._warmup_steps()
                new = ShardedCompressed.from_optimizer(self.algorithm, opt, mesh=self.device_mesh,
                                                       **({} if warmup is None else {"warmup_steps": warmup}),
                                                       **self.optimizer_kwargs)
            except ValueError as exc:
                raise ValueError(f"strategy '{self.strategy_name}': {exc}. Return torch.optim.AdamW from "
                                 "configure_optimizers") from exc
            for cfg in self.lr_scheduler_configs:
                repoint_scheduler(cfg.scheduler, opt, new)
            rank_zero_info(f"lightning_onebit: converted {type(opt).__name__} to {self.algorithm} on FSDP2 shards "
                           f"(warm-up {new.warmup_steps or 0} steps) for strategy '{self.strategy_name}'")
            out.append(new)
        for opt in out:
            opt.set_nonfinite_policy(self.on_nonfinite or "skip")
        self.optimizers = out

    # -- checkpoints ------------------------------------------------------------------------------------
    def _load_optimizer(self, opt: ShardedCompressed, shared: dict, read: Callable[[dict], None],
                        own: dict | None, node: int) -> None:
        opt.load_sharded_state_dict(shared, read, self._names(opt), own)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for algorithm in SOUND:
            for suffix, start in (("", "popen"), ("_spawn", "spawn"), ("_forkserver", "forkserver")):
                strategy_registry.register(f"{algorithm}_fsdp{suffix}", cls, description=f"FSDP2 inside each node, "
                                           f"{algorithm} on the shards between nodes", algorithm=algorithm,
                                           start_method=start, override=True)

"""``strategy="diloco_fsdp"``: FSDP2 inside each node, :class:`~lightning_onebit.DiLoCo` between nodes.

The ranks form a mesh of nodes x ranks per node (``("node", "shard")``, the ranks per node the trainer's
``devices`` unless ``ranks_per_node`` says otherwise). Inside a node the model is sharded with FSDP2 over
``device_mesh["shard"]``: its all-gathers in forward and reduce-scatters in backward, the inner steps'
only traffic, stay on the node's fast link. Every ``sync_every`` steps the ranks that hold the same shard
on every node average their pseudo-gradients, compressed or not (DiLoCo's outer step), over the slow link:
nothing else crosses it. Each rank keeps the anchor, the outer momentum, the moments and the error state of
its shard only (``docs/design/sharding.md``).

The model is sharded by the user's ``configure_model`` (``fully_shard(block, mesh=self.device_mesh["shard"])``
per block, then the model), or, where that shards nothing, by the strategy: ``fully_shard`` on every module
of a class in ``auto_wrap_policy`` (transformer blocks), then on each direct child of the LightningModule.
An ``AdamW`` from ``configure_optimizers`` becomes a ``DiLoCo`` on this mesh with the same hyperparameters;
validation evaluates the anchor; the fit ends with an outer step; buffers are averaged at outer steps, as
in ``strategy="diloco"``.

Checkpoints are directories written through ``torch.distributed.checkpoint`` (Lightning's sharded
checkpoint layout, ``meta.pt`` last), nothing gathered: the model (the anchor), DiLoCo's anchor, outer
momentum and outer steps in flight (identical on every node: written once), each node's inner moments, and
a file per rank of what only it holds (its replica, its error state, its buffers). A resume on the same mesh
continues bit for bit; on another (``2x2 -> 1x4``, ``2x2 -> 2x1``, ...) the model, the anchor, the outer
momentum and node 0's moments reshard through the checkpoint reader, and every rank starts from the anchor
with its error state zero, with a warning (``strict_resume=True``: an error). A node one of whose ranks has
lost its file starts from the anchor as a whole (its ranks hold shards of one replica).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from ..comm.sharding import like, reshard
from ..optim.diloco import DiLoCo
from .diloco import DiLoCoFit, check_diloco_options
from .fsdp import NodeShardedStrategy

__all__ = ["DiLoCoFSDPStrategy"]

_OWNER = "DiLoCoFSDPStrategy"


class DiLoCoFSDPStrategy(DiLoCoFit, NodeShardedStrategy):
    """FSDP2 inside each node + :class:`~lightning_onebit.DiLoCo` between nodes (see the module docstring).

    Args:
        sync_every, outer_lr, outer_momentum, nesterov, compression, fragments, on_nonfinite, overlap, mixing,
        keep_local, offload: DiLoCo's, as for :class:`~lightning_onebit.DiLoCoStrategy` (``None``: not set; an option
            set here must equal a returned DiLoCo's, else setup fails naming both).
        ranks_per_node, auto_wrap_policy, strict_resume, start_method, process_group_backend, timeout:
            :class:`~lightning_onebit.strategies.fsdp.NodeShardedStrategy`'s.
    """

    strategy_name = "diloco_fsdp"
    _optimizer_type = DiLoCo
    _reshard_note = ("the model, the anchor, the outer momentum and node 0's moments are resharded; every rank starts "
                     "from the anchor with its error state zero")
    _lost_note = "their ranks start from the anchor with their node's moments and the error state zero"

    def __init__(self, sync_every: int | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, nesterov: bool | None = None, compression: str | None = None,
                 fragments: int | None = None, on_nonfinite: str | None = None, overlap: int | None = None,
                 mixing: float | None = None, keep_local: bool | None = None, offload: bool | None = None, *,
                 ranks_per_node: int | None = None,
                 auto_wrap_policy: Iterable[type[nn.Module]] | None = None, strict_resume: bool = False,
                 start_method: str = "popen", process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        given = {"sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                 "nesterov": nesterov, "compression": compression, "fragments": fragments,
                 "on_nonfinite": on_nonfinite, "overlap": overlap, "mixing": mixing, "keep_local": keep_local,
                 "offload": offload}
        #: the options set here (the others are the returned DiLoCo's, or DiLoCo's defaults)
        self.diloco_kwargs = {k: v for k, v in given.items() if v is not None}
        check_diloco_options(self.diloco_kwargs, _OWNER)
        super().__init__(ranks_per_node=ranks_per_node, auto_wrap_policy=auto_wrap_policy,
                         strict_resume=strict_resume, start_method=start_method,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._average_buffers_too = True  # FSDP2 leaves buffers whole on every rank: averaged at outer steps
        self._in_anchor: list = []
        self._own_buffers: list[torch.Tensor] | None = None

    def _layout_kwargs(self) -> dict[str, Any]:
        return {"mesh": self.device_mesh}

    def _adopt(self, opt: DiLoCo) -> None:
        theirs = None if opt.sharding is None else (opt.sharding.nodes, opt.sharding.ranks_per_node)
        if theirs != self.mesh_shape:
            raise ValueError(f"strategy '{self.strategy_name}' runs on {self.mesh_shape[0]} nodes x "
                             f"{self.mesh_shape[1]} ranks; the DiLoCo from configure_optimizers has mesh={theirs}: "
                             "pass mesh=self.device_mesh")

    def _before_param_write(self) -> None:
        reshard(self.lightning_module)  # else FSDP2's root keeps what it gathered for validation (comm.sharding)

    def _own_buffers_now(self) -> list[torch.Tensor]:
        return self._own_buffers or self._buffers()  # this rank's, also while validation holds the mean

    # -- checkpoints ------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model as this rank's shards (DTensors): the anchor, not this node's replica, and the mean of
        the ranks' buffers."""
        return self._as_anchor(self.lightning_module.state_dict(), like)

    def _load_optimizer(self, opt: DiLoCo, shared: dict, read: Callable[[dict], None], own: dict | None,
                        node: int) -> None:
        opt.load_sharded_state_dict(shared, read, self._names(opt), own, node=node)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for suffix, start in (("", "popen"), ("_spawn", "spawn"), ("_forkserver", "forkserver")):
            strategy_registry.register("diloco_fsdp" + suffix, cls, description="FSDP2 inside each node, DiLoCo's "
                                       "compressed outer updates between nodes", start_method=start, override=True)

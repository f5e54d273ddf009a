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

import os
import secrets
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from ..comm.agree import gather_objects
from ..comm.duplex import enable_duplex
from ..comm.sharding import is_sharded, like, load_sharded, node_index, node_mesh, save_sharded, shard_modules
from ..compress import compile_kernels
from ..optim.diloco import DiLoCo
from .diloco import DiLoCoFit, check_diloco_options
from .options import check_bool, check_int

__all__ = ["DiLoCoFSDPStrategy"]

_META = "meta.pt"  # Lightning's name for a sharded checkpoint's metadata file (written last)
_OWNER = "DiLoCoFSDPStrategy"


def _rank_file(path: Path, rank: int, world_size: int) -> Path:
    return path / f"onebit-rank{rank:05d}-of-{world_size:05d}.pt"


class DiLoCoFSDPStrategy(DiLoCoFit, ModelParallelStrategy):
    """FSDP2 inside each node + :class:`~lightning_onebit.DiLoCo` between nodes (see the module docstring).

    Args:
        sync_every, outer_lr, outer_momentum, nesterov, compression, fragments, on_nonfinite, overlap, mixing,
        keep_local: DiLoCo's, as for :class:`~lightning_onebit.DiLoCoStrategy` (``None``: not set; an option
            set here must equal a returned DiLoCo's, else setup fails naming both).
        ranks_per_node: the ranks of one node, over which FSDP shards (default: the trainer's ``devices``);
            must divide the world size. Less than ``devices`` emulates several nodes on one host.
        auto_wrap_policy: module classes to ``fully_shard`` when ``configure_model`` sharded nothing (e.g.
            ``{TransformerBlock}``).
        strict_resume: raise instead of warning when a resume cannot continue each rank exactly (another
            mesh, a rank's file missing, unreadable or of another save).
        process_group_backend, timeout: Lightning's ``ModelParallelStrategy``'s.
    """

    strategy_name = "diloco_fsdp"

    def __init__(self, sync_every: int | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, nesterov: bool | None = None, compression: str | None = None,
                 fragments: int | None = None, on_nonfinite: str | None = None, overlap: int | None = None,
                 mixing: float | None = None, keep_local: bool | None = None, *, ranks_per_node: int | None = None,
                 auto_wrap_policy: Iterable[type[nn.Module]] | None = None, strict_resume: bool = False,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        check_bool(_OWNER, "strict_resume", strict_resume)
        if ranks_per_node is not None:
            check_int(_OWNER, "ranks_per_node", ranks_per_node, minimum=1)
        policy = tuple(auto_wrap_policy or ())
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ValueError(f"{_OWNER}: auto_wrap_policy takes nn.Module classes (the blocks to shard), got {bad!r}")
        given = {"sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                 "nesterov": nesterov, "compression": compression, "fragments": fragments,
                 "on_nonfinite": on_nonfinite, "overlap": overlap, "mixing": mixing, "keep_local": keep_local}
        #: the options set here (the others are the returned DiLoCo's, or DiLoCo's defaults)
        self.diloco_kwargs = {k: v for k, v in given.items() if v is not None}
        check_diloco_options(self.diloco_kwargs, _OWNER)
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.ranks_per_node, self.auto_wrap_policy, self.strict_resume = ranks_per_node, policy, strict_resume
        self._average_buffers_too = True  # FSDP2 leaves buffers whole on every rank: averaged at outer steps
        self._in_anchor: list = []
        self._own_buffers: list[torch.Tensor] | None = None

    # -- the mesh and the model ----------------------------------------------------------------------
    def setup_environment(self) -> None:
        self._setup_distributed()  # the accelerator's device and the process group (ModelParallelStrategy's)
        per_node = self.ranks_per_node or self.num_processes
        self._device_mesh = node_mesh(self.world_size, per_node, self.root_device,
                                      who=f"strategy '{self.strategy_name}'")
        self.lightning_module._device_mesh = self._device_mesh  # what configure_model shards over
        enable_duplex()
        compile_kernels(self.root_device)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank its own batches: FSDP is data parallel inside a node, DiLoCo across nodes
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer) -> None:
        """ModelParallelStrategy's setup, sharding by ``auto_wrap_policy`` where ``configure_model`` did not
        and converting the optimizers."""
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"strategy '{self.strategy_name}' does not run with precision='16-mixed' (GradScaler "
                             "skips steps on each node on its own); use '32-true' or 'bf16-mixed'")
        self._shard_model()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
            self._convert_optimizers()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_model(self) -> None:
        module = self.lightning_module
        params = list(module.parameters())
        if any(is_sharded(p) for p in params):
            return  # configure_model sharded it (DiLoCo checks that it sharded every parameter, over this mesh)
        if not self.auto_wrap_policy:
            raise ValueError(f"strategy '{self.strategy_name}': no parameter is sharded. Apply fully_shard(block, "
                             "mesh=self.device_mesh['shard']) to each block and then to the model in "
                             f"configure_model(), or give {_OWNER}(auto_wrap_policy={{Block}}) with your block classes")
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"strategy '{self.strategy_name}': parameters {own} sit on the LightningModule itself, "
                             "which auto_wrap_policy does not shard; put them in a submodule, or shard in "
                             "configure_model()")
        shard_modules(module, self.device_mesh, self.auto_wrap_policy)

    def _layout_kwargs(self) -> dict[str, Any]:
        return {"mesh": self.device_mesh}

    def _adopt(self, opt: DiLoCo) -> None:
        mine = (self.device_mesh.size(0), self.device_mesh.size(1))
        theirs = None if opt.sharding is None else (opt.sharding.nodes, opt.sharding.ranks_per_node)
        if theirs != mine:
            raise ValueError(f"strategy '{self.strategy_name}' runs on {mine[0]} nodes x {mine[1]} ranks; the DiLoCo "
                             f"from configure_optimizers has mesh={theirs}: pass mesh=self.device_mesh")

    # -- checkpoints ------------------------------------------------------------------------------------
    def _names(self, opt: DiLoCo) -> list[str]:
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [names[id(p)] for g in opt.param_groups for p in g["params"]]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model as this rank's shards (DTensors): the anchor, not this node's replica, and the mean of
        the ranks' buffers."""
        sd = self.lightning_module.state_dict()
        views: dict[int, torch.Tensor] = {}
        for opt in self._dilocos():
            views.update(opt.anchor_views())
        for name, p in self.lightning_module.named_parameters():
            if id(p) in views and name in sd:
                sd[name] = like(p, views[id(p)].to(p.dtype))
        mean = self._mean_buffers()
        if mean is not None:
            o = 0
            for name, b in self._named_buffers():
                if name in sd:
                    sd[name] = self._mean_as(b, mean, o)
                o += b.numel()
        return sd

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, DiLoCo):
            raise ValueError(f"strategy '{self.strategy_name}' checkpoints DiLoCo optimizers only, got "
                             f"{type(opt).__name__}")
        tensors, shared, own = opt.sharded_state_dict(self._names(opt))
        return {"tensors": tensors, "shared": shared, "own": own}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Every rank writes its shards (``torch.distributed.checkpoint``) and its own file; rank 0 the
        metadata, last."""
        if storage_options is not None:
            raise TypeError(f"{_OWNER}.save_checkpoint does not take storage_options (it writes through "
                            "torch.distributed.checkpoint, not a CheckpointIO)")
        path = Path(self.broadcast(filepath))
        save_id = self.broadcast(secrets.token_hex(8))
        if self.is_global_zero and path.is_file():
            path.unlink()
        self.barrier()
        path.mkdir(parents=True, exist_ok=True)
        states = checkpoint.pop("optimizer_states", [])
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": st["tensors"] for i, st in enumerate(states)})
        mine = _rank_file(path, self.global_rank, self.world_size)
        own = {"save_id": save_id, "optimizers": [st["own"] for st in states],
               "buffers": [b.detach().clone() for b in (self._own_buffers or self._buffers())]}
        torch.save(own, str(mine) + ".tmp")
        os.replace(str(mine) + ".tmp", mine)
        save_sharded(tensors, str(path))  # collective: when it returns every rank has written
        if self.is_global_zero:
            checkpoint["lightning_onebit"] = {
                "strategy": self.strategy_name, "save_id": save_id, "world_size": self.world_size,
                "mesh": (self.device_mesh.size(0), self.device_mesh.size(1)),
                "optimizers": [st["shared"] for st in states]}
            torch.save(checkpoint, str(path / _META) + ".tmp")
            os.replace(str(path / _META) + ".tmp", path / _META)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The model, the optimizers and this rank's own state from a directory :meth:`save_checkpoint`
        wrote; Lightning's metadata (loops, callbacks, LR schedulers) returned."""
        path = Path(self.broadcast(checkpoint_path))
        checkpoint, mine = self._read_meta(path)
        here = (self.device_mesh.size(0), self.device_mesh.size(1))
        same = tuple(mine["mesh"]) == here and mine["world_size"] == self.world_size
        own, why = self._read_own(path, mine["save_id"]) if same else (None, None)
        # a node's ranks hold shards of one replica: all of them continue exactly, or all start from the anchor
        usable = gather_objects(own is not None)
        node_size = here[1]
        node_ok = same and all(usable[r] for r in range(self.global_rank // node_size * node_size,
                                                       (self.global_rank // node_size + 1) * node_size))
        if not same:
            msg = (f"checkpoint {path} was written on {mine['mesh'][0]} nodes x {mine['mesh'][1]} ranks, resuming on "
                   f"{here[0]} x {here[1]}: the model, the anchor, the outer momentum and node 0's moments are "
                   "resharded; every rank starts from the anchor with its error state zero")
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            rank_zero_warn(msg)
        elif not all(usable):
            lost = [r for r, ok in enumerate(usable) if not ok]
            msg = (f"checkpoint {path}: the own state of ranks {lost} is missing or unreadable"
                   + (f" (here: {why})" if why else "") + "; their nodes start from the anchor with their moments "
                   "and the error state zero")
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            rank_zero_warn(msg)
        load_sharded({"state_dict": self.lightning_module.state_dict()}, str(path))  # the anchor, the mean buffers
        for i, (opt, shared) in enumerate(zip(self.optimizers, mine["optimizers"], strict=True)):
            key = f"optimizer_{i}"
            opt.load_sharded_state_dict(shared, lambda t, key=key: load_sharded({key: t}, str(path)), self._names(opt),
                                        own["optimizers"][i] if node_ok else None,
                                        node=node_index(self.device_mesh) if same else 0)
        if node_ok:
            with torch.no_grad():
                for b, saved in zip(self._buffers(), own["buffers"], strict=True):
                    b.copy_(saved)
        return checkpoint

    def _read_meta(self, path: Path) -> tuple[dict, dict]:
        if path.is_file():
            raise ValueError(f"strategy '{self.strategy_name}' resumes from the checkpoint directories it writes; "
                             f"{path} is a single file (an unsharded strategy's, e.g. 'diloco'): resume it with that "
                             "strategy, or load its weights into the model before fully_shard")
        if not (path / _META).is_file():
            raise FileNotFoundError(f"{path} holds no {_META}: not a complete sharded checkpoint (a save that did not "
                                    "finish, or not a checkpoint directory)")
        checkpoint = torch.load(path / _META, map_location="cpu", weights_only=False)
        mine = checkpoint.pop("lightning_onebit", None)
        if mine is None:
            raise ValueError(f"{path} is a sharded checkpoint of another strategy (no DiLoCo state); strategy "
                             f"'{self.strategy_name}' resumes its own")
        if len(mine["optimizers"]) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds {len(mine['optimizers'])} optimizer states, strategy "
                             f"'{self.strategy_name}' runs {len(self.optimizers)} optimizers")
        return checkpoint, mine

    def _read_own(self, path: Path, save_id: str) -> tuple[dict | None, str | None]:
        """This rank's file of this save, or ``None`` and why not."""
        f = _rank_file(path, self.global_rank, self.world_size)
        try:
            own = torch.load(f, map_location="cpu", weights_only=False)
        except FileNotFoundError:
            return None, f"rank {self.global_rank}: {f.name} is missing"
        except Exception as exc:  # a torn or foreign file
            return None, f"rank {self.global_rank}: {f.name} is unreadable ({type(exc).__name__})"
        if own.get("save_id") != save_id:
            return None, f"rank {self.global_rank}: {f.name} is of another save"
        return own, None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("diloco_fsdp", cls, description="FSDP2 inside each node, DiLoCo's compressed "
                                   "outer updates between nodes", override=True)

"""The base of the sharded strategies: FSDP2 inside each node, the package's mean between nodes.

:class:`NodeShardedStrategy` is Lightning's ``ModelParallelStrategy`` with the package's layout: a mesh of
nodes x ranks per node (``("node", "shard")``, the ranks per node the trainer's ``devices`` unless
``ranks_per_node`` says otherwise), the model sharded with FSDP2 over ``device_mesh["shard"]`` by the user's
``configure_model`` or by ``auto_wrap_policy``, every rank its own batches, and checkpoints as directories:

::

    <dir>/.metadata, __<rank>_0.distcp         # torch.distributed.checkpoint: every rank's shards, resharded on load
    <dir>/onebit-rank<r>-of-<world>.pt         # what only rank r holds (its error state, its buffers)
    <dir>/meta.pt                              # rank 0, last: Lightning's loops and callbacks, the mesh, the save id

Nothing is gathered. A subclass says what its optimizers put in each part (``optimizer_state`` returns
``{"tensors", "shared", "own"}``) and how they come back (``_load_optimizer``). On the same mesh every
rank gets its own file back; on another, or where a rank of a node has lost its file, the node's ranks
load without it (every rank of a node holds a shard of one replica, so they agree first), with a warning
(``strict_resume=True``: an error on every rank).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from ..comm.agree import gather_objects, is_distributed
from ..comm.duplex import enable_duplex
from ..comm.process_group import init_for_attempt
from ..comm.sharding import (
    count_fsdp_bytes,
    full_state_dict,
    is_sharded,
    load_sharded,
    node_index,
    node_mesh,
    save_sharded,
    shard_modules,
)
from ..compress import compile_kernels
from .launch import _ForkserverLauncher, destroy_process_group_at_exit
from .options import check_bool, check_choice, check_int

__all__ = ["NodeShardedStrategy"]

_META = "meta.pt"  # Lightning's name for a sharded checkpoint's metadata file (written last)


def _rank_file(path: Path, rank: int, world_size: int) -> Path:
    return path / f"onebit-rank{rank:05d}-of-{world_size:05d}.pt"


class _WholeModelBack:
    """Mixin of a multiprocessing launcher: rank 0 hands the launching process the model whole (its shards
    gathered on every rank first), which that process's unsharded module loads, as after a DDP fit."""

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        whole = full_state_dict(module.state_dict())  # a collective: on every rank, before rank 0 returns
        original = module.state_dict
        module.state_dict = lambda *a, **k: whole  # what the base saves for the launching process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            module.state_dict = original


class _ShardedForkserverLauncher(_WholeModelBack, _ForkserverLauncher):
    pass


class _ShardedSpawnLauncher(_WholeModelBack, _MultiProcessingLauncher):
    pass


class NodeShardedStrategy(ModelParallelStrategy):
    """FSDP2 over the ranks of each node (see the module docstring); subclasses add the optimizer.

    Args:
        ranks_per_node: the ranks of one node, over which FSDP shards (default: the trainer's ``devices``);
            must divide the world size. Less than ``devices`` emulates several nodes on one host.
        auto_wrap_policy: module classes to ``fully_shard`` when ``configure_model`` sharded nothing (e.g.
            ``{TransformerBlock}``); each direct child of the LightningModule is then sharded as a whole.
        strict_resume: raise instead of warning when a resume cannot continue each rank exactly (another
            mesh, a rank's file missing, unreadable or of another save).
        start_method: how the trainer starts its ranks when no launcher did (``torchrun``, a cluster):
            ``"popen"`` (Lightning's: the script again per rank), ``"spawn"`` or ``"forkserver"`` (the package's
            sound forkserver, as for the DDP strategies); the launching process gets the model whole back.
        process_group_backend, timeout: Lightning's ``ModelParallelStrategy``'s.
    """

    strategy_name = "fsdp"
    #: what a resume on another mesh keeps and resets, for its warning
    _reshard_note = "the model is resharded"
    #: what the nodes of ranks whose own file is lost keep and reset, for its warning
    _lost_note = "they start without it"

    def __init__(self, *, ranks_per_node: int | None = None, auto_wrap_policy: Iterable[type[nn.Module]] | None = None,
                 strict_resume: bool = False, start_method: str = "popen", process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        owner = type(self).__name__
        check_bool(owner, "strict_resume", strict_resume)
        check_choice(owner, "start_method", start_method, ("popen", "spawn", "forkserver"))
        if ranks_per_node is not None:
            check_int(owner, "ranks_per_node", ranks_per_node, minimum=1)
        policy = tuple(auto_wrap_policy or ())
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ValueError(f"{owner}: auto_wrap_policy takes nn.Module classes (the blocks to shard), got {bad!r}")
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.ranks_per_node, self.auto_wrap_policy, self.strict_resume = ranks_per_node, policy, strict_resume
        self._start_method = start_method

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # Lightning's script launcher, unless the processes exist already
        if self._launcher is not None and self._start_method != "popen":
            cls = _ShardedForkserverLauncher if self._start_method == "forkserver" else _ShardedSpawnLauncher
            self._launcher = cls(self, start_method=self._start_method)

    # -- the mesh and the model ----------------------------------------------------------------------
    def _setup_distributed(self) -> None:
        # under torchrun --max-restarts: the group in this attempt's keys (comm.process_group), then
        # ModelParallelStrategy's, which finds it started
        if not is_distributed():
            self.set_world_ranks()
            init_for_attempt(self._get_process_group_backend(), rank=self.global_rank, world_size=self.world_size,
                             timeout=self._timeout, device=self.root_device)
        super()._setup_distributed()
        destroy_process_group_at_exit()

    def setup_environment(self) -> None:
        self._setup_distributed()  # the accelerator's device and the process group (ModelParallelStrategy's)
        per_node = self.ranks_per_node or self.num_processes
        self._device_mesh = node_mesh(self.world_size, per_node, self.root_device,
                                      who=f"strategy '{self.strategy_name}'")
        self.lightning_module._device_mesh = self._device_mesh  # what configure_model shards over
        enable_duplex()
        compile_kernels(self.root_device)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(nodes, ranks per node)."""
        return self.device_mesh.size(0), self.device_mesh.size(1)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank its own batches: FSDP is data parallel inside a node, the package's mean across nodes
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer) -> None:
        """ModelParallelStrategy's setup, sharding by ``auto_wrap_policy`` where ``configure_model`` did not
        and converting the optimizers (``_convert_optimizers``)."""
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
            self._count_fsdp_bytes()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _convert_optimizers(self) -> None:
        raise NotImplementedError

    def _count_fsdp_bytes(self) -> None:
        """FSDP's own traffic inside the node (its all-gathers and reduce-scatters) counted in the optimizers'
        ``intra_node_counter``, each FSDP module's in the one that owns its parameters: what
        ``CommunicationMonitor`` logs as ``comm/intra_node_bytes_step``."""
        owners = {id(p): opt.intra_node_counter for opt in self.optimizers if hasattr(opt, "intra_node_counter")
                  for g in opt.param_groups for p in g["params"]}
        if not owners:
            return
        first = next(iter(owners.values()))
        count_fsdp_bytes(self.lightning_module,
                         lambda m: next((owners[id(p)] for p in m.parameters() if id(p) in owners), first))

    def _shard_model(self) -> None:
        module = self.lightning_module
        if any(is_sharded(p) for p in module.parameters()):
            return  # configure_model sharded it (the optimizer checks every parameter, over this mesh)
        if not self.auto_wrap_policy:
            raise ValueError(f"strategy '{self.strategy_name}': no parameter is sharded. Apply fully_shard(block, "
                             "mesh=self.device_mesh['shard']) to each block and then to the model in "
                             f"configure_model(), or give {type(self).__name__}(auto_wrap_policy={{Block}}) with your "
                             "block classes")
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"strategy '{self.strategy_name}': parameters {own} sit on the LightningModule itself, "
                             "which auto_wrap_policy does not shard; put them in a submodule, or shard in "
                             "configure_model()")
        shard_modules(module, self.device_mesh, self.auto_wrap_policy)

    def _names(self, opt: Optimizer) -> list[str]:
        """The names (``named_parameters()``) of ``opt``'s parameters, in its param groups' order."""
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [names[id(p)] for g in opt.param_groups for p in g["params"]]

    def _own_buffers_now(self) -> list[torch.Tensor]:
        return [b for _, b in self.lightning_module.named_buffers()]

    # -- checkpoints ------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model as this rank's shards (DTensors; FSDP2's own state dict)."""
        return self.lightning_module.state_dict()

    #: the optimizer class this strategy checkpoints (its ``sharded_state_dict`` and ``load_sharded_state_dict``)
    _optimizer_type: type = Optimizer

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``{"tensors": ..., "shared": ..., "own": ...}`` of ``optimizer`` (see the module docstring)."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(opt, self._optimizer_type):
            raise ValueError(f"strategy '{self.strategy_name}' checkpoints {self._optimizer_type.__name__} optimizers "
                             f"only, got {type(opt).__name__}")
        tensors, shared, own = opt.sharded_state_dict(self._names(opt))
        return {"tensors": tensors, "shared": shared, "own": own}

    def _load_optimizer(self, opt: Optimizer, shared: dict, read: Callable[[dict], None], own: dict | None,
                        node: int) -> None:
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Every rank writes its shards (``torch.distributed.checkpoint``) and its own file; rank 0 the
        metadata, last."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes "
                            "through torch.distributed.checkpoint, not a CheckpointIO)")
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
               "buffers": [b.detach().clone() for b in self._own_buffers_now()]}
        torch.save(own, str(mine) + ".tmp")
        os.replace(str(mine) + ".tmp", mine)
        save_sharded(tensors, str(path))  # collective: when it returns every rank has written
        if self.is_global_zero:
            checkpoint["lightning_onebit"] = {"strategy": self.strategy_name, "save_id": save_id,
                                              "world_size": self.world_size, "mesh": self.mesh_shape,
                                              "optimizers": [st["shared"] for st in states]}
            torch.save(checkpoint, str(path / _META) + ".tmp")
            os.replace(str(path / _META) + ".tmp", path / _META)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The model, the optimizers and this rank's own state from a directory :meth:`save_checkpoint`
        wrote; Lightning's metadata (loops, callbacks, LR schedulers) returned."""
        path = Path(self.broadcast(checkpoint_path))
        checkpoint, mine = self._read_meta(path)
        here = self.mesh_shape
        same = tuple(mine["mesh"]) == here and mine["world_size"] == self.world_size
        own, why = self._read_own(path, mine["save_id"]) if same else (None, None)
        # a node's ranks hold shards of one replica: all of them continue exactly, or none does
        usable = gather_objects(own is not None)
        first = self.global_rank // here[1] * here[1]
        node_ok = same and all(usable[first:first + here[1]])
        msg = None
        if not same:
            msg = (f"checkpoint {path} was written on {mine['mesh'][0]} nodes x {mine['mesh'][1]} ranks, resuming on "
                   f"{here[0]} x {here[1]}: {self._reshard_note}")
        elif not all(usable):
            lost = [r for r, ok in enumerate(usable) if not ok]
            msg = (f"checkpoint {path}: the own state of ranks {lost} is missing, unreadable or of another save"
                   + (f" ({why})" if why else "") + "; the nodes of those ranks load without it: "
                   + self._lost_note)
        if msg is not None:
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            rank_zero_warn(msg)
        load_sharded({"state_dict": self.lightning_module.state_dict()}, str(path))
        node = node_index(self.device_mesh) if same else 0
        for i, (opt, shared) in enumerate(zip(self.optimizers, mine["optimizers"], strict=True)):
            key = f"optimizer_{i}"
            self._load_optimizer(opt, shared, lambda t, key=key: load_sharded({key: t}, str(path)),
                                 own["optimizers"][i] if node_ok else None, node)
        if node_ok:
            with torch.no_grad():
                for b, saved in zip(self._own_buffers_now(), own["buffers"], strict=True):
                    b.copy_(saved)
        return checkpoint

    def _read_meta(self, path: Path) -> tuple[dict, dict]:
        if path.is_file():
            raise ValueError(f"strategy '{self.strategy_name}' resumes from the checkpoint directories it writes; "
                             f"{path} is a single file (an unsharded strategy's, e.g. 'diloco' or 'onebit_adam'): "
                             "resume it with that strategy, or load its weights into the model before fully_shard")
        if not (path / _META).is_file():
            raise FileNotFoundError(f"{path} holds no {_META}: not a complete sharded checkpoint (a save that did not "
                                    "finish, or not a checkpoint directory)")
        checkpoint = torch.load(path / _META, map_location="cpu", weights_only=False)
        mine = checkpoint.pop("lightning_onebit", None)
        if mine is None or mine.get("strategy") != self.strategy_name:
            wrote = "another strategy" if mine is None else f"strategy '{mine.get('strategy')}'"
            raise ValueError(f"{path} is a sharded checkpoint of {wrote}; strategy '{self.strategy_name}' resumes its "
                             "own")
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
        if not isinstance(own, dict) or own.get("save_id") != save_id:
            return None, f"rank {self.global_rank}: {f.name} is of another save"
        return own, None

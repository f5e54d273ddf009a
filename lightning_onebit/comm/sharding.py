"""Sharded parameters (FSDP2's DTensors) on a 2-D mesh of nodes x ranks per node.

The layout: a :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(nodes, ranks per node)``.
FSDP2 shards every parameter over the inner dimension (``fully_shard(module, mesh=mesh[inner])``), so
its all-gather in forward and its reduce-scatter in backward stay inside a node (the fast link). The
package's mean runs over the outer dimension only: the rank that holds shard k of node a talks to the
ranks that hold shard k of the other nodes (the slow link), one process group per shard index, and
every member of such a group holds a shard of the same size. Not HSDP: FSDP is never given the outer
dimension, so it all-reduces nothing across nodes.

:class:`ShardedLayout` is what an optimizer needs of it: the two groups, the local shards it keeps its
state for (``local``), and the checks that fail at setup on what does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .accounting import ByteCounter
from .agree import gather_objects
from .dense import all_gather_rows, any_across

__all__ = ["ShardedLayout", "count_fsdp_bytes", "full_state_dict", "is_sharded", "like", "load_sharded", "local",
           "node_index", "node_mesh", "reshard", "save_sharded", "saved_keys", "shard_modules", "sharded_kind"]


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing can be sharded
        return None
    return DTensor


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter or its gradient)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def sharded_kind(t: torch.Tensor) -> str | None:
    """How ``t`` is sharded, in words, if it is: an FSDP2 parameter (a DTensor) or FSDP1's flat parameter."""
    if is_sharded(t):
        return "sharded (a DTensor: FSDP2 or tensor parallelism)"
    if type(t).__name__ == "FlatParameter" or getattr(t, "_is_flat_param", False):
        return "an FSDP flat parameter (Lightning's FSDPStrategy or torch's FullyShardedDataParallel)"
    if getattr(t, "_fsdp_flattened", False):  # FSDP1 with use_orig_params=True (Lightning's default): a view of one
        return ("a view of an FSDP flat parameter (use_orig_params=True: Lightning's FSDPStrategy or torch's "
                "FullyShardedDataParallel)")
    return None


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of ``t`` (a plain tensor, sharing its memory: an in-place write under
    ``no_grad`` changes the parameter); ``t`` itself where it is not sharded."""
    return t.to_local() if t is not None and is_sharded(t) else t


class ShardedLayout:
    """The 2-D mesh of nodes x ranks per node, as an optimizer of sharded parameters sees it.

    Args:
        mesh: a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(nodes, ranks per
            node)``, the parameters sharded with FSDP2 over its inner dimension (``mesh[1]`` or
            ``mesh[name]``).
        who: the optimizer's name, for errors.
    """

    def __init__(self, mesh, *, who: str = "optimizer") -> None:
        ndim = getattr(mesh, "ndim", None)
        if ndim != 2:
            raise ValueError(f"{who}: mesh must be a 2-D DeviceMesh of (nodes, ranks per node), e.g. "
                             "init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('node', 'shard')); "
                             f"got {type(mesh).__name__}" + (f" with {ndim} dimensions" if ndim is not None else ""))
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(f"{who}: the mesh needs dimension names (init_device_mesh(..., mesh_dim_names=('node', "
                             "'shard'))): FSDP is given its inner dimension by name, mesh['shard']")
        self.mesh, self.who = mesh, who
        self.inner = mesh[names[1]]
        #: the ranks of this rank's node, over which FSDP shards (the fast link)
        self.shard_group = mesh.get_group(1)
        #: the ranks holding this rank's shard index on every node: the package's mean runs here
        self.replica_group = mesh.get_group(0)
        self.nodes, self.ranks_per_node = mesh.size(0), mesh.size(1)

    def check_params(self, params: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
        """Every trainable parameter is sharded over the mesh's inner dimension; raise naming the first that
        is not (it would be replicated inside a node with no one averaging its gradients there)."""
        for i, p in enumerate(params):
            what = names[i] if names is not None else f"parameter {i} (shape {tuple(p.shape)})"
            if not is_sharded(p):
                raise ValueError(f"{self.who}: {what} is not sharded, but a mesh was given; apply "
                                 "fully_shard(module, mesh=mesh[1]) to every module with parameters (the root "
                                 "module too), or drop mesh= for a replicated model")
            if p.device_mesh != self.inner:
                raise ValueError(f"{self.who}: {what} is sharded over {p.device_mesh}, not over the mesh's inner "
                                 f"dimension {self.inner}: fully_shard(module, mesh=mesh[1]) shards inside a node "
                                 "(a 2-D mesh given to fully_shard is HSDP, whose dense all-reduce between nodes "
                                 "this layout replaces)")

    def check_sizes(self, numel: int) -> None:
        """Every rank of this rank's replica group holds ``numel`` elements (the same model and mesh on every
        node); raises on every rank of the group otherwise, instead of a collective of mismatched sizes."""
        got = gather_objects(int(numel), group=self.replica_group)  # NCCL or gloo alike
        if len(set(got)) != 1:
            raise ValueError(f"{self.who}: the ranks holding this shard on each node hold {got} elements; every "
                             "node must build the same model and shard it over a mesh of the same shape")

    def any_in_node(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` (a 0-d or 1-element bool tensor) is set on some rank of this rank's node: the
        node's ranks hold shards of one model, so they take or skip an inner step together."""
        return bool(any_across(flag.reshape(1), self.shard_group)[0])  # on the flag's device (NCCL: a GPU)

    def whole_tensor_stats(self, sums: torch.Tensor, maxima: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor statistics of the whole tensors from those of this rank's shards: ``sums`` (e.g. squared
        norms, element counts) added and ``maxima`` maxed over the node's ranks (1-D fp32 tensors of the same
        lengths on every rank of the node). One all-gather on the fast link, reduced here in rank order, so
        every rank of the node gets the same bits."""
        row = torch.cat([sums.reshape(-1).float(), maxima.reshape(-1).float()])
        rows = torch.empty((self.ranks_per_node, row.numel()), dtype=row.dtype, device=row.device)
        all_gather_rows(rows, row, group=self.shard_group)
        return rows[:, :sums.numel()].sum(0), rows[:, sums.numel():].amax(0)

    def __repr__(self) -> str:
        return f"ShardedLayout({self.nodes} nodes x {self.ranks_per_node} ranks)"



def node_mesh(world_size: int, ranks_per_node: int, device: torch.device, *, who: str = "strategy"):
    """The 2-D mesh ``(nodes, ranks per node)`` with dimensions ``("node", "shard")``: consecutive ranks form
    a node (as launchers number them). Raises naming both numbers when ``ranks_per_node`` does not divide
    the world (every rank computes the same, so every rank raises before any collective)."""
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1 \
            or world_size % ranks_per_node:
        raise ValueError(f"{who}: ranks_per_node={ranks_per_node!r} does not divide the world of {world_size} ranks; "
                         "give the ranks of one node (its devices), so that nodes x ranks_per_node = world size")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // ranks_per_node, ranks_per_node),
                            mesh_dim_names=("node", "shard"))


def node_index(mesh) -> int:
    """This rank's node: its coordinate on the mesh's outer dimension."""
    return int(mesh.get_coordinate()[0])


def like(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (this rank's part, shaped as ``local(param)``) as a tensor sharded as ``param`` is: a DTensor
    over its mesh and placements sharing ``shard``'s memory, so that a checkpoint reader writes into it and
    ``torch.distributed.checkpoint`` can reshard it; ``shard`` itself where ``param`` is not sharded."""
    if not is_sharded(param):
        return shard
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def save_sharded(state: dict, path: str) -> None:
    """``torch.distributed.checkpoint.save``: every rank writes its own shards of ``state`` under ``path``
    (a directory), nothing gathered; a DTensor's shards held on several ranks alike are written once."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)


def load_sharded(state: dict, path: str) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` in place: every tensor of ``state`` gets its part
    of what was saved under the same key, resharded to its own layout (a DTensor's shards of another mesh)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path)


def saved_keys(path: str) -> set[str]:
    """The flattened keys of what :func:`save_sharded` wrote under ``path`` (``a.b.c``), read from its
    metadata file (no collective)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def shard_modules(module: torch.nn.Module, mesh, classes: tuple[type[torch.nn.Module], ...]) -> int:
    """FSDP2 over the mesh's inner dimension: ``fully_shard`` on every submodule of ``module`` of one of
    ``classes`` (inner ones first, as FSDP2 wants), then on each direct child that still holds unsharded
    parameters (``module`` itself stays a plain module: a LightningModule). Returns how many blocks."""
    from torch.distributed.fsdp import fully_shard

    inner = mesh[mesh.mesh_dim_names[1]]
    blocks = [m for m in module.modules() if isinstance(m, classes) and m is not module]
    for m in reversed(blocks):  # modules() lists parents first
        fully_shard(m, mesh=inner)
    for child in module.children():
        if any(not is_sharded(p) for p in child.parameters()):
            fully_shard(child, mesh=inner)
    return len(blocks)


def full_state_dict(state: dict) -> dict:
    """``state`` (a module's state dict) with every sharded tensor gathered whole on this rank (a collective
    over each tensor's mesh: every rank of it calls it); other entries as they are."""
    return {k: v.full_tensor() if is_sharded(v) else v for k, v in state.items()}


def reshard(module: torch.nn.Module) -> int:
    """Free every FSDP2 module's gathered parameters in ``module`` (``FSDPModule.reshard``), so that the next
    forward gathers them from the shards again. FSDP2 keeps the root's gathered after a forward without a
    backward (validation), and a later forward uses them as they are: whoever writes into the shards outside
    a training step (DiLoCo's anchor swapped in and out for validation) reshards first. Returns how many."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.reshard()
    return len(mods)


def _counting_comms():
    """FSDP2's default all-gather and reduce-scatter, subclassed to count what a rank sends (None where this
    torch has no custom-comm API: then FSDP's bytes go uncounted)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None

    class CountingAllGather(DefaultAllGather):
        """A ring all-gather: a rank sends its shard to each of the other ``L - 1``."""

        def __init__(self, counter: ByteCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            n = group.size()
            self.counter.add(input_tensor.numel() * input_tensor.element_size() * (n - 1), 0, n)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        """A ring reduce-scatter: a rank sends ``L - 1`` of the ``L`` chunks of its input."""

        def __init__(self, counter: ByteCounter) -> None:
            self.counter = counter

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            n = group.size()
            self.counter.add(input_tensor.numel() * input_tensor.element_size() * (n - 1) // n, 0, n)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    return CountingAllGather, CountingReduceScatter


def count_fsdp_bytes(module: torch.nn.Module, counter_of) -> int:
    """Count the bytes FSDP2's all-gathers and reduce-scatters send from this rank (inside the node) in
    ``counter_of(fsdp_module)``'s :class:`~.accounting.ByteCounter`, through FSDP2's custom-comm hooks (the
    default collectives, counted: the same calls and bits). Returns how many FSDP modules count (0 on a torch
    without those hooks)."""
    from torch.distributed.fsdp import FSDPModule

    comms = _counting_comms()
    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if comms is None or not hasattr(FSDPModule, "set_custom_all_gather"):
        return 0
    gather, scatter = comms
    for m in mods:
        counter = counter_of(m)
        m.set_custom_all_gather(gather(counter))
        m.set_custom_reduce_scatter(scatter(counter))
    return len(mods)

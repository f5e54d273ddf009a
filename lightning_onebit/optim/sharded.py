r"""The Adam family on a sharded model: FSDP2 inside each node, the compressed mean between nodes.

On a 2-D mesh of nodes x ranks per node (:class:`~lightning_onebit.comm.sharding.ShardedLayout`), FSDP2's
reduce-scatter leaves each rank its shard of the node's mean gradient. :class:`ShardedCompressed` runs the
compressed optimizer of the algorithm on those shards, with the ranks that hold the same shard on every node
as its process group: the warm-up averages the shard's gradient over the nodes in fp32 (so it is AdamW on
the world's mean gradient, FSDP + AdamW to rounding), the compression phase sends the shard's momentum
through the two-stage compressed all-reduce with its error feedback. That is the package's two-level scheme
(an fp32 mean inside a node, the compressed one between nodes) with every per-parameter state sharded
instead of replicated: moments, frozen variance and error state take 1/L of a replicated rank's memory.

.. math::
    g_{a,k} = \tfrac1L \textstyle\sum_{l} g_{a,l}\big|_{\text{shard } k} \ \text{(FSDP, inside node } a)
    \qquad \theta_k \leftarrow \mathrm{Alg}\big(\theta_k,\ g_{\cdot,k};\ \text{group} = \{(a, k)\}_a\big)

Sound for the algorithms whose update is elementwise given the mean, ``OnebitAdam``, ``QAdam`` and ``CDAdam``
(its Markov estimates, like the error state, are per shard: each replica group runs CD-Adam with the nodes as
its workers and the node's mean gradient of the shard as each one's gradient; with ``compressor="topk"`` the k
largest of each row of a shard's bucket, as unsharded of each row of a bucket), and for ``OnebitLamb``, whose
per-tensor scalars (trust ratio, momentum rms, the layer factor's maximum) come from the whole tensors: each
rank's shard statistics are summed (maxed) over the node's ranks in one small all-gather on the fast link per
bucket and step (``SOUND``); the ranks of a node cut the same buckets, by the parameters' whole sizes. And for
``ZeroOneAdam``: its variance refreshes and rounds run over the replica groups, and between rounds the ranks
of a node take the same local steps on their shards (a NaN/inf in any rank's shard drops that step's gradient
on every rank of the node), so a node stays one model and the nodes meet at each round (``sync_replicas()``,
collective, brings them together in between). The scales the compressed mean sends are per piece of a shard,
not per whole tensor: its bits differ from an unsharded run's, not its bytes.

The ranks of a node hold shards of one model, so they take, skip or raise on a step together: every step
ORs a non-finite flag over the node (one byte on the fast link), and a rank whose node saw one makes its own
gradient non-finite, so that every replica group skips (or raises) as one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..comm import ByteCounter, all_finite_many
from ..comm.sharding import ShardedLayout, is_sharded, like, local
from .base import CompressedOptimizer

__all__ = ["SOUND", "ShardedCompressed"]

#: the algorithms with a sharded form, and why the others have none
SOUND = ("onebit_adam", "qadam", "onebit_lamb", "cd_adam", "zero_one_adam")
_WHY_NOT: dict[str, str] = {}


class ShardedCompressed(torch.optim.Optimizer):
    """``algorithm`` (a strategy name of :data:`SOUND` or its class) on the shards of an FSDP2 model.

    Args:
        algorithm: ``"onebit_adam"``, ``"qadam"``, ``"onebit_lamb"``, ``"cd_adam"``, ``"zero_one_adam"``, or
            their class.
        params: the sharded model's parameters (every one sharded over ``mesh``'s inner dimension).
        mesh: the 2-D ``DeviceMesh`` of (nodes, ranks per node) FSDP2 sharded over (its inner dimension).
        **kwargs: the algorithm's options (``lr``, ``warmup_steps``, ...), but not ``group`` (the mesh
            sets it) or ``simulate_workers``.

    Param groups, LR schedulers and ``zero_grad`` act on this optimizer as on any other; ``algorithm``
    (the inner optimizer over the shards, ``.inner``) takes the groups' hyperparameters at every step. Its
    counters and phase (``compressing``, ``comm_counter``, ``start_compression()``) are read through.
    """

    def __init__(self, algorithm: str | type[CompressedOptimizer], params: Iterable, *, mesh, **kwargs: Any) -> None:
        name = algorithm if isinstance(algorithm, str) else getattr(algorithm, "strategy_name", None)
        if name not in SOUND:
            why = _WHY_NOT.get(name, "it is not one of the package's compressed optimizers")
            raise ValueError(f"ShardedCompressed: {algorithm!r} has no sharded form ({why}); sound on shards: "
                             f"{list(SOUND)}, or DiLoCo(..., mesh=mesh)")
        cls = CompressedOptimizer.algorithms()[name]
        given = sorted(k for k in ("group", "simulate_workers") if k in kwargs)
        if given:
            raise ValueError(f"ShardedCompressed: the mesh sets the process group; drop {given}")
        self.sharding = ShardedLayout(mesh, who=f"{cls.__name__} on shards")
        super().__init__(params, {})
        self.sharding.check_params([p for g in self.param_groups for p in g["params"]])
        # plain tensors sharing each shard's memory: the inner optimizer's updates land in the parameters
        self._proxies = {id(p): local(p).detach().requires_grad_(p.requires_grad)
                         for g in self.param_groups for p in g["params"]}
        inner_groups = [dict(g, params=[self._proxies[id(p)] for p in g["params"]]) for g in self.param_groups]
        self.inner = cls(inner_groups, group=self.sharding.replica_group, **kwargs)
        # the node's ranks cut the same buckets and take whole-tensor statistics together
        self.inner.bucket_sizes = {id(self._proxies[id(p)]): p.numel() for g in self.param_groups for p in g["params"]}
        self.inner.whole_tensor_stats = self.sharding.whole_tensor_stats
        for g, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
            g.update({k: v for k, v in ig.items() if k != "params"})  # the algorithm's defaults, visible here
        self.defaults = dict(self.inner.defaults)
        self.algorithm = name

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group here and to the optimizer on the shards (after construction: torch's ``__init__`` adds
        the first groups before that optimizer exists, and builds it from them)."""
        super().add_param_group(param_group)
        if "inner" not in self.__dict__:
            return
        g = self.param_groups[-1]
        self.sharding.check_params(g["params"])
        for p in g["params"]:
            self._proxies[id(p)] = local(p).detach().requires_grad_(p.requires_grad)
            self.inner.bucket_sizes[id(self._proxies[id(p)])] = p.numel()
        self.inner.add_param_group(dict(g, params=[self._proxies[id(p)] for p in g["params"]]))
        g.update({k: v for k, v in self.inner.param_groups[-1].items() if k != "params"})

    def __getattr__(self, name: str) -> Any:  # the inner optimizer's phase, counters and switches
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(inner, name)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
            ig.update({k: v for k, v in g.items() if k != "params"})  # LR schedulers act on these groups
        params = [p for g in self.param_groups for p in g["params"]]
        grads = []
        for p in params:
            proxy = self._proxies[id(p)]
            proxy.grad = local(p.grad)
            if proxy.grad is not None:
                grads.append(proxy.grad)
        finite = all_finite_many(grads) if grads else torch.ones((), dtype=torch.bool)
        # the node's ranks hold one model: one non-finite shard makes every rank of the node skip (or raise),
        # and the compressed mean carries it to the other nodes' ranks of each shard
        held = next((g for g in grads if g.numel()), None)  # (a rank's shard of a small tensor may be empty)
        if self.sharding.any_in_node(~finite) and bool(finite) and held is not None:
            held.view(-1)[:1] = float("nan")
        try:
            self.inner.step()
        finally:
            for p in params:
                self._proxies[id(p)].grad = None  # the gradients are FSDP's to free
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (of this rank's shards) and the mesh it belongs to: one per rank."""
        groups = torch.optim.Optimizer.state_dict(self)["param_groups"]
        return {"inner": self.inner.state_dict(), "param_groups": groups,
                "mesh": (self.sharding.nodes, self.sharding.ranks_per_node), "algorithm": self.algorithm}

    @classmethod
    def from_optimizer(cls, algorithm: str, opt: torch.optim.Optimizer, *, mesh, **overrides: Any) -> ShardedCompressed:
        """``algorithm`` on shards over ``opt``'s param groups with its hyperparameters, as the algorithm's own
        ``from_optimizer`` converts an ``AdamW`` (``overrides``: further options; keys an LR scheduler added
        to the groups are kept)."""
        alg = CompressedOptimizer.algorithms().get(algorithm)
        if alg is None or not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            raise ValueError(f"ShardedCompressed.from_optimizer converts torch.optim.AdamW (or Adam without weight "
                             f"decay) to one of {list(SOUND)}; got {type(opt).__name__} to {algorithm!r}")
        if type(opt) is torch.optim.Adam and any(g["weight_decay"] for g in opt.param_groups):
            raise ValueError("torch.optim.Adam with weight_decay is L2-regularised Adam, which the compressed "
                             "optimizers do not implement; use torch.optim.AdamW (decoupled)")
        d = opt.defaults
        kw = {mine: d[theirs] for theirs, mine in alg.from_adam.items() if theirs in d}
        if alg.has_warmup:
            kw["warmup_steps"] = None
        kw.update(overrides)
        groups = [{"params": g["params"], **{mine: g[theirs] for theirs, mine in alg.from_adam.items() if theirs in g}}
                  for g in opt.param_groups]
        new = cls(algorithm, groups, mesh=mesh, **kw)
        for g_old, g_new in zip(opt.param_groups, new.param_groups, strict=True):
            for k, v in g_old.items():
                if k != "params" and k not in opt.defaults and k not in g_new:
                    g_new[k] = v
        return new

    # -- checkpoints through torch.distributed.checkpoint ---------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def sharded_state_dict(self, names: Sequence[str]) -> tuple[dict, dict, dict]:
        """``(tensors, shared, own)``, as :meth:`DiLoCo.sharded_state_dict
        <lightning_onebit.optim.DiLoCo.sharded_state_dict>`: ``tensors`` the per-parameter state (moments, the
        frozen variance) named by ``names`` and sharded as the parameters are, identical on every node after a
        step (written once; ``torch.distributed.checkpoint`` reshards it), ``shared`` the phase, step counts and
        settings, ``own`` this rank's error state and byte counter."""
        params = self._params()
        if len(names) != len(params):
            raise ValueError(f"names: one per parameter ({len(params)}), got {len(names)}")
        sd = self.inner.state_dict()
        proxies = self.inner.params_in_order()
        tensors, kinds = {}, {}
        for i, st in sd["state"].items():
            p, name = params[i], names[i]
            tensors[name] = {k: like(p, v) if torch.is_tensor(v) and v.shape == proxies[i].shape else v
                             for k, v in st.items()}
            kinds[name] = {k: ("shard", v.dtype) if torch.is_tensor(v) and v.shape == proxies[i].shape
                           else ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value",)
                           for k, v in st.items()}
        section = {k: v for k, v in sd["onebit"].items() if k not in ("comm", "bytes", "extra")}
        shared = {"algorithm": self.algorithm, "mesh": (self.sharding.nodes, self.sharding.ranks_per_node),
                  "param_groups": torch.optim.Optimizer.state_dict(self)["param_groups"],
                  "inner_groups": sd["param_groups"], "onebit": section, "kinds": kinds}
        own = {"comm": sd["onebit"]["comm"], "bytes": sd["onebit"]["bytes"], "extra": sd["onebit"]["extra"]}
        return {"state": tensors}, shared, own

    def load_sharded_state_dict(self, shared: Mapping[str, Any], read: Callable[[dict], None],
                                names: Sequence[str], own: Mapping[str, Any] | None = None) -> None:
        """Restore :meth:`sharded_state_dict`: ``read(tensors)`` fills tensors of its form in place (a
        ``torch.distributed.checkpoint`` load, which reshards); every rank calls it together. With ``own``
        (saved on the same mesh) the rank continues exactly; without, the moments, frozen variance and phase
        come back resharded and the error state starts at zero."""
        if shared.get("algorithm") != self.algorithm:
            raise ValueError(f"state of {shared.get('algorithm')!r}, this optimizer runs {self.algorithm!r}")
        params = self._params()
        by_name = dict(zip(names, params, strict=True))
        tensors = {}
        for name, kinds in shared["kinds"].items():
            if name not in by_name:
                raise ValueError(f"state holds parameter {name!r}, which this optimizer does not have")
            p = by_name[name]
            tensors[name] = {k: (like(p, torch.zeros(local(p).shape, dtype=kind[1], device=local(p).device))
                                 if kind[0] == "shard" else
                                 torch.zeros(kind[1], dtype=kind[2]) if kind[0] == "tensor" else None)
                             for k, kind in kinds.items()}
        read({"state": tensors})
        index = {n: i for i, n in enumerate(names)}
        state = {index[n]: {k: local(v) if is_sharded(v) else v for k, v in st.items()} for n, st in tensors.items()}
        layout = shared["onebit"]["layout"]
        onebit = dict(shared["onebit"], comm=own["comm"] if own is not None else [None] * len(layout),
                      bytes=own["bytes"] if own is not None else ByteCounter().state_dict(),
                      extra=own["extra"] if own is not None else {})
        for g, saved in zip(self.param_groups, shared["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.load_state_dict({"state": state, "param_groups": shared["inner_groups"], "onebit": onebit})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of this rank, saved on a mesh of the same shape (its shards' state
        fits no other)."""
        here = (self.sharding.nodes, self.sharding.ranks_per_node)
        if "inner" not in state_dict or tuple(state_dict.get("mesh", ())) != here \
                or state_dict.get("algorithm") != self.algorithm:
            raise ValueError(f"not a state of {self.algorithm} on shards of a {here[0]} x {here[1]} mesh (saved: "
                             f"{state_dict.get('algorithm')!r} on {state_dict.get('mesh')!r}); a sharded state "
                             "resumes on the mesh it was saved on")
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        self.inner.load_state_dict(state_dict["inner"])

"""How a group's ranks sit in nodes, and the process groups a mean needs: decided and made once.

Both families ask a :class:`Topology` whether a compressed mean runs flat or on two levels (fp32 inside
a node, compressed between nodes: :class:`~lightning_onebit.comm.HierarchicalAllreduce`), for its node
groups, and for a group of its own that a mean running on a sender thread uses, so that its collectives
never interleave with the caller's. Creating groups is collective: every rank must ask at the same point.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .dense import group_size, launcher_ranks_per_node
from .duplex import enable_duplex, group_timeout
from .hierarchical import node_groups

__all__ = ["Topology", "is_default_group", "rank", "spans_the_world"]

log = logging.getLogger(__name__)


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def spans_the_world(group) -> bool:
    """``group`` holds every rank in rank order (the default group, or DDP's handle of it)."""
    if group is None:
        return True
    return dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))


def is_default_group(group) -> bool:
    """``group`` is the default group (``None`` or its handle)."""
    return group is None or group is dist.group.WORLD


class Topology:
    """The node layout of the ranks a mean runs on.

    Args:
        hierarchical: ``None`` (automatic): two levels when the group spans several nodes of several
            ranks each; ``True``: two levels wherever the layout allows (also one rank per node, or one
            node); ``False``: flat.
        ranks_per_node: ranks per node, laid out ``node * ranks_per_node + local_rank`` as torchrun and
            Lightning lay them out; ``None``: the launcher's ``LOCAL_WORLD_SIZE``.
        who: the owner's name in the log line that says why an asked-for two-level layout falls back.
    """

    def __init__(self, *, hierarchical: bool | None = None, ranks_per_node: int | None = None,
                 who: str = "") -> None:
        self.who = who
        self._node_groups: tuple | None = None
        self._own_group = None
        self._said: set[str] = set()  # the fall-back reasons logged already
        self.hierarchical: bool | None = None
        self.ranks_per_node: int | None = None
        self.set(hierarchical=hierarchical, ranks_per_node=ranks_per_node)

    def set(self, *, hierarchical: bool | None, ranks_per_node: int | None) -> None:
        """Choose the layout (before any group was made for it)."""
        if hierarchical not in (None, True, False):
            raise ValueError(f"hierarchical must be None (automatic), True or False, got {hierarchical!r}")
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int or None, got {ranks_per_node!r}")
        if self.made and (hierarchical, ranks_per_node) != (self.hierarchical, self.ranks_per_node):
            raise RuntimeError(f"{self.who}: the node groups exist already; choose the layout before the first "
                               "compressed step")
        self.hierarchical, self.ranks_per_node = hierarchical, ranks_per_node

    @property
    def made(self) -> bool:
        """Some process group of this layout exists already."""
        return self._node_groups is not None

    def two_level(self, group=None, world_size: int | None = None) -> int | None:
        """Ranks per node when a compressed mean over ``group`` runs on two levels, else ``None`` (flat).

        ``world_size``: a simulated cluster's (its "group" is every simulated worker). A layout asked for
        (``hierarchical=True``) that cannot be had falls back to flat with one log line saying why."""
        if self.hierarchical is False:
            return None
        simulated = world_size is not None
        local = self.ranks_per_node
        if local is None and not simulated:
            local = launcher_ranks_per_node()
        n = world_size if simulated else group_size(group)
        why = None
        if not simulated and not spans_the_world(group):
            why = "it runs on a group of every rank only (node groups are cut from the default group)"
        elif local is None:
            why = "the ranks per node are unknown (ranks_per_node=... or LOCAL_WORLD_SIZE)"
        elif n % local:
            why = f"{local} ranks per node do not divide the world size {n}"
        elif self.hierarchical is None and local in (1, n):
            return None  # one node, or one rank per node: nothing to gain
        if why is None:
            return local
        if self.hierarchical and why not in self._said:
            self._said.add(why)
            log.warning(f"{self.who}: the two-level collective falls back to flat: {why}")
        return None

    def node_groups(self, ranks_per_node: int) -> tuple:
        """(this rank's node group, its cross-node group), made once (collective: every rank calls it)."""
        if self._node_groups is None:
            self._node_groups = node_groups(ranks_per_node)
        return self._node_groups

    def own_group(self, group=None):
        """A group of its own over ``group``'s ranks, for a mean on a sender thread, made once (collective):
        with the default group's timeout, and a duplex twin on gloo. A ``group`` that is not every rank is
        returned as it is: nothing else may use it while such a mean is in flight."""
        if not spans_the_world(group) or group_size(group) == 1:
            return group
        if self._own_group is None:
            self._own_group = dist.new_group(timeout=group_timeout(),
                                             group_desc=f"lightning_onebit {self.who} mean on a sender thread")
            enable_duplex(self._own_group)
        return self._own_group

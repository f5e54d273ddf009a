"""Fixed buckets and flat state: the memory layout every compressed optimizer shares.

Parameters are grouped into buckets of fixed composition (reverse parameter order, the order
backward produces gradients, capped at ``bucket_cap_mb``, never spanning two param groups, two
devices, two dtypes, or DDP-managed and unmanaged parameters). A bucket's optimizer state lives
in flat fp32 buffers and ``optimizer.state[p]`` holds views into them, so state is keyed per
parameter (it survives DDP's own bucket rebuilds and reloads) while each bucket is
communicated with one pair of collectives and updated with a few flat ops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from ..compress import flat_buffer

__all__ = ["Bucket", "BucketState", "copy_or_zero_", "drop_positions", "max_dropped_runs"]

MAX_DROPPED_RUNS = 256  # the fewest runs a bucket of any size may drop as slices before it searches again
# A slice costs as much as a search of ``v == 0`` over this many coordinates of the bucket (one CPU thread; the
# optimizer step with a BERT embedding's unseen rows in benchmarks/RESULTS.md measures both ways).
SEARCH_COORDS_PER_RUN = 8192


def max_dropped_runs(numel: int) -> int:
    """How many runs :func:`drop_positions` takes as slices for a bucket of ``numel`` coordinates: as
    many as cost less than one search over it, at least ``MAX_DROPPED_RUNS``."""
    return max(MAX_DROPPED_RUNS, numel // SEARCH_COORDS_PER_RUN)


def drop_positions(idx: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None,
                   max_runs: int = MAX_DROPPED_RUNS) -> torch.Tensor | None:
    """``idx`` (sorted positions) without ``pos`` (a sorted subset of them), as slices of ``idx``
    between the runs of ``pos``: a BERT embedding's newly seen rows are a few runs, and this copies
    the positions once, where a boolean mask or a search of the bucket reads it several times longer. None
    when ``pos`` falls apart into more than ``max_runs`` runs (search the bucket instead:
    :func:`max_dropped_runs`). ``out``: memory for the result, a view of it returned when it is large
    enough and not ``idx``'s (a fresh tensor of 10M positions costs 3x the copy in page faults)."""
    if pos.numel() == 0:
        return idx
    j = torch.searchsorted(idx, pos)
    cut = (j[1:] != j[:-1] + 1).nonzero().view(-1).add_(1)  # where a run of dropped indices starts
    if cut.numel() + 1 > max_runs:
        return None
    starts = [int(j[0]), *j[cut].tolist()]
    ends = [*(j[cut - 1] + 1).tolist(), int(j[-1]) + 1]
    pieces = [idx[a:b] for a, b in zip([0, *ends], [*starts, idx.numel()], strict=True) if b > a]
    n = idx.numel() - pos.numel()
    if out is not None and out.numel() >= n and out.untyped_storage().data_ptr() != idx.untyped_storage().data_ptr():
        return torch.cat(pieces, out=out[:n]) if pieces else out[:0]
    return torch.cat(pieces) if pieces else idx[:0]


class StepSync(Protocol):
    """What a bucket and its state need of the bucket's synchronisation state (:class:`~.sync.BucketSync`,
    which imports this module)."""

    def reset_step(self, discard: bool = False) -> None: ...
    def collective(self) -> Any: ...


class Bucket:
    """A fixed group of parameters that is synchronised and updated as one flat vector."""

    def __init__(self, index: int, group_index: int, params: list[torch.Tensor], ids: list[int],
                 via_ddp: bool, grad: torch.Tensor | None = None) -> None:
        self.index = index
        self.group_index = group_index
        self.params = params
        self.ids = ids  # positions in the optimizer's flattened parameter list
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        dev = params[0].device
        self.device = dev
        self.via_ddp = via_ddp  # DDP's comm hook delivers this bucket's gradients
        self.flat: dict[str, torch.Tensor] = {}
        # local gradient (``grad``: a slice of a buffer the optimizer made for several buckets)
        self.grad = flat_buffer(self.numel, device=dev) if grad is None else grad
        self._synced: torch.Tensor | None = None
        self._worker_bufs: dict[str, list[torch.Tensor]] = {}  # kept across steps: fresh buffers cost page faults
        self.cache: dict = {}  # per-bucket values that only change at the switch (see subclasses)
        self.compressing = False  # this bucket has switched to compressed synchronisation
        self.switch_step: int | None = None  # a late bucket switches after this optimizer step
        self.sync: StepSync | None = None  # its collectives and this step's progress (set by the optimizer)

    def reset_step(self, discard: bool = False) -> None:
        """Forget this step's synchronisation progress (``discard``: also a result left for the update)."""
        if self.sync is not None:
            self.sync.reset_step(discard)

    def worker_buffers(self, name: str, n: int) -> list[torch.Tensor]:
        """``n`` bucket-sized fp32 buffers for the simulated workers, kept across steps (fresh ones
        cost a page fault per 4 KiB at first touch, more than the work done in them)."""
        bufs = self._worker_bufs.get(name)
        if bufs is None or len(bufs) != n:
            bufs = self._worker_bufs[name] = [flat_buffer(self.numel, device=self.device)
                                              for _ in range(n)]
        return bufs

    def drop_buffers(self, name: str) -> None:
        """Free the buffers :meth:`worker_buffers` keeps under ``name``."""
        self._worker_bufs.pop(name, None)

    @property
    def synced(self) -> torch.Tensor:
        """Result buffer of the collective, allocated on first use (optimizers that receive the
        result straight into their state never pay its memory)."""
        if self._synced is None:
            self._synced = flat_buffer(self.numel, device=self.device)
        return self._synced

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, self.params, strict=True)]

    def grad_views(self) -> list[torch.Tensor]:
        """:meth:`views` of the local gradient buffer, made once per buffer (DDP's hook copies into them
        every step)."""
        return self.kept_views("grad", self.grad)

    def kept_views(self, name: str, flat: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`views` of ``flat``, a buffer this bucket keeps under ``name``, made again only when the
        buffer under that name changes (a step then builds no view per parameter)."""
        key = ("views", name)
        hit = self.cache.get(key)
        if hit is None or hit[0] is not flat:
            hit = self.cache[key] = (flat, self.views(flat))
        return hit[1]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of ``flat`` (``views(flat)[i]`` without the others)."""
        o = self.offsets[i]
        return flat[o : o + self.numels[i]].view_as(self.params[i])

    def runs(self, idx: torch.Tensor) -> list[tuple[int, int, int]]:
        """(parameter, start, end) of each parameter's run in the sorted flat positions ``idx``."""
        cuts = torch.searchsorted(idx, torch.tensor([*self.offsets, self.numel], device=idx.device)).tolist()
        return [(k, lo, hi) for k, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)) if lo < hi]

    def values_at(self, grad: torch.Tensor | Sequence[torch.Tensor | None], idx: torch.Tensor) -> torch.Tensor:
        """fp32 values at the flat positions ``idx`` (sorted int64) of a flat gradient, or of one
        tensor (or None: zeros) per parameter, read where they are."""
        if isinstance(grad, torch.Tensor):
            return grad.index_select(0, idx)
        out = torch.empty(idx.numel(), dtype=torch.float32, device=idx.device)  # the runs cover it
        # index_select reads a run faster than indexing does, and a per-position search for the parameter
        # cost more than the rest of a compressed step with a BERT embedding's unseen rows masked (the
        # optimizer step with those rows in benchmarks/RESULTS.md)
        for k, lo, hi in self.runs(idx):
            if grad[k] is None:
                out[lo:hi] = 0.0
            else:
                at = idx[lo:hi] if self.offsets[k] == 0 else idx[lo:hi] - self.offsets[k]
                g = grad[k].reshape(-1)
                if g.dtype == torch.float32:
                    torch.index_select(g, 0, at, out=out[lo:hi])
                else:
                    out[lo:hi] = g.index_select(0, at)
        return out

    def nonzero_at(self, grad: torch.Tensor | Sequence[torch.Tensor | None], idx: torch.Tensor,
                   zero_at: torch.Tensor | None = None) -> torch.Tensor:
        """The indices ``j`` (sorted int64) into ``idx`` (sorted flat positions) where the gradient
        (as in :meth:`values_at`) is not zero (NaN counts as not zero). ``zero_at``: a flat tensor that
        is zero at the positions ``idx`` (1-bit Adam's frozen variance), which lets the search keep
        only the gradient's masked nonzeros before it looks them up."""
        out = []
        for k, lo, hi in self.runs(idx):
            g = grad[self.offsets[k]:self.offsets[k] + self.numels[k]] if isinstance(grad, torch.Tensor) else grad[k]
            if g is None:
                continue
            g, run = g.reshape(-1), idx[lo:hi]
            if 2 * (hi - lo) > g.numel():
                # most of the tensor is masked (a BERT embedding's unseen rows) and its gradient is
                # sparse: finding its few nonzeros reads it once, cheaper than gathering the run
                nz = g.nonzero().view(-1).add_(self.offsets[k])
                if zero_at is not None:  # the batch's seen rows are most of the nonzeros: a gather drops them
                    nz = nz[zero_at[nz] == 0]
                j = torch.searchsorted(run, nz).clamp_(max=hi - lo - 1)
                out.append(j[run[j] == nz].add_(lo))
            else:
                at = run if self.offsets[k] == 0 else run - self.offsets[k]
                out.append(g.index_select(0, at).nonzero().view(-1).add_(lo))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=idx.device)


class BucketState:
    """Mixin of :class:`~lightning_onebit.optim.CompressedOptimizer`: builds its buckets, keeps the
    per-parameter state as views of their flat buffers, and snapshots the state of parameters
    that must not move in a step. Expects the optimizer's ``param_groups``, ``state``,
    ``flat_state`` and phase attributes."""

    #: the size a parameter counts for against ``bucket_cap_mb``, by ``id`` (default: its own): a parameter's
    #: whole size when it is one rank's shard, so that the ranks of a node, whose shards differ in size, cut
    #: the same buckets and can reduce per-bucket statistics together (:class:`~.sharded.ShardedCompressed`)
    bucket_sizes: dict[int, int] | None = None

    def params_in_order(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build_buckets(self) -> list[Bucket]:
        """Buckets of every param group that has none yet (all of them at the first call)."""
        if self._nbucketed == len(self.param_groups):
            return self._buckets
        cap = int(self.bucket_cap_mb * 2**20) // 4
        ids = {id(p): i for i, p in enumerate(self.params_in_order())}
        runs: list[tuple[int, list[torch.Tensor]]] = []
        for gi in range(self._nbucketed, len(self.param_groups)):
            cur: list[torch.Tensor] = []
            size = 0
            for p in reversed(self.param_groups[gi]["params"]):  # backward order: last layers first
                if not p.requires_grad:
                    continue
                n = p.numel() if self.bucket_sizes is None else self.bucket_sizes.get(id(p), p.numel())
                if cur and (size + n > cap or p.device != cur[0].device or p.dtype != cur[0].dtype
                            or (id(p) in self._ddp_params) != (id(cur[0]) in self._ddp_params)):
                    runs.append((gi, cur))
                    cur, size = [], 0
                cur.append(p)
                size += n
            if cur:
                runs.append((gi, cur))
        grads = _slices([(ps[0].device, sum(p.numel() for p in ps)) for _, ps in runs])
        new = [Bucket(len(self._buckets) + k, gi, ps, [ids[id(q)] for q in ps], via_ddp=id(ps[0]) in self._ddp_params,
                      grad=grad) for k, ((gi, ps), grad) in enumerate(zip(runs, grads, strict=True))]
        late = self._nbucketed > 0 and self._compressing and self.has_warmup
        for b in new:
            b.sync = self._bucket_sync(b)
            for name in self.flat_state:
                b.flat[name] = flat_buffer(b.numel, device=b.device)
            for i, p in enumerate(b.params):
                self._param_bucket[id(p)] = (b, i)
            self._adopt_state(b)
            if late:  # a group added after the switch: its own warm-up first
                b.switch_step = self._step + (self.warmup_steps or self._switch_at or 1)
            elif self._compressing:
                self._switch_bucket(b)
        self._buckets.extend(new)
        self._nbucketed = len(self.param_groups)
        return self._buckets

    def _adopt_state(self, b: Bucket) -> None:
        """Point self.state[p][name] at views of the bucket's flat buffers (copying loaded values)."""
        for name, flat in b.flat.items():
            for p, view in zip(b.params, b.views(flat), strict=True):
                st = self.state[p]
                old = st.get(name)
                if old is not None and old.data_ptr() != view.data_ptr():
                    view.copy_(old.reshape(view.shape))
                st[name] = view

    def _steps(self, b: Bucket, key: str = "step") -> list[int]:
        return [self.state[p].get(key, 0) for p in b.params]

    def _gather_grads(self, buckets: Sequence[Bucket]) -> None:
        """The local gradients of ``buckets`` copied into their ``b.grad`` (zeros for parameters without one), as
        one foreach copy (and one zeroing) for all of them, into views each bucket keeps: on a GPU one launch, not
        one a tensor."""
        grads = [p.grad for b in buckets for p in b.params]
        if any(g is not None and g.is_sparse for g in grads):
            raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        copy_or_zero_([v for b in buckets for v in b.grad_views()], grads)

    def _own_grads(self, b: Bucket) -> list[torch.Tensor | None]:
        """The parameters' gradients where they are (a payload :class:`~..compress.source.Source` reads
        them in place: no copy into the bucket)."""
        grads = [p.grad for p in b.params]
        if any(g is not None and g.is_sparse for g in grads):
            raise ValueError(f"{type(self).__name__} does not support sparse gradients")
        return grads

    def _worker_flat(self, b: Bucket, grads) -> list[torch.Tensor]:
        out = b.worker_buffers("grad", len(grads))
        for wg, flat in zip(grads, out, strict=True):
            for pid, view in zip(b.ids, b.views(flat), strict=True):
                if wg[pid] is None:
                    view.zero_()
                else:
                    view.copy_(wg[pid])
        return out

    def _state_views(self, b: Bucket, i: int) -> list[torch.Tensor]:
        """Every per-element state slice of parameter ``i`` of ``b``: flat state and the
        collective's error / estimate state where it covers the parameter."""
        lo, n = b.offsets[i], b.numels[i]
        views = [t[lo : lo + n] for t in b.flat.values()]
        if b.compressing:
            views += b.sync.collective().state_views(lo, lo + n)
        return views

    def _snapshot(self, b: Bucket, idx: Iterable[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Copies of the state of the given parameters: a flat sync or update moves all of a
        bucket's state, and a parameter without gradient must not move."""
        return [(i, v, v.clone()) for i in idx for v in self._state_views(b, i)]

    @staticmethod
    def _restore(saved: Iterable[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        for _, view, value in saved:
            view.copy_(value)


def _slices(sizes: list[tuple[torch.device, int]]) -> list[torch.Tensor]:
    """Consecutive slices of one zeroed fp32 buffer per device, one ``(device, numel)`` each: the buckets' local
    gradients, so that an op over several buckets' gradients is one op over the slice spanning them
    (:func:`spans`). The same memory as a buffer each."""
    total: dict[torch.device, int] = {}
    for dev, n in sizes:
        total[dev] = total.get(dev, 0) + n
    arena = {dev: flat_buffer(n, device=dev) for dev, n in total.items()}
    at = dict.fromkeys(total, 0)
    out = []
    for dev, n in sizes:
        out.append(arena[dev][at[dev]:at[dev] + n])
        at[dev] += n
    return out


def spans(bufs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Flat views that cover ``bufs`` (flat, in order) with one view per run of them lying one right after
    another in one buffer (the buckets' gradients, :func:`_slices`): an elementwise op on the views is the op on
    every buffer, in fewer launches."""
    out: list[torch.Tensor] = []
    start, end = None, None
    for t in list(bufs) + [None]:
        if (t is not None and start is not None and t.untyped_storage().data_ptr() == start.untyped_storage().data_ptr()
                and t.dtype == start.dtype and t.storage_offset() == end):
            end += t.numel()
            continue
        if start is not None:  # the run's memory as one flat view of the storage
            out.append(start.new_empty(0).set_(start.untyped_storage(), start.storage_offset(),
                                               (end - start.storage_offset(),), (1,)))
        if t is not None:
            start, end = t, t.storage_offset() + t.numel()
    return out


def copy_or_zero_(views: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``views[i] <- grads[i]``, zeros where a gradient is None: one foreach copy and one zeroing for all of them
    (a launch each on a GPU, not one a tensor)."""
    zeros = [v for v, g in zip(views, grads, strict=True) if g is None]
    pairs = [(v, g) for v, g in zip(views, grads, strict=True) if g is not None]
    if zeros:
        torch._foreach_zero_(zeros)
    if pairs:
        torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])

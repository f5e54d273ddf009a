"""1-bit LAMB's layer factors between steps: kept on the device, one launch a step for a param group's buckets
(:class:`LayerFactors`, a mixin of :class:`~lightning_onebit.optim.OnebitLamb`)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from . import local_steps
from .buckets import Bucket
from .functional_lamb import layer_factors_

__all__ = ["LayerFactors"]


class _Factors(NamedTuple):
    """1-bit LAMB's layer factors of one param group's buckets on the device, kept between steps."""

    layers: tuple  #: (bucket, indices of its kept parameters), each: the layers, in order
    last: torch.Tensor  #: each layer's last factor, fp64
    freeze: torch.Tensor  #: each layer's frozen coefficient, fp64
    steps: torch.Tensor  #: this step's step sizes, fp32 (what the scaled-step kernel reads)
    decays: torch.Tensor  #: and decays
    slices: list  #: (steps, decays) views of each bucket
    work: torch.Tensor  #: fp64 rows the arithmetic runs in: the statistics, and one for the bounds and step sizes
    stats: torch.Tensor  #: the buckets' statistics gathered, fp32
    rows: list  #: its rows
    undefined: torch.Tensor  #: where a layer's update norm is undefined (bool)
    go: torch.Tensor  #: each bucket's flag, gathered: its call went through (bool)
    owner: torch.Tensor  #: each layer's bucket, an index into ``go`` (int64)
    true: torch.Tensor  #: the flag of a bucket whose call the host decided (one True)
    cuts: list  #: each bucket's first column in ``stats``, and the end
    columns: dict  #: id(bucket) -> its first column, for a bucket whose every layer is kept (where its kernel writes)


class LayerFactors:
    """Mixin of :class:`~lightning_onebit.optim.OnebitLamb`: each layer's statistics gathered by param group, the
    layer factors and step sizes computed from them, and their state kept on the device (``_factors``, by param
    group) until the per-parameter state needs them (``state_dict()``, a switch, new layers)."""

    _factors: dict[int, _Factors]

    def _stats_buffer(self, b: Bucket, rows: int) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        """Where the kernel writes the bucket's layer statistics (fp32 ``[rows, columns]`` on its device, kept from
        step to step), its first column there and its rows: the columns of its group's gathered statistics where the
        last step's layers hold it (so that ``_layer_steps`` copies nothing), else a buffer of its own."""
        fs = self._factors.get(id(self.param_groups[b.group_index]))
        col = None if fs is None or fs.stats.shape[0] != rows else fs.columns.get(id(b))
        hit = b.cache.get("layer stats")
        if col is not None:
            if hit is None or hit[0] is not fs.stats or hit[1] != col:
                hit = b.cache["layer stats"] = (fs.stats, col, list(fs.stats[:, col:col + len(b.params)].unbind()))
        elif hit is None or hit[0].shape != (rows, len(b.params)) or hit[0].device != b.device or hit[1]:
            out = torch.empty(rows, len(b.params), dtype=torch.float32, device=b.device)
            hit = b.cache["layer stats"] = (out, 0, list(out.unbind()))
        return hit

    def _layer_steps(self, entries: list[tuple], group: dict) -> list[tuple]:
        r"""(step sizes :math:`\gamma \bar c f`, decays :math:`1 - \gamma \bar c f \lambda`) of each bucket of
        ``entries`` (a step's pending buckets of ``group``), one a kept layer, from the layers' statistics: fp32
        tensors on their device, kept from step to step (on the CPU: read, lists). Each layer's last factor is
        updated with them.

        The factor arithmetic of :class:`~lightning_onebit.optim.OnebitLamb`'s docstring
        (:func:`~.functional_lamb.layer_factors_`: on a GPU one kernel)
        runs in fp64 on the device, once for all the buckets of the group: no host read (a GPU's queue is not waited
        for, and the step sizes go to the scaled-step kernel where they are), and a step's ops do not grow with its
        buckets or layers. The roundings are Python's float arithmetic's, operation for operation (IEEE fp64; a
        square root where it raised to 0.5; only infinite statistics, which make the step non-finite anyway, can
        blend otherwise)."""
        wd, lr, thr = group["weight_decay"], group["lr"], group["factor_threshold"]
        fs = self._factor_state(entries, 4 if wd else 1)
        last = fs.last
        # each bucket's statistics into the group's, unless the kernel wrote them there (_stats_buffer)
        at, cuts = fs.stats.data_ptr(), fs.cuts
        moved = [j for j, e in enumerate(entries) if e[5][0].data_ptr() != at + 4 * cuts[j]]
        if len(moved) == len(entries):
            for row, col in zip(fs.rows, zip(*(e[5] for e in entries), strict=True), strict=True):
                torch.cat(col, out=row) if len(col) > 1 else row.copy_(col[0])  # one kernel (a GPU's cat)
        for j in moved if len(moved) < len(entries) else ():
            for row, part in zip(fs.rows, entries[j][5], strict=True):
                row[cuts[j]:cuts[j + 1]].copy_(part)
        on_device = local_steps.flags_stay_on_device(last.device)
        go = owner = None
        if any(e[6] is not None for e in entries):  # a bucket's layers keep their factors where its step was skipped
            flags = [fs.true if e[6] is None else e[6] for e in entries]
            go, owner = flags[0] if len(flags) == 1 else torch.cat(flags, out=fs.go), fs.owner
        steps = layer_factors_(fs.stats, last, fs.freeze, weight_decay=wd, lr=lr, factor_threshold=thr,
                               factor_min=group["factor_min"], factor_max=group["factor_max"], work=fs.work,
                               undefined=fs.undefined, out=(fs.steps, fs.decays) if on_device else None, go=go,
                               owner=owner)
        if on_device:  # where the scaled-step kernel reads them
            return fs.slices
        # on the CPU a read waits for nothing: one, and the per-parameter floats stay current
        n = last.numel()
        values = torch.cat([steps, 1 - steps * wd, last]).tolist()
        self._store_factors(fs.layers, values[2 * n:])
        return [(values[lo:hi], values[n + lo:n + hi]) for lo, hi in itertools.pairwise(cuts)]

    def _factor_state(self, entries: list[tuple], rows: int) -> _Factors:
        """The device state of the kept layers of ``entries`` (:class:`_Factors`): kept between steps while the
        same buckets keep the same layers (made from the per-parameter state, which :meth:`_store_factors` brings
        up to date), so a step copies nothing to the device and its step sizes stay where the kernels read them."""
        layers = tuple((e[1], tuple(e[3])) for e in entries)
        cached = self._factors.get(id(entries[0][2]))
        if cached is not None and cached.layers == layers and cached.work.shape[0] == rows + 1:
            return cached
        if cached is not None:
            self._store_factors(cached.layers, cached.last)
        params = [self.state[b.params[i]] for b, keep in layers for i in keep]
        dev = entries[0][5][0].device
        last = torch.tensor([st["last_factor"] for st in params], dtype=torch.float64).to(dev)
        freeze = torch.tensor([st["lamb_coeff_freeze"] for st in params], dtype=torch.float64).to(dev)
        steps, decays = (torch.empty(len(params), dtype=torch.float32, device=dev) for _ in range(2))
        cuts = [0, *itertools.accumulate(len(keep) for _, keep in layers)]
        slices = [(steps[lo:hi], decays[lo:hi]) for lo, hi in itertools.pairwise(cuts)]
        work = torch.empty(rows + 1, len(params), dtype=torch.float64, device=dev)
        stats = torch.empty(rows, len(params), dtype=torch.float32, device=dev)
        undefined = torch.empty(len(params), dtype=torch.bool, device=dev)
        go = torch.ones(len(layers), dtype=torch.bool, device=dev)
        owner = torch.tensor([j for j, (_, keep) in enumerate(layers) for _ in keep], dtype=torch.int64).to(dev)
        columns = {id(b): cut for (b, keep), cut in zip(layers, cuts[:-1], strict=True) if len(keep) == len(b.params)}
        fs = self._factors[id(entries[0][2])] = _Factors(layers, last, freeze, steps, decays, slices, work, stats,
                                                         list(stats.unbind()), undefined, go, owner, go[:1].clone(),
                                                         cuts, columns)
        return fs

    def _store_factors(self, layers: tuple, last: torch.Tensor | list[float]) -> None:
        """The last factors ``last`` of ``layers`` (a bucket and its kept parameters' indices, each) into the
        per-parameter state (a read, of a tensor)."""
        values = iter(last.tolist() if isinstance(last, torch.Tensor) else last)
        for b, keep in layers:
            for i in keep:
                self.state[b.params[i]]["last_factor"] = next(values)

    def _sync_factors(self) -> None:
        """Bring the per-parameter last factors up to date from the device and forget the device's copies."""
        factors, self._factors = self._factors, {}
        for fs in factors.values():
            self._store_factors(fs.layers, fs.last)

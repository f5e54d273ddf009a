"""Payload sources: an elementwise expression that the codec kernels evaluate where they read it.

A compressed optimizer sends an expression of its state, not a tensor it already holds: 1-bit Adam
the momentum it would have after this gradient, ``lerp(m, g, 1 - beta1)``; 0/1 Adam the interval's
lr-weighted momentum ``u / sum(s)``. Written to a bucket-sized buffer first, the payload costs a
write and two reads of the whole bucket per step (the scale reduction and the encode read it),
plus the copy of the parameters' gradients into the bucket. A :class:`Source` describes it
instead: the numba CPU and CUDA kernels evaluate it tile by tile inside the reduction and the
encode, reading the gradients where they are, and every other consumer calls
:meth:`Source.materialize`, which evaluates it with the torch ops that define its bits (the
reference the kernels are tested against).

The expression, with ``k`` the parameter (group) of position ``i``:

* ``lerp``: ``x[i] = torch.lerp(start[i], end[i], weight) * factors[k]`` (torch's CPU ``lerp`` is
  ``fma(weight, end - start, start)`` for ``weight < 0.5``; ``factors`` optional);
* ``gradient``: ``x[i] = end[i]``;
* ``quotient``: ``x[i] = start[i] / factors[k]`` (``torch.div`` by a Python float: an fp32 division).

``end`` is a flat tensor or one tensor per group (``None``: zeros, a parameter without gradient).
Positions in ``mask`` (sorted int64) send ``|0 * end[i]|`` (0, or NaN where the gradient is not
finite, so a collective's finiteness check still sees it) or, with ``masked="zero"``, 0.
Positions from ``numel`` on are zero padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["OPS", "Sink", "Source"]

OPS = ("lerp", "gradient", "quotient")

_GROUPS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _checked_groups(groups: Sequence[int], numel: int, who: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(``groups`` as ints, each group's size), checked once per geometry: a bucket's Source and Sink are
    made every step with the same offsets."""
    key = (tuple(groups), numel, who)  # a Source's are checked for order, a Sink's not
    hit = _GROUPS.get(key)
    if hit is None:
        gs = tuple(int(g) for g in groups)
        if who == "Source" and (not gs or gs[0] != 0 or list(gs) != sorted(gs) or gs[-1] > numel):
            raise ValueError(f"groups must be sorted offsets from 0 within [0, {numel}], got {gs[:4]}...")
        if len(_GROUPS) >= 1024:
            _GROUPS.pop(next(iter(_GROUPS)))
        hit = _GROUPS[key] = (gs, tuple(b - a for a, b in zip(gs, (*gs[1:], numel), strict=True)))
    return hit


class Source:
    """A flat fp32 vector of ``numel`` elements (``len`` with padding) given by an expression.

    It quacks like the 1-D tensor the collectives used to take (``numel()``, ``device``,
    ``dtype``, ``x[lo:hi]`` for a window, ``reshape(-1)``), so the comm layer passes it through.
    """

    def __init__(self, op: str, *, numel: int, groups: Sequence[int], start: torch.Tensor | None = None,
                 end: torch.Tensor | Sequence[torch.Tensor | None] | None = None, weight: float = 0.0,
                 factors: Sequence[float] | None = None, mask: torch.Tensor | None = None,
                 masked: str = "nonfinite", out: torch.Tensor | None = None, cache: dict | None = None) -> None:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if masked not in ("nonfinite", "zero"):
            raise ValueError(f"masked must be 'nonfinite' or 'zero', got {masked!r}")
        groups, sizes = _checked_groups(groups, numel, "Source")
        if op in ("lerp", "quotient") and (start is None or start.numel() != numel):
            raise ValueError(f"{op} needs a flat start tensor of {numel} elements")
        if op in ("lerp", "gradient") and end is None:
            raise ValueError(f"{op} needs end (a flat tensor, or one tensor per group)")
        if op == "quotient" and factors is None:
            raise ValueError("quotient needs factors (one divisor per group)")
        if factors is not None and len(factors) != len(groups):
            raise ValueError(f"factors has {len(factors)} entries for {len(groups)} groups")
        if isinstance(end, torch.Tensor):
            if end.numel() != numel:
                raise ValueError(f"end has {end.numel()} elements, expected {numel}")
        elif end is not None:
            end = tuple(end)
            if len(end) != len(groups) or any(t is not None and t.numel() != n for t, n in zip(end, sizes,
                                                                                                   strict=True)):
                raise ValueError("end must hold one tensor (or None) per group, of the group's size")
        self.op, self.weight, self.masked = op, float(weight), masked
        self.start, self.end, self.mask = start, end, mask
        self.factors = None if factors is None else tuple(float(f) for f in factors)
        self.groups, self.valid = groups, numel
        self.base, self.length = 0, numel  # the window of the expression this object stands for
        self._out = out  # where materialize() writes (e.g. a bucket's payload buffer)
        self._cache = cache  # where flat_end() and the CUDA kernels keep what they make once (e.g. a bucket's)
        self._root: Source = self
        self._value: torch.Tensor | None = None  # the root's materialised expression, once made
        ref = start if start is not None else (end if isinstance(end, torch.Tensor) else
                                               next((t for t in end if t is not None), None))
        self.device = ref.device if ref is not None else (out.device if out is not None else torch.device("cpu"))

    @classmethod
    def lerp(cls, start: torch.Tensor, end, weight: float, *, groups: Sequence[int],
             factors: Sequence[float] | None = None, mask: torch.Tensor | None = None,
             out: torch.Tensor | None = None, cache: dict | None = None) -> Source:
        """``torch.lerp(start, end, weight)`` [``* factors[k]``] (1-bit Adam's momentum payload)."""
        return cls("lerp", numel=start.numel(), groups=groups, start=start, end=end, weight=weight,
                   factors=factors, mask=mask, out=out, cache=cache)

    @classmethod
    def gradient(cls, end, *, numel: int, groups: Sequence[int], mask: torch.Tensor | None = None,
                 masked: str = "zero", out: torch.Tensor | None = None, cache: dict | None = None) -> Source:
        """``end`` itself, masked positions 0 (0/1 Adam's 1-bit gradient steps)."""
        return cls("gradient", numel=numel, groups=groups, end=end, mask=mask, masked=masked, out=out, cache=cache)

    @classmethod
    def quotient(cls, start: torch.Tensor, divisors: Sequence[float], *, groups: Sequence[int],
                 mask: torch.Tensor | None = None, masked: str = "zero", out: torch.Tensor | None = None,
                 cache: dict | None = None) -> Source:
        """``start / divisors[k]`` (0/1 Adam's lr-weighted mean momentum of an interval)."""
        return cls("quotient", numel=start.numel(), groups=groups, start=start, factors=divisors, mask=mask,
                   masked=masked, out=out, cache=cache)

    # -- the tensor protocol the collectives use -------------------------------------------
    dtype = torch.float32

    def numel(self) -> int:
        return self.length

    def dim(self) -> int:
        return 1

    def is_floating_point(self) -> bool:
        return True

    def reshape(self, *shape) -> Source:
        if shape not in ((-1,), ((-1,),)):
            raise ValueError("a Source is a flat vector: reshape(-1) only")
        return self

    def padded(self, length: int) -> Source:
        """This expression with zero padding up to ``length`` elements (the collective's chunks)."""
        if self.base != 0 or length < self.valid:
            raise ValueError(f"pad the whole expression ({self.valid} elements) to at least that, got {length}")
        return self._window(0, length)

    def __getitem__(self, key: slice) -> Source:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a Source takes contiguous windows only (x[lo:hi])")
        lo, hi, _ = key.indices(self.length)
        return self._window(self.base + lo, max(0, hi - lo))

    def _window(self, base: int, length: int) -> Source:
        w = object.__new__(Source)
        w.__dict__.update(self.__dict__)
        w.base, w.length = base, length
        return w

    # -- evaluation ------------------------------------------------------------------------
    def end_tensors(self) -> list[torch.Tensor | None]:
        """``end`` as one tensor (or None) per group."""
        if isinstance(self.end, torch.Tensor):
            flat = self.end.reshape(-1)
            bounds = (*self.groups, self.valid)
            return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return list(self.end) if self.end is not None else []

    def flat_end(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """``end`` as one flat fp32 tensor of ``numel`` elements (per-group tensors copied into
        ``out``, or a new tensor; zeros for a group without one): one foreach copy, into views of
        ``out`` kept in the cache given at construction while ``out`` and the groups' shapes stay."""
        if isinstance(self.end, torch.Tensor):
            return self.end.reshape(-1)
        if out is None:
            out = torch.empty(self.valid, dtype=torch.float32, device=self.device)
        bounds = (*self.groups, self.valid)
        key = (out.data_ptr(), bounds, tuple(None if t is None else t.shape for t in self.end))
        views = None if self._cache is None else self._cache.get("end_views")
        if views is None or views[0] != key:
            flat = out.reshape(-1)
            pieces = list(zip(self.end, bounds[:-1], bounds[1:], strict=True))
            views = (key, [flat[a:b].view(t.shape) for t, a, b in pieces if t is not None],
                     [flat[a:b] for t, a, b in pieces if t is None])
            if self._cache is not None:
                self._cache["end_views"] = views
        if views[1]:
            torch._foreach_copy_(views[1], [t for t in self.end if t is not None])
        if views[2]:
            torch._foreach_zero_(views[2])
        return out

    def materialize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The window as an fp32 tensor, by the torch ops that define the expression's bits (made
        once per expression and shared by its windows). ``out``: where a first evaluation of the
        whole expression writes it (``numel`` elements) instead of the buffer given at construction,
        e.g. the collective's own send buffer, which saves it a copy; a window ignores it, since its
        result would sit at the window's offset in ``out``, not at its start."""
        root = self._root
        if root._value is None:
            whole = self.base == 0 and self.length >= root.valid
            root._value = root._evaluate(out if whole else None)
        full = root._value
        if self.base + self.length <= root.valid:
            return full[self.base:self.base + self.length]
        out = torch.zeros(self.length, dtype=torch.float32, device=self.device)
        n = max(0, root.valid - self.base)
        out[:n] = full[self.base:self.base + n]
        return out

    def _evaluate(self, out: torch.Tensor | None = None) -> torch.Tensor:
        n = self.valid
        out = out if out is not None else self._out
        out = out if out is not None else torch.empty(n, dtype=torch.float32, device=self.device)
        out = out.reshape(-1)[:n]
        bounds = (*self.groups, n)
        views = [out[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if self.op == "lerp":
            if isinstance(self.end, torch.Tensor):
                torch.lerp(self.start, self.end.reshape(-1).float(), self.weight, out=out)
            else:  # tensor by tensor: no flat copy of the gradients first (a bucket-sized write and read)
                for v, a, b, t in zip(views, bounds[:-1], bounds[1:], self.end, strict=True):
                    if t is None:
                        v.zero_()  # the end of a group without gradient; lerp reads it in place
                    torch.lerp(self.start[a:b], v if t is None else t.reshape(-1).float(), self.weight, out=v)
            if self.factors is not None:
                torch._foreach_mul_(views, list(self.factors))
        elif self.op == "gradient":
            end = self.flat_end(out)
            if end.data_ptr() != out.data_ptr():
                out.copy_(end)  # the payload is a copy: the gradient itself stays as it is
        else:
            for v, a, b, f in zip(views, bounds[:-1], bounds[1:], self.factors, strict=True):
                torch.div(self.start[a:b], f, out=v)
        if self.mask is not None and self.mask.numel():
            # index_fill_ / index_copy_: cheaper than a tensor-indexed assignment on the CPU
            if self.masked == "zero":
                out.index_fill_(0, self.mask, 0.0)
            else:
                out.index_copy_(0, self.mask, self._end_at(self.mask).mul_(0.0).abs_())
        return out

    def _end_at(self, idx: torch.Tensor) -> torch.Tensor:
        """``end`` (fp32) at the sorted positions ``idx``, read from the group tensors where they are."""
        if isinstance(self.end, torch.Tensor):
            return torch.take(self.end, idx).float()
        bounds = (*self.groups, self.valid)
        cuts = torch.searchsorted(idx, torch.tensor(bounds, device=idx.device)).tolist()
        parts = [torch.zeros(hi - lo, device=idx.device) if t is None
                 else torch.take(t, idx[lo:hi] if a == 0 else idx[lo:hi] - a).float()
                 for t, a, lo, hi in zip(self.end, bounds[:-1], cuts[:-1], cuts[1:], strict=True) if hi > lo]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, device=idx.device)

    def __repr__(self) -> str:
        return f"Source({self.op}, numel={self.valid}, window=[{self.base}, {self.base + self.length}))"


class Sink:
    """What becomes of a decoded result where it is written (the counterpart of :class:`Source`).

    ``out[mask] = 0`` (coordinates the optimizer masks), then, for every group k with a target,

    .. math::  t_k \\leftarrow t_k \\cdot \\text{decay} + (v_k \\cdot \\text{out}_k) / d_k

    AdamW's last line as torch runs it (``_foreach_mul_``, then ``_foreach_addcdiv_``, whose
    ``addcdiv`` rounds ``(v * out) / d`` and then the sum), on fp32 targets of the groups' shapes
    (``None``: the group is left alone, e.g. a parameter without gradient). The numba CPU backend
    applies it tile by tile right after decoding, while the values are in the cache (one pass
    instead of a decode and an update), and the cuda backend's predicated decode element by element
    with the same roundings (one step size for the groups); otherwise the caller decodes and then
    calls :meth:`apply`.
    """

    def __init__(self, *, numel: int, groups: Sequence[int], targets: Sequence[torch.Tensor | None],
                 denom: torch.Tensor, values: Sequence[float], decay: float,
                 mask: torch.Tensor | None = None, cache: dict | None = None) -> None:
        groups, sizes = _checked_groups(groups, numel, "Sink")
        if len(targets) != len(groups) or len(values) != len(groups):
            raise ValueError("a Sink needs one target (or None) and one value per group")
        for t, n in zip(targets, sizes, strict=True):
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n):
                raise ValueError("Sink targets must be contiguous fp32 tensors of their group's size")
        if denom.numel() != numel:
            raise ValueError(f"denom has {denom.numel()} elements, expected {numel}")
        self.groups, self.valid = groups, numel
        self.targets, self.denom = list(targets), denom
        self.values, self.decay = tuple(float(v) for v in values), float(decay)
        self.mask = mask if mask is not None and mask.numel() else None
        self.base = 0
        self._cache = cache  # where apply() keeps its per-tensor views between steps (e.g. a bucket's)

    def __getitem__(self, key: slice) -> Sink:
        """The sink of a window ``[lo, hi)`` of the result (a pipeline piece of one row)."""
        lo, _, _ = key.indices(self.valid + (1 << 62))
        w = object.__new__(Sink)
        w.__dict__.update(self.__dict__)
        w.base = self.base + lo
        return w

    def apply(self, out: torch.Tensor, *, decay: torch.Tensor | None = None) -> None:
        """Apply the sink to ``out``, the whole decoded result (the reference the kernels match).

        ``decay``: the decay as a 0-d fp32 tensor on the device, for a step decided there: 1 and ``out``
        zeros where it was skipped (:meth:`~lightning_onebit.compress.Codec.decode_predicated`), so that
        the targets keep their bits (with negative values, as a step size is: ``t + -0.0`` is ``t``)."""
        if self.mask is not None:
            out.reshape(-1)[: self.valid][self.mask] = 0.0
        bounds = (*self.groups, self.valid)
        keep = [k for k, t in enumerate(self.targets) if t is not None]
        if not keep:
            return
        targets = [self.targets[k] for k in keep]
        if self.decay != 1.0:
            torch._foreach_mul_(targets, self.decay if decay is None else decay)
        key = (out.data_ptr(), self.denom.data_ptr(), bounds, tuple(keep), tuple(t.shape for t in targets))
        views = None if self._cache is None else self._cache.get("sink_views")
        if views is None or views[0] != key:
            flat = out.reshape(-1)
            us = [flat[bounds[k]:bounds[k + 1]].view_as(self.targets[k]) for k in keep]
            ds = [self.denom.reshape(-1)[bounds[k]:bounds[k + 1]].view_as(self.targets[k]) for k in keep]
            views = (key, us, ds)
            if self._cache is not None:
                self._cache["sink_views"] = views
        torch._foreach_addcdiv_(targets, views[1], views[2], [self.values[k] for k in keep])

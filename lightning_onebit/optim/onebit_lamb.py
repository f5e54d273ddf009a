"""1-bit LAMB (Li et al. 2021; Tarasov & Ershov 2022, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compress import flat_buffer
from ..compress.source import Source
from .base import CompressedOptimizer
from .buckets import Bucket
from .conversion import _is_lamb
from .functional_lamb import Flat, LayerStats, lamb_moments_, scaled_step_, shift_in_, stats_kernel
from .lamb_factors import LayerFactors
from .onebit_adam import OnebitAdam, _bias_correction

__all__ = ["OnebitLamb"]

_BOUNDS = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold")


def _check_bounds(g: dict) -> None:
    if not (0 < g["min_coeff"] <= g["max_coeff"] and 0 < g["factor_min"] <= g["factor_max"]
            and g["factor_threshold"] >= 0 and 0 <= g["coeff_beta"] < 1):
        raise ValueError("OnebitLamb needs 0 < min_coeff <= max_coeff, 0 < factor_min <= factor_max, "
                         f"factor_threshold >= 0 and 0 <= coeff_beta < 1; got {({k: g[k] for k in _BOUNDS})}")


class OnebitLamb(LayerFactors, OnebitAdam):
    r"""1-bit LAMB: LAMB warm-up, then frozen variance, 1-bit compressed momentum and a
    layer-wise scaling factor from a fresh variance reconstructed from synced momenta.

    Warm-up (per layer = parameter tensor), exactly LAMB with bias correction:

    .. math::
       u = \hat m / (\sqrt{\hat v} + \epsilon) + \lambda\theta,\quad
       c = \mathrm{clip}(\|\theta\| / \|u\|,\ c_{min}, c_{max}),\quad
       \theta \leftarrow \theta - \gamma c u

    and the frozen coefficient :math:`\bar c` is the bias-corrected exponential average (rate
    ``coeff_beta``) of the warm-up coefficients where :math:`\|\theta\|, \|u\| > 0`.

    Compression: each layer's momentum is multiplied by ``scaling_coeff`` = (mean over layers
    of the momentum's rms) / (this layer's rms), both taken at the switch, before the compressed
    allreduce (1-bit, error feedback) and divided by it after, as DeepSpeed does; then
    :math:`\tilde g = (m_t - \beta_1 m_{t-1}) / (1-\beta_1)` rebuilds the gradient,
    :math:`v^{fresh} \leftarrow \beta_2 v^{fresh} + (1-\beta_2)\tilde g^2` (initialised to the
    frozen :math:`\hat v`); with :math:`d = \sqrt{\hat v + \epsilon}` (or
    :math:`\sqrt{\hat v} + \epsilon`) and :math:`d^{fresh}` likewise, the layer factor
    :math:`f = \max(d / d^{fresh})` is blended with the weight-decay share of the update,
    clipped to [factor_min, factor_max] and to +-factor_threshold relative change per step,
    and :math:`\theta \leftarrow \theta - \gamma \bar c f (\hat m / d + \lambda\theta)`.

    Next to DeepSpeed's ``OnebitLamb``: DeepSpeed compresses all layers' momenta in one buffer
    with one scale, so ``scaling_coeff`` is what keeps a small layer's momentum from drowning in
    a large one's; here every tensor has its own scales already, so the coefficient only changes
    the rounding (it is kept for fidelity, and its error-feedback state is in scaled units).
    DeepSpeed's frozen coefficient starts at 0 and is updated only when a step's coefficient is
    not 1, without bias correction, so a warm-up of k updates yields (1 - coeff_beta^k) of the
    average (0.65x after 10 steps at 0.9) and a layer whose coefficient was always 1 freezes at
    0 and never moves again; here it is bias-corrected, skips only undefined ratios (zero weight
    or update norm; a coefficient clipped to exactly 1 counts) and is 1 for a layer that had none.
    The bounds (``max_coeff`` ... ``factor_threshold``) are per param group, defaulting to the
    arguments.

    Memory per parameter: m, v, v_fresh, m_prev (fp32) + worker error + 1/n server error.
    """

    # on a GPU its compressed update is three kernels predicated on the call's flag (the decode's shift folded into
    # the statistics kernel, the factors, the scaled step): see _defers
    skips_on_device = True

    strategy_name = "onebit_lamb"
    converts_lamb = True
    decodes_in_update = False  # its update needs the synced and the previous momentum
    flat_state = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "exp_avg_prev")
    from_adam = CompressedOptimizer.from_adam  # its warm-up is LAMB's: no fused AdamW kernel

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int | None = 1000, *,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 eps_inside_sqrt: bool = True, block_size: int | None = None,
                 bucket_cap_mb: float = 25.0, group=None, simulate_workers: int | None = None,
                 warmup_comm_dtype: torch.dtype | str | None = None) -> None:
        bounds = dict(max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                      factor_min=factor_min, factor_threshold=factor_threshold)
        _check_bounds(bounds)
        self._united_scale: float | None = None
        #: (step, bucket, group, its parameters with a gradient, their u views, their statistics on the device)
        #: of this step's compressed updates, finished by _finish_updates
        self._lamb_pending: list[tuple] = []
        #: by param group: the layers' last factors and frozen coefficients on the device (see _factor_state)
        self._factors = {}
        super().__init__(params, lr, betas, eps, weight_decay, warmup_steps, eps_inside_sqrt=eps_inside_sqrt,
                         block_size=block_size, bucket_cap_mb=bucket_cap_mb, group=group,
                         simulate_workers=simulate_workers, warmup_comm_dtype=warmup_comm_dtype, _defaults=bounds)

    @classmethod
    def conversion_advice(cls, opt: torch.optim.Optimizer) -> str | None:
        # LAMB moves each layer by lr * ||w|| per step, Adam by ~lr per coordinate: the same lr
        # is a much smaller step for LAMB (an Adam lr of 1e-3 barely moves the loss)
        if _is_lamb(opt):
            return None
        return ("LAMB scales each layer's step to lr * ||w||, so an Adam learning rate is usually too small for it. "
                f"Return a LAMB (or {cls.__name__}) with a LAMB learning rate to silence this.")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        _check_bounds(self.param_groups[-1])

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "united_scale": self._united_scale}

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self._united_scale = extra.get("united_scale")

    def state_dict(self) -> dict:
        self._sync_factors()  # the per-parameter last factors, kept on the device between steps
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._factors = {}  # the loaded per-parameter state is the truth now
        super().load_state_dict(state_dict)

    # -- whole-tensor statistics ----------------------------------------------------------
    def _norms(self, tensors: list[torch.Tensor]) -> list[float]:
        """Each tensor's L2 norm in one host read; of the whole tensor where this rank holds a shard of it."""
        if not tensors:
            return []
        if self.whole_tensor_stats is None:
            return torch.stack([t.norm() for t in tensors]).tolist()
        squares = torch.stack([torch.dot(f, f) for f in (t.reshape(-1) for t in tensors)])
        return self.whole_tensor_stats(squares, squares[:0])[0].sqrt().tolist()

    def _rms(self, params: list[torch.Tensor], views: list[torch.Tensor]) -> list[float]:
        """The root mean square of each parameter's ``views`` (its whole tensor's, where this rank holds a shard)."""
        if not views:
            return []
        if self.whole_tensor_stats is None:
            return torch.stack([v.norm() / v.numel() ** 0.5 for v in views]).tolist()
        sizes = self.bucket_sizes or {}
        return [n / sizes.get(id(p), v.numel()) ** 0.5
                for p, v, n in zip(params, views, self._norms(views), strict=True)]

    # -- warm-up ---------------------------------------------------------------------------
    def _update_warmup(self, b: Bucket, grad: torch.Tensor, group: dict, has_grad: list[bool]) -> None:
        m, v = self._warmup_moments(b, grad, group)
        beta1, beta2 = group["betas"]
        wd, cb = group["weight_decay"], group["coeff_beta"]
        keep = [i for i, h in enumerate(has_grad) if h]
        if not keep:
            return
        ms, vs, us, steps = b.views(m), b.views(v), b.views(self._scratch(b)), self._steps(b)
        ws = [b.params[i].detach().float() for i in keep]
        for i, w in zip(keep, ws, strict=True):  # u = m_hat / (sqrt(v_hat) + eps) + wd w, as torch's ops round it
            u = torch.div(ms[i], _bias_correction(beta1, steps[i]), out=us[i])
            u.div_((vs[i] / _bias_correction(beta2, steps[i])).sqrt_().add_(group["eps"]))
            if wd:
                u.add_(w, alpha=wd)
        norms = self._norms([*ws, *(us[i] for i in keep)])  # every ||w||, ||u|| of the bucket in one read
        for j, i in enumerate(keep):
            p = b.params[i]
            coeff, defined = self._trust_ratio(p, norms[j], norms[len(keep) + j], group)
            if defined:
                st = self.state[p]
                st["lamb_coeff_ema"] = cb * st.get("lamb_coeff_ema", 0.0) + (1 - cb) * coeff
                st["lamb_coeff_n"] = st.get("lamb_coeff_n", 0) + 1
            p.add_(us[i].to(p.dtype), alpha=-group["lr"] * coeff)

    @staticmethod
    def _trust_ratio(p: torch.Tensor, w_norm: float, u_norm: float, group: dict) -> tuple[float, bool]:
        """(clipped ||w|| / ||u||, whether the ratio is defined) for parameter ``p``; 1 where it is not."""
        if w_norm > 0 and u_norm > 0:
            return min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"]), True
        return 1.0, False

    # -- switch ----------------------------------------------------------------------------
    def _on_start_compression(self) -> None:
        # DeepSpeed's united scale: the mean momentum rms over all layers, at the switch
        due = [b for b in self._buckets if b.switch_step is None]
        rms = self._rms([p for b in due for p in b.params], [v for b in due for v in b.views(b.flat["exp_avg"])])
        self._united_scale = sum(rms) / len(rms) if rms else 1.0

    def _on_switch(self, b: Bucket) -> None:
        self._sync_factors()  # the factors of buckets that switched before stay; this one's start at 1
        group = self.param_groups[b.group_index]
        beta2, cb = group["betas"][1], group["coeff_beta"]
        fresh, v = b.flat["exp_avg_sq_fresh"], b.flat["exp_avg_sq"]
        for out, vv, t in zip(b.views(fresh), b.views(v), self._steps(b, "frozen_step"), strict=True):
            torch.div(vv, _bias_correction(beta2, t), out=out)  # v_fresh starts at the frozen v_hat
        united = self._united_scale if self._united_scale is not None else 1.0
        for p, rms in zip(b.params, self._rms(b.params, b.views(b.flat["exp_avg"])), strict=True):
            st = self.state[p]
            st["last_factor"] = 1.0
            n = st.get("lamb_coeff_n", 0)
            st["lamb_coeff_freeze"] = st.get("lamb_coeff_ema", 0.0) / (1 - cb**n) if n else 1.0
            st["scaling_coeff"] = united / rms if rms > 0 else 1.0

    # -- compression -----------------------------------------------------------------------
    def _scaling(self, b: Bucket) -> list[float]:
        return [self.state[p]["scaling_coeff"] for p in b.params]

    def _payload(self, b: Bucket, grad, out: torch.Tensor) -> Source:
        beta1 = self.param_groups[b.group_index]["betas"][0]
        return Source.lerp(b.flat["exp_avg"], grad, 1 - beta1, groups=b.offsets, factors=self._scaling(b),
                           mask=self._mask(b), out=out, cache=b.cache)

    def _sync_target(self, b: Bucket) -> torch.Tensor:
        return b.synced  # exp_avg is still needed: _absorb keeps it as exp_avg_prev first

    def _defers(self, b: Bucket) -> bool:
        """Where the statistics kernel runs (a GPU, whole tensors, contiguous fp32 parameters) the update decodes
        the result and its statistics kernel shifts it in: every write of the step is then a kernel's, predicated
        on the call's flag, so the device can decide the step."""
        return (self.whole_tensor_stats is None and stats_kernel(b.flat["exp_avg"])
                and self._sink_targets(b) is not None)

    def _divisors(self, b: Bucket) -> torch.Tensor:
        """Each parameter's ``scaling_coeff`` as fp32 on the bucket's device (what the shift divides by), made
        again only when they change (at a switch or a load)."""
        key = tuple(self._scaling(b))
        hit = b.cache.get("divisors")
        if hit is None or hit[0] != key or hit[1].device != b.device:
            hit = b.cache["divisors"] = (key, torch.tensor(key, dtype=torch.float32).to(b.device))
        return hit[1]

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        m = b.flat["exp_avg"]
        shift_in_(b.kept_views("exp_avg_prev", b.flat["exp_avg_prev"]), b.kept_views("exp_avg", m),
                  b.kept_views("synced", synced), self._scaling(b), flat=(b.flat["exp_avg_prev"], m))
        super()._absorb(b, m)

    def _activate(self, b: Bucket, pos: torch.Tensor, g: torch.Tensor, v: torch.Tensor, beta1: float) -> None:
        super()._activate(b, pos, g, v, beta1)
        b.flat["exp_avg_sq_fresh"][pos] = g * g  # the fresh variance starts at the new v_hat too

    def _scratch(self, b: Bucket) -> torch.Tensor:
        """A bucket-sized work buffer for the update u, reused every step (a fresh one costs page faults)."""
        if "scratch" not in b.cache:
            b.cache["scratch"] = flat_buffer(b.numel, device=b.device, zero=False)
        return b.cache["scratch"]

    @staticmethod
    def _lengths(b: Bucket) -> torch.Tensor:
        """Each parameter's length in the bucket's buffers, on their device (made once)."""
        hit = b.cache.get("lengths")
        if hit is None or hit.device != b.device:
            hit = b.cache["lengths"] = torch.tensor(b.numels, dtype=torch.int64).to(b.device)
        return hit

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        m = b.flat["exp_avg"]
        fresh, prev = b.flat["exp_avg_sq_fresh"], b.flat["exp_avg_prev"]
        prelim = self._scratch(b)
        denom = self._denominator(b, group)  # v is frozen: computed once per switch
        # the fresh variance of the rebuilt gradient (m - beta1 m_prev) / (1 - beta1), u = m_hat / d and each
        # layer's max d / d_fresh, in one pass
        # the bucket's buffers stay from step to step: their per-parameter views are made once
        ups = b.kept_views("scratch", prelim)
        # where the torch ops run, on the whole buffers: the synced result, absorbed already, is their scratch
        flat = Flat(m, prev, fresh, denom, prelim, self._lengths(b), b.synced)
        keep = [i for i, h in enumerate(has_grad) if h]
        everyone = len(keep) == len(has_grad)
        ps = self._detached(b)
        idx = self._mask(b)
        bcs = [_bias_correction(beta1, t) for t in self._steps(b)]
        shift = go = None
        if b.sync.deferred:  # _defers: the result is decoded and shifted in here, on the device
            predicate = b.sync.comm.pending_predicate  # a call the device decided
            b.sync.comm.decode_pending(out=b.synced)  # written only if the call went through
            go = None if predicate is None else predicate.took
            if everyone and len(set(bcs)) == 1:
                shift = (b.synced, self._divisors(b))
            else:  # torch's ops (a parameter without a gradient, or with fewer steps): the host reads whether to step
                if go is not None and not bool(go[0]):
                    return
                go = None
                self._absorb(b, b.synced)
        # on a GPU one kernel a bucket: the moments, u and every layer's maximum and dot products in one pass (its
        # parameters fp32 and contiguous: _detached found out once)
        stats = None
        if everyone and b.cache["params_fp32"] and stats_kernel(flat):
            out, col, rows = self._stats_buffer(b, 4 if wd else 1)
            stats = LayerStats(ps, b.offsets, out, idx, shift, go, col)
        maxima = lamb_moments_(b.kept_views("exp_avg", m), b.kept_views("exp_avg_prev", prev),
                               b.kept_views("exp_avg_sq_fresh", fresh), b.kept_views("denom", denom), ups, bcs,
                               beta1=beta1, beta2=beta2, eps=eps, eps_inside_sqrt=group["eps_inside_sqrt"], flat=flat,
                               stats=stats)
        if maxima is not None and idx is not None:
            prelim.index_fill_(0, idx, 0.0)
        # every per-layer scalar: max ratio, ||u||^2, <u, p>, ||p||^2
        if not keep:
            return
        if maxima is None:
            stats = rows
        else:
            us = self._flat_views(b, "scratch", ups)
            pf = [p if p.dtype == torch.float32 else p.float() for p in self._flat_views(b, "params", ps)]
            if not everyone:
                us, pf = [us[i] for i in keep], [pf[i] for i in keep]
            stats = [maxima if everyone else maxima[keep]]
            if wd:
                stats += [torch.stack([u.dot(u) for u in us]),
                          torch.stack([u.dot(q) for u, q in zip(us, pf, strict=True)]),
                          torch.stack([q.dot(q) for q in pf])]
        if self.whole_tensor_stats is not None:  # the whole tensors' maxima and dot products, from the shards'
            sums, top = self.whole_tensor_stats(torch.cat(stats[1:]) if wd else stats[0][:0], stats[0])
            stats = [top, *sums.view(len(stats) - 1, -1)]
        # turned into step sizes with every other bucket's of its group at the end of the step (_finish_updates)
        self._lamb_pending.append((self._step, b, group, keep, ups, stats, go))

    def _finish_updates(self) -> None:
        pending, self._lamb_pending = self._lamb_pending, []
        pending = [entry for entry in pending if entry[0] == self._step]  # not those of a step that raised
        for group in {id(e[2]): e[2] for e in pending}.values():
            entries = [e for e in pending if e[2] is group]
            sizes = self._layer_steps(entries, group)
            for (_, b, _, keep, ups, _, go), (steps, decays) in zip(entries, sizes, strict=True):
                ps = self._detached(b)
                if len(keep) == len(b.params):  # the whole bucket: one launch where the backend has the kernel
                    scaled_step_(ps, ups, steps, decays, flat=(self._scratch(b), b.offsets), go=go)
                else:
                    scaled_step_([ps[i] for i in keep], [ups[i] for i in keep], steps, decays)

    @staticmethod
    def _flat_views(b: Bucket, name: str, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """``views`` (a list the bucket keeps: its kept views, its detached parameters) flattened, made again
        only when it is another list."""
        key = ("flat views", name)
        hit = b.cache.get(key)
        if hit is None or hit[0] is not views:
            hit = b.cache[key] = (views, [v.reshape(-1) for v in views])
        return hit[1]

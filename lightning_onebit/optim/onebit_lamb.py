"""1-bit LAMB (Li et al. 2021; Tarasov & Ershov 2022, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .base import _Bucket
from .onebit_adam import OnebitAdam

__all__ = ["OnebitLamb"]


class OnebitLamb(OnebitAdam):
    r"""1-bit LAMB: LAMB warm-up, then frozen variance, 1-bit compressed momentum and a
    layer-wise scaling factor from a fresh variance reconstructed from synced momenta.

    Warm-up (per layer = parameter tensor), exactly LAMB with bias correction:

    .. math::
       u = \hat m / (\sqrt{\hat v} + \epsilon) + \lambda\theta,\quad
       c = \mathrm{clip}(\|\theta\| / \|u\|,\ c_{min}, c_{max}),\quad
       \theta \leftarrow \theta - \gamma c u,\quad
       \bar c \leftarrow \beta_c \bar c + (1-\beta_c) c

    Compression: :math:`m_t` = compressed allreduce (1-bit, error feedback) of the local
    momentum; :math:`\tilde g = (m_t - \beta_1 m_{t-1}) / (1-\beta_1)` rebuilds the gradient,
    :math:`v^{fresh} \leftarrow \beta_2 v^{fresh} + (1-\beta_2)\tilde g^2` (initialised to the
    frozen :math:`\hat v`); with :math:`d = \sqrt{\hat v + \epsilon}` (or
    :math:`\sqrt{\hat v} + \epsilon`) and :math:`d^{fresh}` likewise, the layer factor
    :math:`f = \max(d / d^{fresh})` is blended with the weight-decay share of the update,
    clipped to [factor_min, factor_max] and to +-factor_threshold relative change per step,
    and :math:`\theta \leftarrow \theta - \gamma \bar c f (\hat m / d + \lambda\theta)`.

    Memory per parameter: m, v, v_fresh, m_prev (fp32) + worker error + 1/n server error.
    """

    flat_state = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "exp_avg_prev")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int | None = 1000,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 eps_inside_sqrt: bool = True, block_size: int | None = None, *,
                 bucket_cap_mb: float = 25.0, group=None, simulate_workers: int | None = None) -> None:
        if not 0 < min_coeff <= max_coeff or not 0 < factor_min <= factor_max or factor_threshold < 0:
            raise ValueError("need 0 < min_coeff <= max_coeff, 0 < factor_min <= factor_max, factor_threshold >= 0")
        super().__init__(params, lr, betas, eps, weight_decay, warmup_steps, eps_inside_sqrt, block_size,
                         bucket_cap_mb=bucket_cap_mb, group=group, simulate_workers=simulate_workers)
        for g in self.param_groups:
            g.update(max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max,
                     factor_min=factor_min, factor_threshold=factor_threshold)
        self.defaults.update(max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
                             factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold)

    def _update_warmup(self, b: _Bucket, grad: torch.Tensor, group: dict, has_grad: list[bool]) -> None:
        m, v, bc1, bc2 = self._warmup_moments(b, grad, group)
        update = (m / bc1) / (v / bc2).sqrt_().add_(group["eps"])
        wd = group["weight_decay"]
        for p, u, h in zip(b.params, b.views(update), has_grad, strict=True):
            if not h:
                continue
            if wd:
                u.add_(p.detach().float(), alpha=wd)
            st = self.state[p]
            coeff = self._trust_ratio(p, u, group)
            st["lamb_coeff_freeze"] = group["coeff_beta"] * st.get("lamb_coeff_freeze", 0.0) + (
                1 - group["coeff_beta"]) * coeff
            p.add_(u.to(p.dtype), alpha=-group["lr"] * coeff)

    @staticmethod
    def _trust_ratio(p: torch.Tensor, u: torch.Tensor, group: dict) -> float:
        w_norm, u_norm = p.detach().float().norm().item(), u.norm().item()
        coeff = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
        return min(max(coeff, group["min_coeff"]), group["max_coeff"])

    def _on_switch(self) -> None:
        super()._on_switch()
        for b in self._buckets or []:
            self._init_fresh(b)

    def _init_fresh(self, b: _Bucket) -> None:
        group = self.param_groups[b.group_index]
        bc2 = 1 - group["betas"][1] ** self._frozen_step
        b.flat["exp_avg_sq_fresh"].copy_(b.flat["exp_avg_sq"]).div_(bc2)
        for p in b.params:
            self.state[p]["last_factor"] = 1.0
            self.state[p].setdefault("lamb_coeff_freeze", 1.0)

    def _sync_target(self, b: _Bucket) -> torch.Tensor:
        return b.synced  # exp_avg is still needed: _absorb keeps it as exp_avg_prev first

    def _absorb(self, b: _Bucket, synced: torch.Tensor) -> None:
        if "last_factor" not in self.state[b.params[0]]:
            self._init_fresh(b)  # buckets built after the switch (e.g. start_compression before step 1)
        b.flat["exp_avg_prev"].copy_(b.flat["exp_avg"])
        super()._absorb(b, synced)

    def _scratch(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Two bucket-sized work buffers, reused every step (fresh ones cost page faults)."""
        if "scratch" not in b.cache:
            b.cache["scratch"] = (torch.empty_like(b.flat["exp_avg"]), torch.empty_like(b.flat["exp_avg"]))
            b.cache["lengths"] = torch.tensor(b.numels, device=b.device)
        return b.cache["scratch"]

    def _update_compressed(self, b: _Bucket, group: dict, has_grad: list[bool]) -> None:
        beta1, beta2 = group["betas"]
        eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
        m, v = b.flat["exp_avg"], b.flat["exp_avg_sq"]
        fresh, prev = b.flat["exp_avg_sq_fresh"], b.flat["exp_avg_prev"]
        work, prelim = self._scratch(b)
        # fresh variance of the rebuilt gradient g = (m - beta1 m_prev) / (1 - beta1)
        torch.sub(m, prev, alpha=beta1, out=work)
        fresh.mul_(beta2).addcmul_(work, work, value=(1 - beta2) / (1 - beta1) ** 2)
        denom = self._denominator(v, group, b)  # v is frozen: computed once per switch
        if group["eps_inside_sqrt"]:
            torch.add(fresh, eps, out=work).sqrt_()
        else:
            torch.sqrt(fresh, out=work).add_(eps)
        ratio = torch.div(denom, work, out=work)
        torch.div(m, denom, out=prelim).mul_(1 / (1 - beta1**self._step))
        mask = self._zero_mask(b)
        if mask is not None:
            prelim.masked_fill_(mask, 0.0)
        # every per-layer scalar in one device->host transfer: max ratio, ||u||^2, <u, p>, ||p||^2
        keep = [i for i, h in enumerate(has_grad) if h]
        if not keep:
            return
        ups, ps = b.views(prelim), [b.params[i].detach() for i in keep]
        us = [ups[i].reshape(-1) for i in keep]
        pf = [p.reshape(-1).float() for p in ps]
        stats = [torch.segment_reduce(ratio, "max", lengths=b.cache["lengths"])[keep]]
        if wd:
            stats += [torch.stack([u.dot(u) for u in us]), torch.stack([u.dot(q) for u, q in zip(us, pf, strict=True)]),
                      torch.stack([q.dot(q) for q in pf])]
        rows = torch.stack(stats).tolist()
        for j, i in enumerate(keep):
            p, st = b.params[i], self.state[b.params[i]]
            factor = rows[0][j]
            if wd:
                uu, up, pp = rows[1][j], rows[2][j], rows[3][j]
                un2 = max(uu + 2 * wd * up + wd * wd * pp, 0.0)  # ||u + wd p||^2
                share = min(1.0, (uu / un2) ** 0.5) if un2 > 0 else 1.0
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, group["factor_min"]), group["factor_max"])
            last = st["last_factor"]
            factor = min(max(factor, last * (1 - group["factor_threshold"])), last * (1 + group["factor_threshold"]))
            st["last_factor"] = factor
            step = lr * st["lamb_coeff_freeze"] * factor
            with torch.no_grad():  # p <- p - step (u + wd p)
                if wd:
                    p.mul_(1 - step * wd)
                p.add_(ups[i].to(p.dtype), alpha=-step)

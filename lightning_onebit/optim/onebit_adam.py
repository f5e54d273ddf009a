"""1-bit Adam (Tang et al. 2021) with the Tarasov-Ershov epsilon fix, and QAdam (Bagua)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compress import Codec, MinMaxUInt8Codec, SignCodec
from .base import CompressedOptimizer, _Bucket

__all__ = ["OnebitAdam", "QAdam"]


class OnebitAdam(CompressedOptimizer):
    r"""1-bit Adam: AdamW warm-up, then frozen variance and 1-bit compressed momentum.

    .. math::
       \textbf{warm-up } (t \le T_w):\ & \text{exactly AdamW on the averaged gradient } \bar g_t \\
       \textbf{compression } (t > T_w):\ & m_t^{(i)} = \beta_1 m_{t-1} + (1-\beta_1) g_t^{(i)}
           \quad \text{(local gradient of worker } i) \\
       & m_t = \mathrm{CompressedAllreduce}_{\text{1-bit, error feedback}}(m_t^{(i)}) \\
       & \hat v = v_{T_w} / (1-\beta_2^{T_w}) \quad \text{(frozen)} \\
       & \theta_t = \theta_{t-1}(1 - \gamma\lambda) - \gamma\, \frac{m_t / (1-\beta_1^t)}{d},\quad
         d = \sqrt{\hat v + \epsilon}\ \ (\texttt{eps\_inside\_sqrt=True})
         \text{ or } \sqrt{\hat v} + \epsilon

    ``eps_inside_sqrt=True`` is the Tarasov-Ershov fix: with one scale per chunk, coordinates
    whose variance is tiny get enormous updates from sign noise under ``sqrt(v) + eps``
    (DeepSpeed's form, which VGG/Transformers diverge with right after the switch);
    ``sqrt(v + eps)`` bounds them. ``False`` reproduces the original.

    Differences from DeepSpeed's ``OnebitAdam``, on purpose: the warm-up is AdamW with bias
    correction and decoupled weight decay (DeepSpeed drops bias correction); weight decay
    keeps working after the switch; error state is kept across checkpoints; coordinates
    whose variance is exactly zero at the switch (never saw a gradient, e.g. unused
    embedding rows) are masked automatically, so sign coding cannot make them drift -
    DeepSpeed needs a hand-made ``exp_avg_mask`` for that.

    Memory per parameter: m, v (fp32) + worker error (fp32) + 1/n server error = 12 + 4/n
    bytes of state, plus working buffers: local gradient, payload and (compression phase)
    the frozen denominator, 12 bytes; the synced momentum is written straight into m.

    Args:
        warmup_steps: steps of exact AdamW before compression starts (``None``: only when
            :meth:`start_compression` is called, e.g. by the phase-switching callback).
        block_size: ``None`` = one scale per chunk (DeepSpeed); an int gives one scale per
            block of that many elements.
        bucket_cap_mb, group, simulate_workers: see :class:`CompressedOptimizer`.
    """

    flat_state = ("exp_avg", "exp_avg_sq")
    comm_mode = "error_feedback"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int | None = 1000,
                 eps_inside_sqrt: bool = True, block_size: int | None = None, *,
                 bucket_cap_mb: float = 25.0, group=None, simulate_workers: int | None = None) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be non-negative, got {eps}, {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        eps_inside_sqrt=eps_inside_sqrt)
        self.block_size = block_size
        SignCodec(block_size=block_size)  # validate early
        super().__init__(params, defaults, warmup_steps=warmup_steps, bucket_cap_mb=bucket_cap_mb,
                         group=group, simulate_workers=simulate_workers)
        self._frozen_step = 0

    def _make_codec(self) -> Codec:
        return SignCodec("l2", block_size=self.block_size)

    # -- phases --------------------------------------------------------------------------
    def _on_switch(self) -> None:
        if self._step == 0:
            raise RuntimeError(f"{type(self).__name__} needs at least one warm-up step to estimate the "
                               "variance before compression starts (warmup_steps >= 1)")
        self._frozen_step = self._step

    def _extra_state(self) -> dict:
        return {"frozen_step": self._frozen_step}

    def _load_extra_state(self, extra: dict) -> None:
        self._frozen_step = extra["frozen_step"]

    # -- warm-up: AdamW, op for op as torch.optim.AdamW's single-tensor path --------------
    def _warmup_moments(self, b: _Bucket, grad: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       float, float]:
        """Adam's moment updates of a warm-up step: (m, v, bias corrections 1 and 2)."""
        beta1, beta2 = group["betas"]
        m, v = b.flat["exp_avg"], b.flat["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return m, v, 1 - beta1**self._step, 1 - beta2**self._step

    def _update_warmup(self, b: _Bucket, grad: torch.Tensor, group: dict, has_grad: list[bool]) -> None:
        m, v, bc1, bc2 = self._warmup_moments(b, grad, group)
        denom = (v.sqrt() / bc2**0.5).add_(group["eps"])
        self._apply(b, m, group, has_grad, decoupled_wd=group["weight_decay"],
                    step_size=group["lr"] / bc1, denom=denom)

    # -- compression ---------------------------------------------------------------------
    # v is frozen during compression, so the zero mask and the denominator are computed once
    # per bucket and switch (recomputing them cost ~50 ms per step at 25M parameters).
    def _zero_mask(self, b: _Bucket) -> torch.Tensor | None:
        if b.cache.get("mask_step") != self._frozen_step:
            mask = b.flat["exp_avg_sq"] == 0
            b.cache["mask"] = mask if bool(mask.any()) else None
            b.cache["mask_step"] = self._frozen_step
        return b.cache["mask"]

    def _payload(self, b: _Bucket, grad: torch.Tensor, out: torch.Tensor) -> None:
        beta1 = self.param_groups[b.group_index]["betas"][0]
        torch.lerp(b.flat["exp_avg"], grad, 1 - beta1, out=out)
        mask = self._zero_mask(b)
        if mask is not None:
            out.masked_fill_(mask, 0.0)  # frozen-zero coordinates send nothing

    def _sync_target(self, b: _Bucket) -> torch.Tensor:
        return b.flat["exp_avg"]  # m <- synced momentum, without a copy

    def _absorb(self, b: _Bucket, synced: torch.Tensor) -> None:
        if synced is not b.flat["exp_avg"]:
            b.flat["exp_avg"].copy_(synced)
        mask = self._zero_mask(b)
        if mask is not None:
            b.flat["exp_avg"].masked_fill_(mask, 0.0)

    def _denominator(self, v: torch.Tensor, group: dict, b: _Bucket | None = None) -> torch.Tensor:
        key = (self._frozen_step, group["betas"][1], group["eps"], group["eps_inside_sqrt"])
        if b is not None and b.cache.get("denom_key") == key:
            return b.cache["denom"]
        bc2 = 1 - group["betas"][1] ** self._frozen_step
        vhat = v / bc2
        denom = vhat.add_(group["eps"]).sqrt_() if group["eps_inside_sqrt"] else vhat.sqrt_().add_(group["eps"])
        if b is not None:
            b.cache["denom_key"], b.cache["denom"] = key, denom
        return denom

    def _update_compressed(self, b: _Bucket, group: dict, has_grad: list[bool]) -> None:
        beta1 = group["betas"][0]
        m, v = b.flat["exp_avg"], b.flat["exp_avg_sq"]
        # m is zero where v is (see _absorb), so those coordinates do not move
        self._apply(b, m, group, has_grad, decoupled_wd=group["weight_decay"],
                    step_size=group["lr"] / (1 - beta1**self._step), denom=self._denominator(v, group, b))


class QAdam(OnebitAdam):
    r"""QAdam (Bagua): AdamW warm-up, then frozen variance and 8-bit min-max quantised
    momentum exchanged with the two-stage scheme, without error feedback.

    Same update as :class:`OnebitAdam`, including ``eps_inside_sqrt`` (default ``True``: with
    ``sqrt(v_hat) + eps`` the digits quickstart diverges at lr 3e-3 after the switch, as 1-bit Adam
    does). Unlike Bagua, weight decay keeps working after warm-up and no gradient is dropped at the
    switch. Memory per parameter: m, v (fp32): 8 bytes of state.
    """

    comm_mode = "plain"

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int | None = 1000,
                 block_size: int | None = None, eps_inside_sqrt: bool = True, *, bucket_cap_mb: float = 25.0,
                 group=None, simulate_workers: int | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, warmup_steps, eps_inside_sqrt=eps_inside_sqrt,
                         block_size=None, bucket_cap_mb=bucket_cap_mb, group=group,
                         simulate_workers=simulate_workers)
        self.block_size = block_size
        MinMaxUInt8Codec(block_size=block_size)

    def _make_codec(self) -> Codec:
        return MinMaxUInt8Codec(block_size=self.block_size)

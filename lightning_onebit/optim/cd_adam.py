"""CD-Adam (Wang, Lin, Chen, AISTATS 2022) and the base its baselines (:mod:`.baselines`) share.

All of them synchronise the *gradient* with the two-stage compressed allreduce and run
their update on the result:

==================  ==========================  ===============================
optimizer           compression of gradients    update
==================  ==========================  ===============================
CDAdam              Markov both ways (EF21)     AMSGrad, x -= lr m / sqrt(v_hat + nu)
EF21                Markov both ways            SGD, x -= lr g_tilde
ErrorFeedbackAMSGrad  error feedback both ways  AMSGrad
NaiveCompressedAMSGrad  no feedback             AMSGrad
==================  ==========================  ===============================

The compressor is the scaled sign C(x) = ||x||_1 / d * sign(x) (``SignCodec("l1")``, the
default) or top-k sparsification (``compressor="topk"``, ``topk_ratio``), as in the paper's baselines.
Markov compression: worker i keeps g_hat_i and sends C(g_i - g_hat_i); the server keeps
the running mean g_hat and sends C(g_hat - g_tilde); every worker adds that to g_tilde
(the official code's reading of the paper's Algorithm 1; docs/design/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..comm import Wire
from .base import CompressedOptimizer, check_hyperparameters
from .buckets import Bucket

__all__ = ["AMSGradOnCompressed", "CDAdam", "CompressedGradientOptimizer"]


class CompressedGradientOptimizer(CompressedOptimizer):
    """Base of the optimizers that synchronise the gradient itself, compressed from the first step
    (scaled sign, or top-k with ``compressor="topk"``)."""

    has_warmup = False
    from_adam = {"lr": "lr", "weight_decay": "weight_decay"}

    def __init__(self, params: Iterable, defaults: dict, *, block_size: int | None, compressor: str = "sign",
                 topk_ratio: float = 0.01, **kw) -> None:
        if compressor not in ("sign", "topk"):
            raise ValueError(f"compressor must be 'sign' (scaled sign) or 'topk', got {compressor!r}")
        self.block_size, self.compressor, self.topk_ratio = block_size, compressor, topk_ratio
        # the scaled sign C(x) = ||x||_1 / d * sign(x), or top-k (validated here, before any bucket)
        self.wire = Wire.topk(topk_ratio) if compressor == "topk" else Wire.sign("l1")
        super().__init__(params, dict(defaults, block_size=block_size), warmup_steps=None, **kw)

    def _payload(self, b: Bucket, grad: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(grad)


class AMSGradOnCompressed(CompressedGradientOptimizer):
    r"""AMSGrad on the synchronised gradient :math:`\tilde g_t` (no bias correction, as in the paper):

    .. math::
       m_t = \beta_1 m_{t-1} + (1-\beta_1)\tilde g_t,\quad
       v_t = \beta_2 v_{t-1} + (1-\beta_2)\tilde g_t^2,\quad
       \hat v_t = \max(\hat v_{t-1}, v_t),\quad
       x_{t+1} = x_t (1 - \gamma\lambda) - \gamma\, m_t / \sqrt{\hat v_t + \nu}

    Weight decay is decoupled (AdamW style). Memory per parameter: m, v, v_hat (fp32) plus
    the communication state of the mode (see the subclass).
    """

    flat_state = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    from_adam = {"lr": "lr", "betas": "betas", "eps": "nu", "weight_decay": "weight_decay"}
    #: above this lr (5x the CD-Adam paper's 1e-4) a converted AdamW's lr gets a warning
    converted_lr_limit: float = 5e-4

    @classmethod
    def conversion_advice(cls, opt: torch.optim.Optimizer) -> str | None:
        # No warm-up and no bias correction: every step from the first moves each coordinate by
        # up to ~2x Adam's lr on a sign-compressed gradient. A BatchNorm ResNet did not train at
        # AdamW's 2e-3 (its running variance grew to 68), and trained at 2e-4.
        lr = max(g["lr"] for g in opt.param_groups)
        if lr <= cls.converted_lr_limit:
            return None
        return (f"{cls.__name__} runs AMSGrad on compressed gradients from the first step, without a "
                f"full-precision warm-up or bias correction; at an AdamW learning rate (here {lr:g}) it may not "
                f"train at all (a BatchNorm ResNet did not at 2e-3 and did at 2e-4). The CD-Adam paper uses "
                f"1e-4; return an AdamW (or {cls.__name__}) with lr from 1e-4 to {cls.converted_lr_limit:g} from "
                "configure_optimizers")

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 nu: float = 1e-8, weight_decay: float = 0.0, *, block_size: int | None = None,
                 compressor: str = "sign", topk_ratio: float = 0.01, bucket_cap_mb: float = 25.0, group=None,
                 simulate_workers: int | None = None) -> None:
        check_hyperparameters(lr=lr, betas=betas, nu=nu, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), nu=nu, weight_decay=weight_decay)
        super().__init__(params, defaults, block_size=block_size, compressor=compressor, topk_ratio=topk_ratio,
                         bucket_cap_mb=bucket_cap_mb, group=group, simulate_workers=simulate_workers)

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        beta1, beta2 = group["betas"]
        g = b.synced
        m, v, vmax = b.flat["exp_avg"], b.flat["exp_avg_sq"], b.flat["max_exp_avg_sq"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.maximum(vmax, v, out=vmax)
        self._apply(b, m, group, has_grad, decoupled_wd=group["weight_decay"],
                    denom=(vmax + group["nu"]).sqrt_())


class CDAdam(AMSGradOnCompressed):
    """CD-Adam: Markov-compressed gradients both ways (1-bit scaled sign) + AMSGrad. No warm-up.

    Communication state per parameter: worker estimate g_hat_i and shared estimate g_tilde
    (fp32, 8 bytes) + 1/n server mean: with m, v, v_hat, 20 + 4/n bytes per parameter.
    """

    strategy_name = "cd_adam"
    comm_mode = "markov"

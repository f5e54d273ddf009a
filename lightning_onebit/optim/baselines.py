"""The baselines of the CD-Adam paper: EF21 (SGD on Markov-compressed gradients) and AMSGrad on
error-feedback or plain compressed gradients. They share CD-Adam's machinery (:mod:`.cd_adam`)."""

from __future__ import annotations

from collections.abc import Iterable

from .base import check_hyperparameters
from .buckets import Bucket
from .cd_adam import AMSGradOnCompressed, CompressedGradientOptimizer

__all__ = ["EF21", "ErrorFeedbackAMSGrad", "NaiveCompressedAMSGrad"]


class ErrorFeedbackAMSGrad(AMSGradOnCompressed):
    """Baseline: error-feedback compressed gradients (worker + server error) + AMSGrad."""

    strategy_name = "ef_amsgrad"
    comm_mode = "error_feedback"


class NaiveCompressedAMSGrad(AMSGradOnCompressed):
    """Baseline: compressed gradients without any feedback + AMSGrad (stalls, CD-Adam paper Fig. 2)."""

    strategy_name = "naive_amsgrad"
    comm_mode = "plain"


class EF21(CompressedGradientOptimizer):
    """EF21 (Richtarik et al.): Markov-compressed gradients both ways + plain SGD, x -= lr g_tilde.

    Memory per parameter: g_hat_i and g_tilde (fp32) + 1/n server mean.
    """

    strategy_name = "ef21"
    comm_mode = "markov"

    def __init__(self, params: Iterable, lr: float = 1e-2, weight_decay: float = 0.0, *,
                 block_size: int | None = None, compressor: str = "sign", topk_ratio: float = 0.01,
                 bucket_cap_mb: float = 25.0, group=None, simulate_workers: int | None = None) -> None:
        check_hyperparameters(lr=lr, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), block_size=block_size,
                         compressor=compressor, topk_ratio=topk_ratio, bucket_cap_mb=bucket_cap_mb, group=group,
                         simulate_workers=simulate_workers)

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        self._apply(b, b.synced, group, has_grad, decoupled_wd=group["weight_decay"])

"""0/1 Adam (Lu, Li, Zhang, He 2022): fewer rounds, not only fewer bits."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..comm import Wire, ready_future
from ..compress import flat_buffer
from .base import CompressedOptimizer, check_hyperparameters
from .buckets import Bucket
from .fractions import check_steps, steps_of_run
from .local_gradients import LocalGradients
from .local_steps import LocalSteps
from .onebit_adam import _bias_correction
from .zero_one_schedule import STEP_KINDS, ZeroOneSchedule

if TYPE_CHECKING:
    from torch.distributed import GradBucket

__all__ = ["ZeroOneAdam", "ZeroOneSchedule"]


class ZeroOneAdam(LocalSteps, CompressedOptimizer):
    r"""0/1 Adam: the variance refreshed on a thinning schedule, then frozen, with local steps.

    .. math::
       \textbf{refresh step}\ (t \le T_v,\ t \equiv 0 \bmod \text{var\_interval}):\ & \bar g = \tfrac1n
           \textstyle\sum_i g^{(i)} \text{ (fp32)},\ m \leftarrow \beta_1 m + (1-\beta_1)\bar g,\
           v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2,\ k \leftarrow k + 1 \\
       \textbf{1-bit step}\ (t \le T_v, \text{ otherwise}):\ & \tilde g =
           \mathrm{CompressedAllreduce}_{\text{1-bit, EF}}(g^{(i)}),\
           m \leftarrow \beta_1 m + (1-\beta_1)\tilde g \\
       \textbf{both}:\ & \theta \leftarrow \theta (1-\gamma\lambda) - \frac{\gamma}{1-\beta_1^t}
           \frac{m}{d},\quad d = \sqrt{v/(1-\beta_2^k) + \epsilon}\ (\texttt{eps\_inside\_sqrt})
           \text{ or } \sqrt{v/(1-\beta_2^k)} + \epsilon \\
       \textbf{local step}\ (t > T_v):\ & m^{(i)} \leftarrow \beta_1 m^{(i)} + (1-\beta_1) g^{(i)},\
           s_t = \tfrac{\gamma_t}{1-\beta_1^t},\ \theta^{(i)} \leftarrow \theta^{(i)}(1-\gamma_t\lambda)
           - s_t m^{(i)} / d,\ u^{(i)} \mathrel{+}= s_t m^{(i)} \\
       \textbf{sync}\ (t > T_v,\ t \equiv 0 \bmod H_t):\ & m = \mathrm{CompressedAllreduce}_{\text{1-bit, EF}}
           (u^{(i)} / \textstyle\sum s),\
           \theta = \theta_a \textstyle\prod(1-\gamma\lambda) - (\sum s)\, m / d,\ \theta_a \leftarrow \theta,\
           u \leftarrow 0

    ``T_v`` is ``var_freeze_step``; ``theta_a`` (the anchor) is the model of the last
    synchronisation, the same on every rank. Between synchronisations each rank trains its own
    replica on its own gradients; the synchronisation sends the lr-weighted mean of each rank's
    momenta over the interval (1-bit, error feedback in both stages, as 1-bit Adam's momentum)
    and every rank rebuilds the same model from the anchor. :class:`ZeroOneSchedule` says which
    step is which (DeepSpeed's ``var_freeze_step``, ``var_update_scaler`` = kappa,
    ``local_step_scaler``, ``local_step_clipper`` = H, with their defaults).

    Between synchronisations the ranks' models differ: :meth:`sync_replicas` (collective) makes them
    one before anything is evaluated or saved. The strategies call it before validation, before
    checkpoints and at the end of fit; with plain DDP call it yourself on every rank.

    Rounds and bytes: a refresh step is an fp32 allreduce, a 1-bit step and a synchronisation
    one 1-bit call (~1/32 of it), a local step nothing. With DDP the local steps skip DDP's
    allreduce entirely (the comm hook returns the local gradients, counted in ``local_steps``).
    ``comm_counter.rounds`` counts the steps and synchronisations that sent anything.

    Differences from DeepSpeed's ``ZeroOneAdam``, on purpose: Adam's bias corrections (``t`` for
    m, the number of refreshes ``k`` for v; with the variance refreshed every step and no
    freeze it is exactly AdamW, ``eps_inside_sqrt=False``); decoupled weight decay, applied to the
    anchor as the product of the interval's factors (DeepSpeed folds ``lambda theta`` into the
    synchronised momentum); the synchronised model is rebuilt from the anchor instead of subtracting
    each rank's own update again, so the replicas are bit-identical after every synchronisation;
    ``eps_inside_sqrt=True`` by default (the Tarasov-Ershov fix); no dummy first step; the error state
    survives checkpoints. Fractions of the run are accepted for ``var_freeze_step`` and
    ``local_step_scaler`` (resolved by :meth:`set_total_steps`, which the strategies call).

    Coordinates whose variance is zero (no gradient at any refresh yet: an embedding row of a
    token not seen) are masked as in :class:`OnebitAdam`: they send 0 and keep a zero momentum. In
    phase A the next refresh that sees a gradient for them starts their training; after the freeze
    they stay masked (logged at the freeze), so freeze after every coordinate has had a gradient.

    Non-finite gradients: refresh and 1-bit steps follow ``set_nonfinite_policy`` as every
    optimizer here. A local step has no collective to agree in, so a rank whose gradient holds
    NaN/inf drops it (takes zero for this step), counts it (``dropped_gradients``) and tells the
    others at the next synchronisation (the agreement's flag): with the policy "raise" every rank
    raises there, before the synchronisation changes anything; with "skip" every rank logs it. On a
    GPU (the cuda backend) nothing of a synchronisation is read on its step: its calls are decided on
    the device (their decode into the anchor predicated on every rank's payload being finite), the
    counts and the flags reach the host by copies that do not wait, and the report (or "raise", after
    the synchronisation left the dropped gradients out) comes at the next step; a synchronisation
    whose payload was not finite on some rank leaves every rank at the model of the one before and
    raises then.

    Memory per parameter: m, v (fp32) + worker error + 1/n server error, as 1-bit Adam, and from
    the freeze on the anchor and the accumulated update u (8 bytes more; a simulated cluster keeps
    a replica, a momentum and u per worker).

    Args:
        var_freeze_step: the last step that may refresh the variance (``T_v``); an int, or a float in
            (0, 1), a fraction of the run's steps.
        var_update_scaler: refreshes per variance interval before it doubles (kappa).
        local_step_scaler: phase-B steps per local interval before it doubles (int, or a fraction).
        local_step_clipper: the longest local interval (H).
        eps_inside_sqrt, block_size, bucket_cap_mb, group, simulate_workers: as :class:`OnebitAdam`.
        warmup_comm_dtype: the dtype the refresh steps' mean gradient travels in (see
            :class:`CompressedOptimizer`).
    """

    strategy_name = "zero_one_adam"
    flat_state = ("exp_avg", "exp_avg_sq")
    has_warmup = False
    has_local_steps = True
    payload_shows_nonfinite = False  # the masked coordinates send zeros whatever the gradient holds
    comm_mode = "error_feedback"
    wire = Wire.sign("l2")
    #: flat buffers of the local-step phase (allocated at the freeze)
    local_state = ("anchor", "update_sum")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, var_freeze_step: int | float = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int | float = 32678, local_step_clipper: int = 16,
                 eps_inside_sqrt: bool = True, block_size: int | None = None, bucket_cap_mb: float = 25.0,
                 group=None, simulate_workers: int | None = None,
                 warmup_comm_dtype: torch.dtype | str | None = None) -> None:
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        check_steps("var_freeze_step", var_freeze_step, fraction=True)
        check_steps("var_update_scaler", var_update_scaler, fraction=False)
        check_steps("local_step_scaler", local_step_scaler, fraction=True)
        check_steps("local_step_clipper", local_step_clipper, fraction=False)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        eps_inside_sqrt=eps_inside_sqrt, block_size=block_size)
        self.block_size = block_size
        super().__init__(params, defaults, warmup_steps=None, bucket_cap_mb=bucket_cap_mb, group=group,
                         simulate_workers=simulate_workers, warmup_comm_dtype=warmup_comm_dtype)
        self.schedule_args = {"var_freeze_step": var_freeze_step, "var_update_scaler": var_update_scaler,
                              "local_step_scaler": local_step_scaler, "local_step_clipper": local_step_clipper}
        self._total_steps: int | None = None
        self._sched: ZeroOneSchedule | None = None
        self._kind: str | None = None  # kind of the coming step (see _update_phase)
        self.step_counts = dict.fromkeys(STEP_KINDS, 0)  #: steps taken of each kind
        self.flushes = 0  #: synchronisations outside the schedule (sync_replicas: validation, checkpoints, end)
        self.dropped_gradients = 0  #: local steps in which this rank (or a simulated worker) dropped a NaN/inf gradient
        self._local = False  # phase B has begun (anchor and u exist, the error state was reset)
        self._since_sync = 0  # local steps since the last synchronisation (the same on every rank)
        self._acc: dict[int, list] = {}  # bucket index -> [per-parameter sum of step sizes, weight-decay product]
        self._bad: torch.Tensor | None = None  # per (simulated) worker: gradients dropped since the last sync
        self._count_ring: list[torch.Tensor] | None = None  # pinned buffers the counts reach the host in (a GPU)
        self._local_grads = LocalGradients()  # a GPU's local step: the gradients' buffers and finiteness flags
        self._replicas: list[dict[int, dict[str, torch.Tensor]]] = []  # simulation: workers 1.. (0 is the model)

    @property
    def local_steps(self) -> int:
        """Steps that sent nothing (phase-B steps without a synchronisation)."""
        return self.step_counts["local"]

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_local", False):
            raise RuntimeError("ZeroOneAdam: a param group cannot be added after the variance froze (its variance "
                               "was never estimated)")
        super().add_param_group(param_group)

    # -- schedule ------------------------------------------------------------------------
    def set_total_steps(self, total_steps: int) -> None:
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        self._total_steps = total_steps

    def schedule(self) -> ZeroOneSchedule:
        """The schedule, with fractions of the run resolved (see :meth:`set_total_steps`)."""
        if self._sched is None:
            args = {}
            for k, v in self.schedule_args.items():
                if isinstance(v, float):
                    if self._total_steps is None:
                        raise ValueError(f"ZeroOneAdam: {k}={v} is a fraction of the run; call set_total_steps(n) "
                                         "first (the strategies do) or give a number of steps")
                    v = steps_of_run(k, v, self._total_steps)
                args[k] = v
            self._sched = ZeroOneSchedule(**args)
        return self._sched

    def _update_phase(self) -> None:
        """The kind of the coming step decides the path: refresh steps take the fp32 (warm-up) path
        of the base class, 1-bit steps its compressed path, local steps their own."""
        self._kind = self.schedule().kind(self._step + 1)
        for b in self._buckets:
            b.compressing = self._kind != "refresh"

    def settings(self) -> dict[str, str]:
        out = super().settings()
        out.update({k: repr(v) for k, v in self.schedule_args.items()})
        return out

    # -- phase A: refresh and 1-bit steps -------------------------------------------------
    def _step_sizes(self, b: Bucket, lr: float, beta1: float) -> list[float]:
        return [lr / _bias_correction(beta1, t) for t in self._steps(b)]

    def _mask(self, b: Bucket) -> torch.Tensor | None:
        """The coordinates whose variance is zero (no gradient at any refresh), or None."""
        if "mask" not in b.cache:
            mask = b.flat["exp_avg_sq"] == 0
            b.cache["mask"] = mask if bool(mask.any()) else None
        return b.cache["mask"]

    def _denominator(self, b: Bucket, group: dict, cache: bool = True) -> torch.Tensor:
        """d of every coordinate from v and each parameter's refresh count (changes only at refreshes)."""
        if cache and "denom" in b.cache:
            return b.cache["denom"]
        v, beta2, eps = b.flat["exp_avg_sq"], group["betas"][1], group["eps"]
        counts = self._steps(b, "var_step")
        d = flat_buffer(v.numel(), device=v.device, zero=False)
        runs = [(0, b.numel, counts[0])] if len(set(counts)) == 1 else \
            [(o, n, k) for o, n, k in zip(b.offsets, b.numels, counts, strict=True)]
        for o, n, k in runs:
            bc2 = _bias_correction(beta2, k)
            if group["eps_inside_sqrt"]:
                torch.div(v[o:o + n], bc2, out=d[o:o + n]).add_(eps).sqrt_()
            else:  # op for op as torch.optim.AdamW
                torch.div(v[o:o + n].sqrt(), bc2**0.5, out=d[o:o + n]).add_(eps)
        if cache:
            b.cache["denom"] = d
        return d

    def _update_warmup(self, b: Bucket, grad: torch.Tensor, group: dict, has_grad: list[bool]) -> None:
        """A refresh step: Adam's moments on the fp32 mean gradient, a new denominator."""
        beta1, beta2 = group["betas"]
        m, v = b.flat["exp_avg"], b.flat["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        for p, h in zip(b.params, has_grad, strict=True):
            if h:
                self.state[p]["var_step"] = self.state[p].get("var_step", 0) + 1
        b.cache.clear()  # the mask and d follow v; params without gradient get theirs back after this step
        self._apply(b, m, group, has_grad, decoupled_wd=group["weight_decay"],
                    step_size=self._step_sizes(b, group["lr"], beta1), denom=self._denominator(b, group, cache=False))

    def _payload(self, b: Bucket, grad: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(grad)
        if (mask := self._mask(b)) is not None:
            out.masked_fill_(mask, 0.0)

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        m = b.flat["exp_avg"]
        m.lerp_(synced, 1 - self.param_groups[b.group_index]["betas"][0])
        if (mask := self._mask(b)) is not None:
            m.masked_fill_(mask, 0.0)

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        self._apply(b, b.flat["exp_avg"], group, has_grad, decoupled_wd=group["weight_decay"],
                    step_size=self._step_sizes(b, group["lr"], group["betas"][0]), denom=self._denominator(b, group))

    # -- the step --------------------------------------------------------------------------
    def _run_step(self, worker_grads) -> None:
        self.settle_device_skips(wait=False)  # a synchronisation the device decided, a step ago
        buckets = self._build_buckets()
        self._update_phase()
        t, kind = self._step + 1, self._kind
        if kind in ("refresh", "onebit"):
            super()._run_step(worker_grads)
            if self._step < t:  # skipped for a non-finite gradient: the schedule waits as well
                return
        else:
            self._local_step(buckets, worker_grads)
        self.step_counts[kind] += 1
        self.schedule().advance(t)

    def ddp_bucket_ready(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Refresh steps average in full precision (or ``warmup_comm_dtype``), 1-bit steps synchronise in
        the optimizer's buckets, and phase-B steps send nothing: the future holds the local gradients at once."""
        self._update_phase()
        if self._kind == "refresh":
            return self._warmup_future(bucket)
        if self._kind in ("local", "sync"):
            return ready_future(bucket.buffer())
        return super().ddp_bucket_ready(bucket)

    # -- checkpoints -----------------------------------------------------------------------
    def _extra_state(self) -> dict:
        if self._replicas and self._since_sync:
            raise RuntimeError("ZeroOneAdam (simulated): the workers' local steps since the last round are not in a "
                               "state_dict; call sync_replicas() first")
        return {"schedule": None if self._sched is None else dataclasses.asdict(self._sched),
                "total_steps": self._total_steps, "step_counts": dict(self.step_counts), "flushes": self.flushes,
                "dropped_gradients": self.dropped_gradients, "local": self._local, "since_sync": self._since_sync,
                "acc": {str(k): [list(v[0]), v[1]] for k, v in self._acc.items()},
                "bad": None if self._bad is None else self._bad.tolist()}

    def _load_extra_state(self, extra: dict) -> None:
        self._sched = None if extra["schedule"] is None else ZeroOneSchedule(**extra["schedule"])
        self._total_steps = extra["total_steps"]
        self.step_counts = dict(extra["step_counts"])
        self.flushes, self.dropped_gradients = extra["flushes"], extra["dropped_gradients"]
        self._local, self._since_sync = extra["local"], extra["since_sync"]
        self._acc = {int(k): [list(v[0]), float(v[1])] for k, v in extra["acc"].items()}
        self._bad = None if extra["bad"] is None else torch.tensor(extra["bad"], dtype=torch.int64)
        self._replicas = []

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self._local:  # the anchor and u come back from the per-parameter state
            self._enter_local(self._buckets)
            if self._bad is not None and self._buckets:
                self._bad = self._bad.to(self._buckets[0].device)
        for b in self._buckets:  # another bucket layout (the base class warned): start the sums afresh
            if b.index in self._acc and len(self._acc[b.index][0]) != len(b.params):
                self._acc[b.index] = [[0.0] * len(b.params), 1.0]

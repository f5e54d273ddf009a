"""1-bit Adam (Tang et al. 2021) with the Tarasov-Ershov epsilon fix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..comm import Wire, simulated_mean, sparse_mean, sparse_mean_bytes, sparse_row
from ..compress import flat_buffer
from ..compress.source import Sink, Source
from .base import CompressedOptimizer, check_hyperparameters
from .buckets import Bucket, drop_positions, max_dropped_runs

__all__ = ["OnebitAdam"]


def _bias_correction(beta: float, step: int) -> float:
    """1 - beta^step; 1 for a parameter that never stepped (its moments are zero anyway)."""
    return 1 - beta**step if step else 1.0


def _frozen_denominator(vhat: torch.Tensor, group: dict) -> torch.Tensor:
    """d from the bias-corrected frozen variance, in place."""
    return vhat.add_(group["eps"]).sqrt_() if group["eps_inside_sqrt"] else vhat.sqrt_().add_(group["eps"])


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

    ``t`` and ``T_w`` are each parameter's own step counts, as ``torch.optim.AdamW`` keeps them
    (a parameter without gradient in some step does not count it). The compressed allreduce
    gives every parameter tensor its own scales (one per piece of the tensor in a rank's
    chunk, both stages), as DeepSpeed's per-tensor compression does.

    ``eps_inside_sqrt=True`` is the Tarasov-Ershov fix: coordinates whose variance is tiny get
    enormous updates from sign noise under ``sqrt(v) + eps`` (DeepSpeed's form, which
    VGG/Transformers diverge with right after the switch); ``sqrt(v + eps)`` bounds them.
    ``False`` reproduces the original.

    Coordinates whose variance is exactly zero at the switch (no gradient during warm-up: an
    embedding row of a token not seen yet) are masked: sign coding cannot make them drift
    (DeepSpeed needs a hand-made ``exp_avg_mask``). When a gradient reaches one of them later
    on any rank (the collective's agreement round tells every rank, at no cost, how many bytes each
    has about them), each rank sends its reached coordinates as runs of positions with their
    gradients in one gather, and every rank averages them in fp32 in rank order; these coordinates
    start to train: their frozen variance
    becomes the gradient squared and their momentum (1 - beta1) times it. (Adam's own estimate
    after one gradient at step t, (1 - beta2) / (1 - beta2^t) g^2, frozen for the rest of the
    run, would give steps about 1 / sqrt(1 - beta2) ~ 30x larger for as long as compression
    lasts.) Steps where no masked coordinate gets a gradient cost nothing extra.

    Differences from DeepSpeed's ``OnebitAdam``, on purpose: the warm-up is AdamW with bias
    correction and decoupled weight decay (DeepSpeed drops bias correction); weight decay
    keeps working after the switch; error state is kept across checkpoints.

    Memory per parameter: m, v (fp32) + worker error (fp32) + 1/n server error = 12 + 4/n
    bytes of state, plus working buffers: local gradient, payload and (compression phase)
    the frozen denominator, 12 bytes; the synced momentum is written straight into m.

    Args:
        warmup_steps: steps of exact AdamW before compression starts (``None``: only when
            :meth:`start_compression` is called, e.g. by the phase-switching callback).
        block_size: ``None`` = one scale per piece of a tensor in a rank's chunk; an int cuts
            each tensor further into blocks of that many elements from its first element (a
            param group may set its own ``block_size``, e.g. an embedding's row width).
        fused: warm-up steps run torch's fused AdamW kernel on the buckets (``torch._fused_adamw_``,
            what ``AdamW(fused=True)`` runs; one pass instead of AdamW's several, and the bits of
            ``AdamW(fused=True)`` rather than of the default AdamW). ``None`` (default) or
            ``False``: the warm-up is torch's default AdamW, op for op. A converted
            ``AdamW(fused=True)`` carries it over. Parameters that are not fp32 take the default path.
        bucket_cap_mb, group, simulate_workers, warmup_comm_dtype: see :class:`CompressedOptimizer`
            (``warmup_comm_dtype="bf16"`` halves the warm-up's bytes, ``"uint8"`` sends about a quarter).
    """

    strategy_name = "onebit_adam"
    flat_state = ("exp_avg", "exp_avg_sq")
    comm_mode = "error_feedback"
    wire = Wire.sign("l2")
    from_adam = {**CompressedOptimizer.from_adam, "fused": "fused"}

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int | None = 1000, *,
                 eps_inside_sqrt: bool = True, block_size: int | None = None,
                 bucket_cap_mb: float = 25.0, group=None, simulate_workers: int | None = None,
                 fused: bool | None = None, warmup_comm_dtype: torch.dtype | str | None = None,
                 _defaults: dict | None = None) -> None:
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        eps_inside_sqrt=eps_inside_sqrt, block_size=block_size, fused=fused, **(_defaults or {}))
        self.block_size = block_size
        super().__init__(params, defaults, warmup_steps=warmup_steps, bucket_cap_mb=bucket_cap_mb,
                         group=group, simulate_workers=simulate_workers, warmup_comm_dtype=warmup_comm_dtype)
        self.activated = 0  # masked coordinates that have started to train (see the class docstring)

    def _extra_state(self) -> dict:
        return {"activated": self.activated}

    def _load_extra_state(self, extra: dict) -> None:
        self.activated = extra.get("activated", 0)

    # -- warm-up: AdamW, op for op as torch.optim.AdamW (or its fused kernel, fused=True) ---
    def _step_sizes(self, b: Bucket, lr: float, beta1: float) -> list[float]:
        return [lr / _bias_correction(beta1, t) for t in self._steps(b)]

    def _warmup_moments(self, b: Bucket, grad: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's moment updates of a warm-up step (over the whole bucket; the state of parameters
        without gradient is put back afterwards)."""
        beta1, beta2 = group["betas"]
        m, v = b.flat["exp_avg"], b.flat["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return m, v

    def _warmup_on_own_grads(self, b: Bucket, has_grad: list[bool]) -> list[torch.Tensor] | None:
        # torch's fused kernel takes the tensors where they are: the copy into the bucket would
        # cost two passes over the gradient of a step that is otherwise one
        if not self.param_groups[b.group_index].get("fused"):
            return None
        params = [p for p, h in zip(b.params, has_grad, strict=True) if h]
        grads = [p.grad for p in params]
        if any(g is None or g.is_sparse or g.dtype != torch.float32 or g.device != p.device or p.dtype != torch.float32
               for p, g in zip(params, grads, strict=True)):
            return None
        return grads

    def _update_warmup(self, b: Bucket, grad: torch.Tensor | list[torch.Tensor], group: dict,
                       has_grad: list[bool]) -> None:
        if isinstance(grad, list):
            grads = grad
        elif group.get("fused") and all(p.dtype == torch.float32 for p in b.params):
            grads = [g for g, h in zip(b.views(grad), has_grad, strict=True) if h]
        else:
            grads = None
        if grads is not None:
            self._fused_warmup(b, grads, group, has_grad)
            return
        m, v = self._warmup_moments(b, grad, group)
        beta1, beta2 = group["betas"]
        steps = self._steps(b)
        live = {t for t, h in zip(steps, has_grad, strict=True) if h}
        if len(live) == 1:  # one step count: flat ops over the bucket
            denom = (v.sqrt() / _bias_correction(beta2, live.pop()) ** 0.5).add_(group["eps"])
        else:
            denom = torch.empty_like(v)
            for d, vv, t in zip(b.views(denom), b.views(v), steps, strict=True):
                torch.div(vv.sqrt(), _bias_correction(beta2, t) ** 0.5, out=d).add_(group["eps"])
        self._apply(b, m, group, has_grad, decoupled_wd=group["weight_decay"],
                    step_size=self._step_sizes(b, group["lr"], beta1), denom=denom)

    def _fused_warmup(self, b: Bucket, grads: list[torch.Tensor], group: dict, has_grad: list[bool]) -> None:
        """The warm-up step by torch's fused AdamW kernel on the parameters with a gradient (``grads``,
        theirs), with their own step counts."""
        keep = [i for i, h in enumerate(has_grad) if h]
        params = [b.params[i] for i in keep]
        moments = [[vs[i] for i in keep] for vs in (b.views(b.flat["exp_avg"]), b.views(b.flat["exp_avg_sq"]))]
        steps = [torch.tensor(float(self.state[p]["step"]), device=p.device) for p in params]
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            torch._fused_adamw_(params, grads, *moments, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                                grad_scale=None, found_inf=None)

    # -- compression ---------------------------------------------------------------------
    # v is frozen during compression, so the zero mask and the denominator are computed once
    # per bucket and switch (recomputing them cost a pass over the bucket per step).
    def _mask(self, b: Bucket) -> torch.Tensor | None:
        """The positions (int64) of the coordinates whose frozen variance is zero, or None."""
        if "mask" not in b.cache:
            idx = (b.flat["exp_avg_sq"] == 0).nonzero().view(-1)
            b.cache["mask"] = idx if idx.numel() else None
        return b.cache["mask"]

    payload_reads_grads = True
    skips_on_device = True  # a compressed update is decode_pending's sink alone (_update_compressed)

    def _payload(self, b: Bucket, grad, out: torch.Tensor) -> Source:
        # the momentum this gradient gives, evaluated by the codec where it reads it; frozen-zero
        # coordinates send nothing: 0, or NaN where the gradient is not finite, so the collective's
        # check still sees it
        beta1 = self.param_groups[b.group_index]["betas"][0]
        return Source.lerp(b.flat["exp_avg"], grad, 1 - beta1, groups=b.offsets, mask=self._mask(b), out=out,
                           cache=b.cache)

    def _sync_target(self, b: Bucket) -> torch.Tensor:
        return b.flat["exp_avg"]  # m <- synced momentum, without a copy

    def _absorb(self, b: Bucket, synced: torch.Tensor) -> None:
        if synced is not b.flat["exp_avg"]:
            b.flat["exp_avg"].copy_(synced)
        idx = self._mask(b)
        if idx is not None:
            b.flat["exp_avg"].index_fill_(0, idx, 0.0)

    def _flag(self, b: Bucket, grad) -> int | None:
        idx = self._mask(b)
        if idx is None:
            return None
        # the masked coordinates this rank's gradient reached, ready to send; the agreement carries its length
        row = self._touched_row(b, grad, idx)
        b.cache["flag_row"] = row  # _on_flag sends it: not searched twice
        return row.numel()

    @staticmethod
    def _touched_row(b: Bucket, grad, idx: torch.Tensor) -> torch.Tensor:
        hits = b.nonzero_at(grad, idx, b.flat["exp_avg_sq"])  # the mask is where it is zero
        return sparse_row(hits, b.values_at(grad, idx[hits]), idx.numel())

    def _on_flag(self, b: Bucket, grads: Sequence, simulated: bool) -> None:
        """Masked coordinates that a gradient reached start to train (see the class docstring)."""
        idx = self._mask(b)
        # the coordinates some rank's gradient reached and the mean gradient there: each rank sends its
        # own (as runs of the mask's indices, or a bit each where that is less) and values, in one gather
        row = b.cache.pop("flag_row", None)
        if not simulated:
            row = self._touched_row(b, grads, idx) if row is None else row
            hits, g = sparse_mean(row, b.sync.collective().flag_values, idx.numel(), self.process_group,
                                  self.comm_counter)
            pos = idx[hits]
        else:
            at = [b.values_at(w, idx) for w in grads]
            touched = torch.stack([a != 0 for a in at]).any(0)
            pos = idx[touched]
            g = simulated_mean([a[touched] for a in at])
            n = len(grads)  # what the gather of the rows each worker announced (its _flag) would send
            self.comm_counter.add(sparse_mean_bytes(b.sync.collective().flag_values, n), pos.numel(), n)
        got = g != 0
        if not bool(got.any()):  # the workers' gradients cancelled exactly
            return
        pos, g = pos[got], g[got]
        beta1, beta2 = self.param_groups[b.group_index]["betas"]
        frozen, bc2 = self._steps(b, "frozen_step"), torch.empty_like(g)
        for k, lo, hi in b.runs(pos):
            bc2[lo:hi] = _bias_correction(beta2, frozen[k])
        self._activate(b, pos, g, g * g * bc2, beta1)  # v_hat = g^2 after the frozen bias correction
        b.sync.collective().zero_state_at(pos)  # the masked coordinates' error feedback was noise
        self._unmask(b, pos)
        self.activated += pos.numel()

    def _unmask(self, b: Bucket, pos: torch.Tensor) -> None:
        """The cache after the coordinates ``pos`` started to train: ``pos`` leave the mask (slices of
        it between their runs; a search over the bucket when they fall apart into more runs than that
        costs: :func:`max_dropped_runs`), the
        denominator is updated only at ``pos``, with the ops of :meth:`_denominator`, so to the bit
        what a rebuild would give."""
        mask = b.cache.get("mask")
        # a gradient so small that its square is 0 leaves the variance at 0: such a coordinate stays masked
        gone = pos[b.flat["exp_avg_sq"][pos] != 0]
        # the positions go back and forth between two buffers (8 B per masked coordinate more)
        left = (drop_positions(mask, gone, out=b.cache.get("mask_spare"), max_runs=max_dropped_runs(b.numel))
                if mask is not None else None)
        if left is None:
            b.cache.pop("mask", None)
        elif left is not mask:
            b.cache["mask"], b.cache["mask_spare"] = (left if left.numel() else None), mask
        denom = b.cache.get("denom")
        if denom is not None:
            group = self.param_groups[b.group_index]
            frozen = self._steps(b, "frozen_step")
            for k, lo, hi in b.runs(pos):
                at = pos[lo:hi]
                vhat = torch.div(b.flat["exp_avg_sq"][at], _bias_correction(group["betas"][1], frozen[k]))
                denom[at] = _frozen_denominator(vhat, group)

    def _activate(self, b: Bucket, pos: torch.Tensor, g: torch.Tensor, v: torch.Tensor, beta1: float) -> None:
        b.flat["exp_avg_sq"][pos] = v
        b.flat["exp_avg"][pos] = (1 - beta1) * g

    def _denominator(self, b: Bucket, group: dict) -> torch.Tensor:
        """The frozen d of every coordinate, with each parameter's bias correction at its switch."""
        frozen = self._steps(b, "frozen_step")
        key = (tuple(frozen), group["betas"][1], group["eps"], group["eps_inside_sqrt"])
        if b.cache.get("denom_key") == key:
            return b.cache["denom"]
        v, beta2 = b.flat["exp_avg_sq"], group["betas"][1]
        vhat = flat_buffer(v.numel(), device=v.device, zero=False)  # streamed every step: huge pages
        if len(set(frozen)) == 1:
            torch.div(v, _bias_correction(beta2, frozen[0]), out=vhat)
        else:
            for out, vv, t in zip(b.views(vhat), b.views(v), frozen, strict=True):
                torch.div(vv, _bias_correction(beta2, t), out=out)
        denom = _frozen_denominator(vhat, group)
        b.cache["denom_key"], b.cache["denom"] = key, denom
        return denom

    decodes_in_update = True

    def _update_compressed(self, b: Bucket, group: dict, has_grad: list[bool]) -> None:
        # m is zero where v is (see _absorb), so those coordinates do not move
        sizes = self._step_sizes(b, group["lr"], group["betas"][0])
        if b.sync.deferred:
            # m <- the synced momentum and the parameter update in one pass over the bucket
            targets = self._sink_targets(b)
            b.sync.comm.decode_pending(Sink(
                numel=b.numel, groups=b.offsets, targets=[t if h else None for t, h in zip(targets, has_grad,
                                                                                          strict=True)],
                denom=self._denominator(b, group), values=[-s for s in sizes],
                decay=1 - group["lr"] * group["weight_decay"], mask=self._mask(b), cache=b.cache))
            return
        self._apply(b, b.flat["exp_avg"], group, has_grad, decoupled_wd=group["weight_decay"], step_size=sizes,
                    denom=self._denominator(b, group))

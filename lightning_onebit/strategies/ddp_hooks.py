"""PyTorch's DDP communication hooks as Lightning strategies: the baselines compression must beat.

``DDP + fp16/bf16 compress hook`` and ``DDP + PowerSGD`` (``torch.distributed.algorithms.ddp_comm_hooks``)
are what 1-bit Adam has to beat. :func:`hook_strategy` builds them; the recipes (``conf/algorithm/ddp_fp16.yaml``
etc.) and ``benchmarks/e2e.py`` both use it. Two workarounds make them run on CPU over gloo:

* Lightning registers a ``ddp_comm_hook`` only on CUDA; :class:`HookDDPStrategy` registers it on any device.
* DDP refuses a hook *named* ``bf16_compress_hook`` without CUDA + NCCL >= 2.10, although gloo reduces
  bfloat16 on CPU fine: :func:`bf16_hook_cpu` is the same hook under another name.

PowerSGD also needs :func:`serialized` on gloo (one bucket in flight at a time; see there).

:func:`hook_step_bytes` says what a hook sends per rank per step, as ring-allreduce bytes, so the recipes'
byte accounting (``DDPCommCounter``) charges each baseline what it actually sends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..callbacks.phase import resolve_warmup
from ..comm import ring_allreduce_bytes
from .launch import BaseDDPStrategy
from .options import check_int, check_real

__all__ = ["HOOK_KINDS", "HookDDPStrategy", "bf16_hook_cpu", "hook_step_bytes", "hook_strategy", "make_comm_hook",
           "serialized"]

#: the hooks :func:`hook_strategy` builds (the ``comm_hook`` of an algorithm entry)
HOOK_KINDS = ("fp16", "bf16", "powersgd")

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def bf16_hook_cpu() -> Hook:
    """``default_hooks.bf16_compress_hook`` under another name.

    ``DistributedDataParallel._check_comm_hook`` rejects a hook *named* ``bf16_compress_hook`` unless CUDA with
    NCCL >= 2.10 (or XPU) is present; gloo reduces bfloat16 on CPU fine, so the wrapper only renames it.
    """

    def bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.bf16_compress_hook(state, bucket)

    # DDP's check compares the annotations with the classes; under `from __future__ import annotations`
    # they are strings and would fail it
    bf16_hook.__annotations__ = {}
    return bf16_hook


def serialized(hook: Hook) -> Hook:
    """``hook`` with at most one bucket in flight: each call first waits for the previous bucket's future.

    Needed for PowerSGD on gloo: its future callbacks run on gloo's worker threads (2 per process group) and
    block there in ``all_reduce(...).wait()``; with two buckets in flight both threads block and the
    all_reduces they wait for never run (a deadlock, seen with the MLP at 1 Gbit/s). Waiting for the previous
    bucket keeps the overlap of a bucket's communication with the backward of the layers before it, and also
    keeps the order of collectives the same on every rank.
    """
    prev: dict[str, Any] = {}

    def serialized_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = prev.pop("fut", None)
        if fut is not None:
            fut.wait()
        fut = hook(state, bucket)
        prev["fut"] = fut
        return fut

    serialized_hook.__annotations__ = {}  # as in bf16_hook_cpu
    return serialized_hook


def make_comm_hook(kind: str, *, rank: int = 1, start_iter: int = 1000,
                   min_compression_rate: float = 2) -> tuple[Any, Hook]:
    """``(ddp_comm_state, ddp_comm_hook)`` for ``kind``; ``rank``, ``start_iter`` (steps of vanilla fp32
    allreduce before compressing) and ``min_compression_rate`` are PowerSGD's and ignored otherwise.
    Call it in the rank: the PowerSGD state cannot be unpickled before the process group exists."""
    if kind == "fp16":
        return None, default_hooks.fp16_compress_hook
    if kind == "bf16":
        return None, bf16_hook_cpu()
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start_iter, min_compression_rate=min_compression_rate)
        return state, serialized(powerSGD_hook.powerSGD_hook)
    raise ValueError(f"unknown comm hook {kind!r}; choose one of {HOOK_KINDS}")


def _powersgd_split(shape: Sequence[int], rank: int, min_compression_rate: float) -> tuple[int, int, int]:
    """``(uncompressed, P, Q)`` elements that ``powerSGD_hook`` allreduces for one gradient of ``shape``:
    it views the gradient as ``shape[0] x rest`` and compresses it to rank ``min(n, m, rank)`` only when
    ``(n + m) * r * min_compression_rate < n * m`` (so 1-D tensors, n x 1, never are)."""
    numel = math.prod(shape)
    if len(shape) == 0 or numel == 0:
        return numel, 0, 0
    n, m = shape[0], numel // shape[0]
    r = min(n, m, rank)
    if (n + m) * r * min_compression_rate < n * m:
        return 0, n * r, m * r
    return numel, 0, 0


def hook_step_bytes(kind: str, shapes: Sequence[Sequence[int]], world_size: int, *, compressing: bool = True,
                    rank: int = 1, min_compression_rate: float = 2) -> int:
    """Bytes one rank sends in one step of DDP with the ``kind`` hook, as ring allreduces
    (:func:`ring_allreduce_bytes`) of the gradients of ``shapes``.

    fp16 / bf16: the gradients in 2 bytes each. PowerSGD (``torch``'s ``powerSGD_hook``): before
    ``start_powerSGD_iter`` (``compressing=False``) a vanilla fp32 allreduce; after it, per bucket, one fp32
    allreduce of the tensors it leaves uncompressed, one of all P (n x r) and one of all Q (m x r) factors.
    Counted as if all gradients were in one bucket: ``ring_allreduce_bytes`` rounds each allreduce down to a
    byte, so with several buckets the hook's sum can be a few bytes less (exact for 2 ranks).
    """
    numel = sum(math.prod(s) for s in shapes)
    if kind in ("fp16", "bf16"):
        return ring_allreduce_bytes(numel, world_size, element_size=2)
    if kind != "powersgd":
        raise ValueError(f"unknown comm hook {kind!r}; choose one of {HOOK_KINDS}")
    if not compressing:
        return ring_allreduce_bytes(numel, world_size)
    parts = [_powersgd_split(s, rank, min_compression_rate) for s in shapes]
    return sum(ring_allreduce_bytes(sum(p[i] for p in parts), world_size) for i in range(3))


def _check_start_iter(start_iter: Any) -> None:
    if isinstance(start_iter, bool) or not ((isinstance(start_iter, int) and start_iter >= 2)
                                            or (isinstance(start_iter, float) and 0 < start_iter < 1)):
        raise ValueError("PowerSGD's start_iter (steps of vanilla allreduce first) must be an int >= 2 (the hook's "
                         f"error feedback needs 2) or a fraction of all steps in (0, 1), got {start_iter!r}")


class HookDDPStrategy(BaseDDPStrategy):
    """DDPStrategy that registers its comm hook on CPU as well (Lightning only does on CUDA).

    The hook is either given as Lightning takes it (``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``)
    or named by ``kind`` (:data:`HOOK_KINDS`, with PowerSGD's ``rank``, ``start_iter`` and
    ``min_compression_rate``). A named hook is built in each rank when DDP is set up, afresh for every fit:
    spawned ranks receive the strategy pickled, and neither a ``PowerSGDState`` (its ``__setstate__`` needs the
    process group) nor the wrappers' closures survive that. ``start_iter`` may be a fraction of
    ``trainer.estimated_stepping_batches``, as the warm-up of the compressed strategies may.
    """

    def __init__(self, kind: str | None = None, *, rank: int = 1, start_iter: int | float = 1000,
                 min_compression_rate: float = 2, **kwargs: Any) -> None:
        owner = type(self).__name__
        if kind is not None and kind not in HOOK_KINDS:
            raise ValueError(f"unknown comm hook {kind!r}; choose one of {HOOK_KINDS}")
        # PowerSGD's options are checked whatever the kind: before any rank starts
        check_int(owner, "rank (PowerSGD's matrix approximation rank)", rank, minimum=1)
        _check_start_iter(start_iter)
        check_real(owner, "min_compression_rate", min_compression_rate)
        if not min_compression_rate > 0:
            raise ValueError(f"{owner}: min_compression_rate must be > 0, got {min_compression_rate!r}")
        super().__init__(**kwargs)
        if kind is not None and self._ddp_comm_hook is not None:
            raise ValueError("give either a hook kind or ddp_comm_hook, not both")
        self.kind = kind
        self.matrix_rank = rank  # PowerSGD's matrix approximation rank (not a process rank)
        self.start_iter, self.min_compression_rate = start_iter, min_compression_rate
        self.start_step: int | None = None  # start_iter resolved to steps when the hook is registered

    def _resolve_start_iter(self) -> int:
        if isinstance(self.start_iter, float):  # a fraction rounded as the compressed strategies' warm-up
            total = self.lightning_module.trainer.estimated_stepping_batches
            return max(2, resolve_warmup(self.start_iter, total, name="PowerSGD start_iter"))
        return self.start_iter

    def _register_ddp_hooks(self) -> None:
        state, hook = self._ddp_comm_state, self._ddp_comm_hook
        if self.kind == "powersgd":
            self.start_step = self._resolve_start_iter()
            state, hook = make_comm_hook(self.kind, rank=self.matrix_rank, start_iter=self.start_step,
                                         min_compression_rate=self.min_compression_rate)
            rank_zero_info(f"DDP comm hook: PowerSGD rank {self.matrix_rank} after {self.start_step} steps of "
                           "fp32 allreduce")
        elif self.kind is not None:
            state, hook = make_comm_hook(self.kind)
            rank_zero_info(f"DDP comm hook: {self.kind} compression")
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state, hook)

    def step_bytes(self, shapes: Sequence[Sequence[int]], world_size: int, step: int) -> int | None:
        """Bytes a rank sends in optimizer step ``step`` (0-based) with the named hook, or None when the hook
        is not one of :data:`HOOK_KINDS` (the caller cannot know what it sends)."""
        if self.kind is None:
            return None
        if self.kind == "powersgd" and self.start_step is None:
            self.start_step = self._resolve_start_iter()
        compressing = self.kind != "powersgd" or step >= self.start_step
        return hook_step_bytes(self.kind, shapes, world_size, compressing=compressing, rank=self.matrix_rank,
                               min_compression_rate=self.min_compression_rate)


def hook_strategy(kind: str, *, rank: int = 1, start_iter: int | float = 1000, min_compression_rate: float = 2,
                  **ddp_kwargs: Any) -> HookDDPStrategy:
    """DDP + the ``kind`` hook ("fp16" | "bf16" | "powersgd") as a Lightning strategy.

    PowerSGD: ``rank`` is the matrix approximation rank and ``start_iter`` the optimizer steps of vanilla fp32
    allreduce before compressing (an int >= 2, or a fraction of all steps); the defaults are
    ``PowerSGDState``'s. ``ddp_kwargs`` go to ``DDPStrategy``.
    """
    return HookDDPStrategy(kind, rank=rank, start_iter=start_iter, min_compression_rate=min_compression_rate,
                           **ddp_kwargs)

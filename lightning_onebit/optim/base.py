"""Machinery shared by the compressed optimizers: fixed buckets, flat state, phases.

Every compressed optimizer here works the same way (DESIGN.md section 3):

* Parameters are grouped into **buckets** of fixed composition (reverse parameter order,
  the order backward produces gradients, capped at ``bucket_cap_mb``, never spanning two
  param groups). A bucket's optimizer state lives in flat fp32 buffers and
  ``self.state[p]`` holds views into them, so state is keyed per parameter (it survives
  DDP's own bucket rebuilds and reloads) while each bucket is communicated with one pair
  of collectives and updated with a few flat ops.
* **Warm-up** (``step <= warmup_steps`` and no external switch): the gradient is averaged
  in full precision (by DDP's allreduce when a DDP model is attached, else by ``step()``
  itself) and the warm-up rule (AdamW, LAMB) runs.
* **Compression**: per bucket, the subclass forms the local payload (momentum or gradient),
  a :class:`~lightning_onebit.comm.CompressedAllreduce` synchronises it and the subclass
  absorbs the result into its state. With DDP this happens in the communication hook
  during backward (see :mod:`lightning_onebit.optim.ddp`); otherwise in ``step()``, so the
  algorithm, compression error included, is the same in one process as in many.
* ``simulate_workers=n`` runs n workers in one process (``step_workers``): the same
  buckets and kernels through :class:`~lightning_onebit.comm.SimulatedCluster`.

The optimizer never calls torch.distributed directly except through the comm layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..comm import ByteCounter, CompressedAllreduce, SimulatedCluster, ring_allreduce_bytes
from ..compress import Codec

__all__ = ["CompressedOptimizer", "NonFiniteGradientError"]


class NonFiniteGradientError(ValueError):
    """A gradient contained NaN/inf; every rank skipped the step and no state changed."""


class _Bucket:
    """A fixed group of parameters that is synchronised and updated as one flat vector."""

    def __init__(self, index: int, group_index: int, params: list[torch.Tensor], ids: list[int]) -> None:
        self.index = index
        self.group_index = group_index
        self.params = params
        self.ids = ids  # positions in the optimizer's flattened parameter list
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        dev = params[0].device
        self.device = dev
        self.flat: dict[str, torch.Tensor] = {}
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=dev)  # local gradient
        self._synced: torch.Tensor | None = None
        self.comm: CompressedAllreduce | SimulatedCluster | None = None
        self.payload: torch.Tensor | None = None  # reused every step: fresh buffers cost page faults
        self.cache: dict = {}  # per-bucket values that only change at the switch (see subclasses)
        self.ready = 0  # params whose local gradient is in self.grad (hook path)
        self.done = False  # compressed sync of this step finished

    @property
    def synced(self) -> torch.Tensor:
        """Result buffer of the collective, allocated on first use (optimizers that receive the
        result straight into their state never pay its memory)."""
        if self._synced is None:
            self._synced = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return self._synced

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, self.params, strict=True)]


class CompressedOptimizer(Optimizer):
    """Base class. Subclasses define the flat state, the payload, and the update rules."""

    #: names of per-parameter fp32 state kept in flat bucket buffers
    flat_state: tuple[str, ...] = ()
    #: what the compression phase synchronises: "momentum" or "gradient"
    syncs: str = "momentum"

    def __init__(self, params: Iterable, defaults: dict, *, warmup_steps: int | None,
                 bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None,
                 simulate_workers: int | None = None) -> None:
        super().__init__(params, defaults)
        if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
            raise ValueError(f"warmup_steps must be a non-negative int or None, got {warmup_steps!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if simulate_workers is not None and simulate_workers < 1:
            raise ValueError(f"simulate_workers must be >= 1, got {simulate_workers}")
        for g in self.param_groups:
            for p in g["params"]:
                if p.is_sparse or p.is_complex():
                    raise ValueError(f"{type(self).__name__} supports dense real parameters only")
        self.warmup_steps = warmup_steps
        self.bucket_cap_mb = bucket_cap_mb
        self.process_group = group
        self.simulate_workers = simulate_workers
        self.comm_counter = ByteCounter()
        self._step = 0
        self._compressing = False
        self._buckets: list[_Bucket] | None = None
        self._param_bucket: dict[int, tuple[_Bucket, int]] = {}
        self._ddp_attached = False
        #: with DDP, synchronise in step() instead of the backward hook (fp16 + GradScaler:
        #: the hook would see scaled gradients; also lets clipping act before compression)
        self.defer_sync_to_step = False

    # -- phases --------------------------------------------------------------------------
    @property
    def compressing(self) -> bool:
        """True once the compression phase has started (it never goes back)."""
        return self._compressing

    def start_compression(self) -> None:
        """Compress from the next synchronisation on (the public switch callbacks use)."""
        if not self._compressing:
            self._compressing = True
            self._on_switch()

    def _next_step_compresses(self) -> bool:
        if not self._compressing and self.warmup_steps is not None and self._step + 1 > self.warmup_steps:
            self.start_compression()
        return self._compressing

    def _on_switch(self) -> None:
        """Hook for subclasses: freeze the variance etc. Called once, before the first compressed sync."""

    # -- layout --------------------------------------------------------------------------
    def params_in_order(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def world_size(self) -> int:
        if self.simulate_workers is not None:
            return self.simulate_workers
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def _build_buckets(self) -> list[_Bucket]:
        if self._buckets is not None:
            return self._buckets
        cap = int(self.bucket_cap_mb * 2**20) // 4
        flat_params = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                flat_params.append((gi, p))
        ids = {id(p): i for i, (_, p) in enumerate(flat_params)}
        buckets: list[_Bucket] = []
        cur: list[torch.Tensor] = []
        cur_g, size = None, 0
        for gi, p in reversed(flat_params):  # backward order: last layers' gradients come first
            if not p.requires_grad:
                continue
            if cur and (gi != cur_g or size + p.numel() > cap or p.device != cur[0].device):
                buckets.append(_Bucket(len(buckets), cur_g, cur, [ids[id(q)] for q in cur]))
                cur, size = [], 0
            cur.append(p)
            cur_g = gi
            size += p.numel()
        if cur:
            buckets.append(_Bucket(len(buckets), cur_g, cur, [ids[id(q)] for q in cur]))
        for b in buckets:
            for name in self.flat_state:
                b.flat[name] = torch.zeros(b.numel, dtype=torch.float32, device=b.device)
            for i, p in enumerate(b.params):
                self._param_bucket[id(p)] = (b, i)
            self._adopt_state(b)
        self._buckets = buckets
        return buckets

    def _adopt_state(self, b: _Bucket) -> None:
        """Point self.state[p][name] at views of the bucket's flat buffers (copying loaded values)."""
        for name, flat in b.flat.items():
            for p, view in zip(b.params, b.views(flat), strict=True):
                st = self.state[p]
                old = st.get(name)
                if old is not None and old.data_ptr() != view.data_ptr():
                    view.copy_(old.reshape(view.shape))
                st[name] = view

    # -- gradients -----------------------------------------------------------------------
    def _gather_grads(self, b: _Bucket) -> list[bool]:
        """Copy local gradients into ``b.grad``; returns which params had a gradient."""
        has = []
        for p, view in zip(b.params, b.views(b.grad), strict=True):
            if p.grad is None:
                view.zero_()
                has.append(False)
            else:
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                view.copy_(p.grad)
                has.append(True)
        return has

    def _check_finite(self, t: torch.Tensor, what: str) -> None:
        # a sum is one cheap reduction and is non-finite whenever an element is (or it overflows:
        # then the element-wise check decides); isfinite(t).all() writes a bool per element
        if t.numel() == 0 or bool(torch.isfinite(t.sum())):
            return
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteGradientError(
                f"{type(self).__name__}: the {what} contains NaN or inf; the step was skipped on every "
                "rank and no optimizer state was changed (lower the learning rate, use gradient "
                "clipping, or a GradScaler with fp16)"
            )

    def _average_warmup(self, b: _Bucket, worker_grads: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Full-precision mean gradient of a bucket (fp32), exactly as DDP would compute it."""
        if worker_grads is not None:  # simulation: (g_0 / n) + (g_1 / n) + ... in worker order
            n = len(worker_grads)
            acc = worker_grads[0] / n
            for g in worker_grads[1:]:
                acc += g / n
            b.grad.copy_(acc)
        elif not self._ddp_attached and self.world_size > 1:
            b.grad.div_(self.world_size)  # DDP divides before summing; so do we
            dist.all_reduce(b.grad, group=self.process_group)
            self.comm_counter.add(ring_allreduce_bytes(b.numel, self.world_size), b.numel, self.world_size)
        return b.grad

    # -- the compressed synchronisation of one bucket ------------------------------------
    def _make_codec(self) -> Codec:
        raise NotImplementedError

    comm_mode: str = "error_feedback"

    def _comm_for(self, b: _Bucket):
        if b.comm is None:
            codec = self._make_codec()
            # groups: one scale never spans two parameter tensors of the bucket
            if self.simulate_workers is not None:
                b.comm = SimulatedCluster(codec, self.comm_mode, self.simulate_workers, counter=self.comm_counter,
                                          groups=b.offsets)
            else:
                # verify="always": the per-call agreement is also how every rank learns that
                # some rank's gradient was not finite, so they all skip the step together
                b.comm = CompressedAllreduce(codec, self.comm_mode, group=self.process_group,
                                             counter=self.comm_counter, verify="always", groups=b.offsets)
        return b.comm

    def _payload(self, b: _Bucket, grad: torch.Tensor, out: torch.Tensor) -> None:
        """Local quantity to synchronise (fp32, written to ``out``) from the local gradient."""
        raise NotImplementedError

    def _sync_target(self, b: _Bucket) -> torch.Tensor:
        """Where the collective writes its result. The collective writes only after every rank
        agreed the inputs are finite, so a state buffer may be the target directly (one full
        copy per step less); a failed call leaves it untouched."""
        return b.synced

    def _absorb(self, b: _Bucket, synced: torch.Tensor) -> None:
        """Fold the synchronised quantity into the bucket's state (e.g. momentum <- synced)."""

    def _sync_bucket(self, b: _Bucket, worker_grads: Sequence[torch.Tensor] | None = None) -> None:
        comm = self._comm_for(b)
        target = self._sync_target(b)
        if worker_grads is not None:
            payloads = []
            for g in worker_grads:
                out = torch.empty(b.numel, dtype=torch.float32, device=b.device)
                self._payload(b, g, out)
                payloads.append(out)
            try:
                result = comm.allreduce(payloads)[0]
            except ValueError as exc:
                raise NonFiniteGradientError(str(exc)) from exc
            target.copy_(result)
        else:
            if b.payload is None:
                b.payload = torch.empty(b.numel, dtype=torch.float32, device=b.device)
            payload = b.payload
            self._payload(b, b.grad, payload)
            try:
                comm(payload, out=target)
            except ValueError as exc:
                if "not finite" in str(exc):
                    raise NonFiniteGradientError(
                        f"{type(self).__name__}: {exc}. Lower the learning rate or clip gradients.") from exc
                raise
        self._absorb(b, target)
        b.done = True

    # -- DDP ---------------------------------------------------------------------------
    def attach(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Synchronise through ``ddp_model``'s gradient buckets from now on (the one call a
        plain PyTorch DDP user makes). Communication then runs in a DDP comm hook during
        backward, and ``step()`` only applies the update."""
        from ..comm.ddp_hook import register_compression_hook

        if self.simulate_workers is not None:
            raise RuntimeError("a simulated-cluster optimizer cannot be attached to DDP")
        mine = {id(p) for p in self.params_in_order()}
        foreign = [n for n, p in ddp_model.module.named_parameters() if p.requires_grad and id(p) not in mine]
        if foreign:
            raise ValueError(f"{type(self).__name__}.attach: the DDP model has trainable parameters this "
                             f"optimizer does not own ({foreign[:3]}...); one optimizer must own them all")
        if ddp_model.process_group is not None and self.process_group is None:
            self.process_group = ddp_model.process_group
        self._build_buckets()
        register_compression_hook(ddp_model, self)
        self._ddp_attached = True

    def ddp_bucket_ready(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The comm hook's work: average in fp32 during warm-up; in the compression phase
        copy the local gradients into this optimizer's buckets and synchronise every bucket
        that is complete."""
        buf = bucket.buffer()
        if not self._next_step_compresses():
            n = self.world_size
            buf.div_(n)
            self.comm_counter.add(ring_allreduce_bytes(buf.numel(), n, buf.element_size()), buf.numel(), n)
            fut = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        if self.defer_sync_to_step:
            fut0: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut0.set_result(buf)  # local gradients; step() synchronises them
            return fut0
        with torch.no_grad():
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                ob, i = self._param_bucket[id(p)]
                ob.views(ob.grad)[i].copy_(g)
                ob.ready += 1
                if ob.ready == len(ob.params):
                    self._sync_bucket(ob)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    # -- updates (subclasses) ------------------------------------------------------------
    def _update_warmup(self, b: _Bucket, grad: torch.Tensor, group: dict, has_grad: list[bool]) -> None:
        raise NotImplementedError

    def _update_compressed(self, b: _Bucket, group: dict, has_grad: list[bool]) -> None:
        raise NotImplementedError

    def _apply(self, b: _Bucket, update: torch.Tensor, group: dict, has_grad: list[bool],
               decoupled_wd: float = 0.0, step_size: float | None = None,
               denom: torch.Tensor | None = None) -> None:
        """p <- p * (1 - lr * wd) - step_size * update [/ denom] (step_size defaults to lr),
        for the params of the bucket that had a gradient. With ``denom`` the division is
        fused like ``torch.optim.AdamW``'s ``addcdiv_``, which rounds differently from a
        division followed by an add."""
        lr = group["lr"]
        step_size = lr if step_size is None else step_size
        keep = [i for i, h in enumerate(has_grad) if h]
        if not keep:
            return
        params = [b.params[i] for i in keep]
        ups = [b.views(update)[i] for i in keep]
        dens = [b.views(denom)[i] for i in keep] if denom is not None else None
        with torch.no_grad():
            if decoupled_wd:
                torch._foreach_mul_(params, 1 - lr * decoupled_wd)
            if params[0].dtype == torch.float32:
                if dens is None:
                    torch._foreach_add_(params, ups, alpha=-step_size)
                else:
                    torch._foreach_addcdiv_(params, ups, dens, value=-step_size)
            else:  # low-precision parameters: state and arithmetic stay fp32
                for j, (p, u) in enumerate(zip(params, ups, strict=True)):
                    step = u if dens is None else u / dens[j]
                    p.add_(step.to(p.dtype), alpha=-step_size)

    # -- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimisation step (synchronising first, unless a DDP hook already did)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.simulate_workers is not None:
            raise RuntimeError("with simulate_workers, call step_workers(grads) instead of step()")
        self._run_step(None)
        return loss

    @torch.no_grad()
    def step_workers(self, grads: Sequence[Sequence[torch.Tensor | None]]) -> None:
        """Simulated cluster: one step with ``grads[w][i]`` = worker w's gradient of
        ``params_in_order()[i]`` (all workers share the parameters and synced state)."""
        if self.simulate_workers is None:
            raise RuntimeError("step_workers needs simulate_workers=n at construction")
        if len(grads) != self.simulate_workers:
            raise ValueError(f"expected gradients of {self.simulate_workers} workers, got {len(grads)}")
        self._run_step(grads)

    def _worker_flat(self, b: _Bucket, grads) -> list[torch.Tensor]:
        out = []
        for wg in grads:
            flat = torch.zeros(b.numel, dtype=torch.float32, device=b.device)
            for pid, view in zip(b.ids, b.views(flat), strict=True):
                if wg[pid] is not None:
                    view.copy_(wg[pid])
            out.append(flat)
        return out

    def _run_step(self, worker_grads) -> None:
        buckets = self._build_buckets()
        compress = self._next_step_compresses()
        # Pass 1: synchronise every bucket (a NaN anywhere raises before any state changes).
        plan = []
        for b in buckets:
            if worker_grads is not None:
                has = [any(wg[i] is not None for wg in worker_grads) for i in b.ids]
                wflat = self._worker_flat(b, worker_grads)
            else:
                has = [p.grad is not None for p in b.params]
                wflat = None
                if not (self._ddp_attached and compress and b.ready):
                    self._gather_grads(b)
            if not any(has) and self.world_size == 1:
                plan.append((b, has, None, []))
                continue
            # one process: a parameter without gradient is skipped, state included, as torch does
            skipped = self._snapshot_skipped(b, has) if self.world_size == 1 else []
            if compress:
                if not b.done:
                    if wflat is None and not self._ddp_attached:
                        self._check_finite(b.grad, "gradient")
                    self._sync_bucket(b, wflat)
                plan.append((b, has, None, skipped))
            else:
                grad = self._average_warmup(b, wflat)
                self._check_finite(grad, "averaged gradient")
                plan.append((b, has, grad, skipped))
        if self.world_size > 1:
            plan = [(b, [True] * len(h), g, s) for b, h, g, s in plan]  # replicas must update identically
        # Pass 2: updates.
        self._step += 1
        for b, has, grad, skipped in plan:
            if not any(has):
                continue
            group = self.param_groups[b.group_index]
            if compress:
                self._update_compressed(b, group, has)
            else:
                self._update_warmup(b, grad, group, has)
            self._restore_skipped(skipped)
            b.done = False
            b.ready = 0
        self.comm_counter.end_step()

    def _snapshot_skipped(self, b: _Bucket, has: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the state slices of the bucket's parameters that have no gradient: the flat
        sync and update would otherwise move their moments and error state."""
        if all(has):
            return []
        bufs = list(b.flat.values())
        comm = b.comm if isinstance(b.comm, CompressedAllreduce) else None
        if comm is not None:
            bufs += [t for t in (comm.worker, comm.server, comm.tilde) if t is not None]
        out = []
        for i, h in enumerate(has):
            if not h:
                lo, n = b.offsets[i], b.numels[i]
                out += [(t[lo:lo + n], t[lo:lo + n].clone()) for t in bufs]
        return out

    @staticmethod
    def _restore_skipped(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for view, value in saved:
            view.copy_(value)

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        buckets = self._buckets or []
        sd["onebit"] = {
            "algorithm": type(self).__name__,
            "step": self._step,
            "compressing": self._compressing,
            "layout": [b.ids for b in buckets],
            "comm": [None if b.comm is None else b.comm.state_dict() for b in buckets],
            "bytes": self.comm_counter.state_dict(),
            "extra": self._extra_state(),
        }
        return sd

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        extra = sd.pop("onebit", None)
        if extra is None:
            raise ValueError(f"{type(self).__name__}: this state_dict was not written by a lightning_onebit "
                             "optimizer (no 'onebit' section)")
        if extra["algorithm"] != type(self).__name__:
            raise ValueError(f"state_dict was written by {extra['algorithm']}, cannot load it into "
                             f"{type(self).__name__}")
        super().load_state_dict(sd)
        self._step = extra["step"]
        self._compressing = extra["compressing"]
        self.comm_counter.load_state_dict(extra["bytes"])
        self._load_extra_state(extra["extra"])
        self._buckets = None
        self._param_bucket = {}
        buckets = self._build_buckets()  # re-adopts the loaded per-parameter state into flat buffers
        if [b.ids for b in buckets] != extra["layout"] and any(c is not None for c in extra["comm"]):
            warnings.warn(f"{type(self).__name__}: bucket layout differs from the checkpoint's "
                          "(different bucket_cap_mb or parameters); compression error state was reset",
                          stacklevel=2)
            return
        for b, csd in zip(buckets, extra["comm"], strict=False):
            if csd is not None:
                comm = self._comm_for(b)
                comm.load_state_dict(csd)


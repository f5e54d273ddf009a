"""Full-precision collectives of the optimizers: the warm-up mean, small agreements and row gathers.

The compressed optimizers call torch.distributed only through the comm layer; these are the
uncompressed calls beside :class:`~lightning_onebit.comm.CompressedAllreduce`. Each is a no-op
in one process (or without an initialised default group).

Latency on gloo: its ring ``all_gather`` waits a round trip per step, n - 1 of them, and a small
``all_reduce`` about 2, against one for an ``all_to_all_single`` (``benchmarks/collectives.py --rtt 50`` and
its ``*_ring`` methods; benchmarks/RESULTS.md, "Measurements behind design choices"). So on gloo with CPU
tensors a gather of rows (:func:`all_gather_rows`) and a small OR (:func:`any_across`) send each rank's row
to every rank in one ``all_to_all_single``: one round trip. A gather sends the same (n - 1) rows per rank either way;
an OR sends (n - 1) copies of its bytes instead of a ring's 2 (n - 1) / n, so it fans out only while
that stays under :data:`FANOUT_MAX_BYTES`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .accounting import ByteCounter, ring_allreduce_bytes
from .duplex import exchange_rows

__all__ = ["FANOUT_MAX_BYTES", "all_finite", "all_finite_many", "all_gather_rows", "any_across", "any_across_bytes",
           "backend_for", "collective_device", "fans_out", "group_size", "launcher_ranks_per_node", "mean_allreduce",
           "mean_allreduce_future", "nonfinite_flags_", "pack_bits", "ready_future", "to_wire", "unpack_bits"]

FANOUT_MAX_BYTES = 1 << 16
"""The most bytes a rank sends in a fanned-out :func:`any_across` ((n - 1) copies of its packed flags);
more goes as a ring ``all_reduce``, whose bytes do not grow with n."""

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def launcher_ranks_per_node() -> int | None:
    """Ranks on this host as the launcher says (``LOCAL_WORLD_SIZE``: torchrun and Lightning's launchers set
    it), or None where it does not."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None


def group_size(group=None) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def to_wire(t: torch.Tensor, n: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``t / n`` (in place) in the dtype it is sent in: divided in fp32 before the cast, so fp16's sum of
    n quotients stays in range where the sum of the gradients would not."""
    t.div_(n)
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def mean_allreduce(t: torch.Tensor, group=None, counter: ByteCounter | None = None, *,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """In place: ``t`` <- the mean of ``t`` over the group, as DDP computes it (each rank divides
    by n, then the sum), counted as a ring allreduce. ``dtype`` (bf16, fp16): sent and summed in
    that dtype, as PyTorch's ``bf16_compress_hook``/``fp16_compress_hook`` do, for half the bytes."""
    n = group_size(group)
    if n > 1:
        wire = to_wire(t, n, dtype)
        dist.all_reduce(wire, group=group)
        if wire is not t:
            t.copy_(wire)
        if counter is not None:
            counter.add(ring_allreduce_bytes(t.numel(), n, wire.element_size()), t.numel(), n)
    return t


def ready_future(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future that already holds ``t`` (a DDP comm hook that sends nothing returns one)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def mean_allreduce_future(t: torch.Tensor, group=None, counter: ByteCounter | None = None, *,
                          dtype: torch.dtype | None = None) -> torch.futures.Future[torch.Tensor]:
    """:func:`mean_allreduce` started asynchronously (a DDP comm hook's return value: ``t``)."""
    n = group_size(group)
    if n == 1:
        return ready_future(t)
    wire = to_wire(t, n, dtype)
    if counter is not None:
        counter.add(ring_allreduce_bytes(t.numel(), n, wire.element_size()), t.numel(), n)
    work = dist.all_reduce(wire, group=group, async_op=True).get_future()
    if wire is t:
        return work.then(lambda f: f.value()[0])
    return work.then(lambda f: t.copy_(f.value()[0]))


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``x``'s device: every element of ``x`` is finite. min and max propagate NaN and
    show an infinity, so one fused pass decides it without a host sync; ``isfinite(x).all()`` makes
    x-sized temporaries, and so does a sum in fp64 (both far slower: benchmarks/RESULTS.md, "Measurements
    behind design choices")."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    return torch.isfinite(torch.stack(torch.aminmax(x.detach().reshape(-1)))).all()


def all_finite_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-dim bool: every element of every tensor in ``tensors`` is finite. GradScaler's foreach check
    (``_amp_foreach_non_finite_check_and_unscale_`` with scale 1, which rewrites each value as itself)
    decides each device and dtype in one kernel, where :func:`all_finite` makes a pass per tensor (the
    measurement: benchmarks/RESULTS.md, "Measurements behind design choices"). Sparse tensors and dtypes it does
    not take go through :func:`all_finite`."""
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    check = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    rest = []
    for t in tensors:
        if check is not None and not t.is_sparse and t.dtype in (torch.float32, torch.float16, torch.bfloat16,
                                                                 torch.float64):
            by_kind.setdefault((t.device, t.dtype), []).append(t.detach())
        else:
            rest.append(all_finite(t))
    device = tensors[0].device
    for (dev, _), ts in by_kind.items():
        found = torch.zeros((), dtype=torch.float32, device=dev)
        check(ts, found, torch.ones((), dtype=torch.float32, device=dev))
        rest.append((found == 0).to(device))
    return torch.stack(rest).all()


def nonfinite_flags_(flags: torch.Tensor, groups: Sequence[Sequence[torch.Tensor]], found: torch.Tensor,
                     one: torch.Tensor, found_rows: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``flags[i]`` (bool) <- some element of ``groups[i]`` (fp32 tensors on ``flags``' device) is NaN or inf,
    with no allocation: :func:`all_finite_many`'s foreach check per group, into ``found[i]`` (fp32 scratch, one
    per group) with ``one`` (an fp32 1) as its scale, buffers the caller keeps; ``found_rows``: ``found``'s
    elements as views the caller keeps too (else made here, an op each). Returns ``flags``."""
    found.zero_()
    rows = found.unbind() if found_rows is None else found_rows
    for row, ts in zip(rows, groups, strict=True):
        if ts:
            torch._amp_foreach_non_finite_check_and_unscale_(list(ts), row, one)
    return torch.gt(found, 0, out=flags)


def fans_out(group, device: torch.device) -> bool:
    """Whether gathers on ``group`` of tensors on ``device`` go as one ``all_to_all_single`` (gloo with CPU
    tensors: see the module docstring)."""
    return device.type == "cpu" and backend_for(group, device) == "gloo"


def all_gather_rows(out: torch.Tensor, row: torch.Tensor, group=None, async_op: bool = False, *,
                    fanout: bool | None = None, send: torch.Tensor | None = None, twin=None):
    """Gather one ``row`` per rank into the rows of ``out`` ``[n, len]`` (rank order): 1-D, or ``[1, len]``
    (a buffer's row as it is kept), which an ``all_gather`` takes with ``out`` as they are, no view made.

    ``fanout``: send the row to every rank in one ``all_to_all_single`` instead of an ``all_gather``: the
    same (n - 1) rows per rank, one round trip instead of gloo's n - 1. ``None``: :func:`fans_out`. ``send``:
    an ``[n, len]`` staging buffer for the copies (else one is allocated per call). ``twin``: the group's
    duplex twin (:mod:`~lightning_onebit.comm.duplex`): a fanout then sends the row itself to every rank,
    each direction of a pair on its own connection, and needs no copies."""
    if fanout is None:
        fanout = fans_out(group, row.device)
    if not fanout:
        if row.dim() == 2 and out.dim() == 2:  # [1, len] into [n, len]: the shapes gloo and NCCL take
            return _all_gather_single(out, row, group=group, async_op=async_op)
        return _all_gather_single(out.view(-1), row.reshape(-1), group=group, async_op=async_op)
    if twin is not None:
        return exchange_rows(out, [row] * out.shape[0], group, twin=twin, tag=2, async_op=async_op)
    copies = row.reshape(1, -1).expand(out.shape[0], -1)
    send = copies.contiguous() if send is None else send.copy_(copies)
    return dist.all_to_all_single(out.view(-1), send.view(-1), group=group, async_op=async_op)


def _fanned_or(numel: int, n: int) -> bool:
    return (n - 1) * ((numel + 7) // 8) <= FANOUT_MAX_BYTES


def any_across(flags: torch.Tensor, group=None, counter: ByteCounter | None = None) -> torch.Tensor:
    """Elementwise OR of a bool tensor over the group.

    gloo ORs the flags packed 8 to a byte: every rank's bytes gathered in one round trip and ORed
    locally while that is small (:data:`FANOUT_MAX_BYTES`, CPU flags), else a BOR allreduce (1 bit
    per flag); NCCL has no bitwise reduction, so there it is a MAX allreduce of one byte per flag."""
    n = group_size(group)
    if n == 1:
        return flags
    if _has_bitwise_or(group, flags.device):
        packed = pack_bits(flags)
        if flags.device.type == "cpu" and _fanned_or(flags.numel(), n):
            rows = packed.new_empty(n, packed.numel())
            all_gather_rows(rows, packed, group, fanout=True)
            sent = (n - 1) * packed.numel()
            packed = rows[0]
            for r in rows[1:]:
                packed = packed.bitwise_or(r)
        else:
            dist.all_reduce(packed, op=dist.ReduceOp.BOR, group=group)
            sent = ring_allreduce_bytes(packed.numel(), n, 1)
        out = unpack_bits(packed, flags.numel()).view(flags.shape)
    else:
        u8 = flags.to(torch.uint8)
        dist.all_reduce(u8, op=dist.ReduceOp.MAX, group=group)
        out, sent = u8.bool(), ring_allreduce_bytes(u8.numel(), n, 1)
    if counter is not None:
        counter.add(sent, 0, n)
    return out


def any_across_bytes(numel: int, n: int) -> int:
    """Bytes one rank sends in :func:`any_across` of ``numel`` CPU flags on gloo (the simulation's count)."""
    packed = (numel + 7) // 8
    return (n - 1) * packed if _fanned_or(numel, n) else ring_allreduce_bytes(packed, n, 1)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """Bools -> uint8, 8 to a byte, first flag in the lowest bit (the tail padded with False)."""
    if flags.device.type == "cpu":
        # numpy's C loops: many times faster than torch's ops for a BERT embedding's masked rows (benchmarks/
        # RESULTS.md, "Measurements behind design choices")
        return torch.from_numpy(np.packbits(flags.reshape(-1).to(torch.bool).numpy(), bitorder="little"))
    flat = flags.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _BIT_WEIGHTS.to(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` flags."""
    if packed.device.type == "cpu":
        bits = np.unpackbits(packed.reshape(-1).numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)) != 0
    return bits.view(-1)[:numel]


def dist_backend(group) -> str:
    """``group``'s backend as torch.distributed names it ("nccl", "gloo", "cpu:gloo,cuda:nccl", ...)."""
    return str(dist.get_backend(group)).lower()


def backend_for(group, device: torch.device) -> str | None:
    """The backend that carries ``device``'s tensors in ``group`` ("gloo", "nccl", ...), or None.

    A group made as ``"nccl"`` serves CUDA tensors only; ``"gloo"`` (and ``"mpi"``) serve both;
    ``"cpu:gloo,cuda:nccl"`` names one per device type."""
    spec = dist_backend(group)
    if ":" not in spec:
        return None if spec in ("nccl", "xccl") and device.type == "cpu" else spec
    table = dict(item.split(":", 1) for item in spec.split(",") if ":" in item)
    return table.get(device.type)


def collective_device(group, device: torch.device) -> torch.device:
    """Where a small control tensor (an agreement, flags) about ``device``'s data travels: on the
    data's device when the group has a backend for it (NCCL needs CUDA tensors), else on the CPU."""
    return device if device.type != "cpu" and backend_for(group, device) is not None else torch.device("cpu")


def _has_bitwise_or(group, device: torch.device) -> bool:
    return backend_for(group, device) == "gloo"

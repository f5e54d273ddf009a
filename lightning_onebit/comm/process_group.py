"""Starting the default process group so that it survives ``torchrun --max-restarts``.

torchrun's c10d rendezvous shares one TCPStore between the agent and its workers and keeps it across
restarts (``TORCHELASTIC_USE_AGENT_STORE``, the same ``MASTER_PORT`` on every attempt), while
``init_process_group("env://")`` adds no per-attempt prefix to its keys. Gloo's full-mesh connect publishes
each rank's listening address under a fixed key, so a restarted rank can read the address its peer had
*before* the restart and fail with "connectFullMesh failed ... Connection refused" (or wait in the connect).
:func:`init_for_attempt` starts the group in keys of ``TORCHELASTIC_RESTART_COUNT`` instead (what torch did
before the store was shared); outside torchrun it does nothing and ``env://`` is safe.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["attempt_store", "init_for_attempt"]


def attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The elastic agent's store under a prefix of this restart attempt, or ``None`` when this
    process was not started by an agent that shares its store (then ``env://`` is safe)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"/worker/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def init_for_attempt(backend: str, *, rank: int, world_size: int, timeout: datetime.timedelta,
                     device: torch.device | None = None) -> bool:
    """Start the default group in this restart attempt's keys, if none is started yet and an agent's shared
    store is there (see the module docstring); ``True`` if it did. ``device``: the rank's accelerator (NCCL
    binds the group to it), ``None`` or a CPU for none."""
    if dist.is_initialized():
        return False
    store = attempt_store(timeout)
    if store is None:
        return False
    kwargs = {"device_id": device} if device is not None and device.type != "cpu" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return True

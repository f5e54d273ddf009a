"""Checkpoints of the compressed strategies: what every rank shares goes to the main file, each
rank's error-feedback state to a shard of its own next to it.

::

    <dir>/epoch=3-step=400.ckpt                                       # rank 0: the main file
    <dir>/.onebit-error-state/epoch=3-step=400.ckpt/rank00002-of-00004.pt  # rank 2's shard

Saving moves no error state between ranks and needs no memory beyond a rank's own state. A resume
on the same world size and layout continues bit for bit; on another world size, or with a shard
that is missing, unreadable or from another save, the moments and phase are kept and the error
state is reset with a warning (``strict_resume``: an error). ``ModelCheckpoint``'s deletions
remove the shards with the file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem
from torch.optim import Optimizer

from ..optim import CompressedOptimizer

__all__ = ["SHARD_DIR", "ErrorStateShards", "shard_path"]


SHARD_DIR = ".onebit-error-state"
"""Directory, next to a checkpoint file, of the per-rank error-state shards (one sub-directory per
checkpoint file). Hidden and without ``.ckpt`` or ``last`` in its name, so that Lightning's search
for checkpoints (``ckpt_path="last"``) never takes it for one."""


def shard_path(checkpoint: str | os.PathLike, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its error state for ``checkpoint``."""
    head, name = os.path.split(os.fspath(checkpoint))
    return os.path.join(head, SHARD_DIR, name, f"rank{rank:05d}-of-{world_size:05d}.pt")


_PREVIOUS = ".prev"  # a rank's shard of the save before, kept until its new shard is complete


def _read_shard(path: str) -> tuple[str | None, dict | None]:
    """(why it cannot be used, None) or (None, the shard)."""
    try:
        with get_filesystem(path).open(path, "rb") as f:
            return None, torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return "is missing", None
    except Exception as e:  # truncated or corrupted
        return f"cannot be read ({type(e).__name__}: {e})", None


def _save_id(checkpoint: Mapping[str, Any]) -> list:
    """What ties a shard to its main file without a collective: the same on every rank of one save."""
    return [checkpoint.get("epoch"), checkpoint.get("global_step"),
            [st.get("onebit", {}).get("step") for st in checkpoint.get("optimizer_states", [])
             if isinstance(st, dict)]]


class ErrorStateShards:
    """Mixin of :class:`~lightning_onebit.strategies.CompressedDDPStrategy` (before the DDP
    strategy in its bases): the checkpoint hooks that split the optimizers' state between the
    main file and the ranks' shards. Uses the strategy's ``optimizers``, ranks, ``barrier``,
    ``algorithm`` and ``strict_resume``."""

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """The optimizer's state without its per-rank error state (which goes to this rank's shard)."""
        sd = super().optimizer_state(optimizer)
        opt = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(opt, CompressedOptimizer) and "onebit" in sd:
            section = dict(sd["onebit"])
            section["comm"] = [None] * len(section["comm"])
            section["world_size"] = self.world_size
            section["error_state"] = "shards"
            sd["onebit"] = section
        return sd

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its error-state shard; once all have (a barrier), rank 0 writes the main file.

        A save killed part way must leave a resumable pair. Each rank keeps its previous shard
        (``.prev``) until its new one is complete, and the main file is replaced only after every
        new shard exists: an old main file finds its shards in ``.prev``, a new one in the current
        files (:meth:`_attach_shard` picks by save id).
        """
        shards = {i: opt.error_state_dict() for i, opt in enumerate(self.optimizers)
                  if isinstance(opt, CompressedOptimizer)} if "optimizer_states" in checkpoint else {}
        if shards:
            path = shard_path(filepath, self.global_rank, self.world_size)
            fs = get_filesystem(path)
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            if fs.exists(path):
                fs.mv(path, path + _PREVIOUS)
            _atomic_save({"rank": self.global_rank, "world_size": self.world_size, "save_id": _save_id(checkpoint),
                          "optimizers": shards}, path)
            if self.is_global_zero:  # shards of an earlier save at this path on another world size
                mine = f"-of-{self.world_size:05d}.pt"
                for old in fs.ls(os.path.dirname(path), detail=False):
                    if not str(old).removesuffix(_PREVIOUS).endswith(mine):
                        fs.rm(old)
            self.barrier("lightning_onebit: error-state shards written")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the file (rank 0) and the shards with it (every rank its own, rank 0 the directory)."""
        super().remove_checkpoint(filepath)
        own = shard_path(filepath, self.global_rank, self.world_size)
        fs = get_filesystem(own)
        directory = os.path.dirname(own)
        for target, recursive in ((own, False), (own + _PREVIOUS, False),
                                  *([(directory, True)] if self.is_global_zero else [])):
            try:
                fs.rm(target, recursive=recursive)
            except FileNotFoundError:  # another rank removed it first (shared filesystem)
                pass

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the main file (a clear error if it is unreadable) and this rank's error-state shard."""
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as e:  # truncated, corrupted, not a checkpoint
            raise RuntimeError(f"cannot read the checkpoint file {os.fspath(checkpoint_path)!r} (truncated or "
                               f"corrupted?): {type(e).__name__}: {e}") from e
        self._attach_shard(checkpoint, checkpoint_path)
        return checkpoint

    def _attach_shard(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        sections = [st.get("onebit") if isinstance(st, dict) else None
                    for st in checkpoint.get("optimizer_states", [])]
        wanted = [i for i, sec in enumerate(sections) if sec is not None and sec.get("error_state") == "shards"]
        if not wanted or sections[wanted[0]].get("world_size") != self.world_size:
            return  # nothing per rank, or another world size (load_optimizer_state_dict says so)
        path = shard_path(checkpoint_path, self.global_rank, self.world_size)
        save_id = _save_id(checkpoint)

        def of_this_save(candidate: dict | None) -> bool:
            return candidate is not None and candidate.get("save_id") == save_id \
                and set(candidate.get("optimizers", {})) == set(wanted)

        why, shard = _read_shard(path)
        if shard is not None and not of_this_save(shard):
            why, shard = "belongs to another save of this path", None
        if shard is None:  # a save killed before it replaced the main file leaves the matching shard here
            _, prev = _read_shard(path + _PREVIOUS)
            shard = prev if of_this_save(prev) else None
        if shard is None:
            msg = (f"rank {self.global_rank}: the error-state shard {path} {why}; moments and phase are kept, "
                   "the compression error state is reset")
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            warnings.warn(msg, stacklevel=2)
            return
        for i in wanted:
            sections[i]["comm"] = shard["optimizers"][i]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = list(checkpoint["optimizer_states"])
        for i, st in enumerate(states):
            section = st.get("onebit") if isinstance(st, dict) else None
            if section is None:
                if isinstance(self.optimizers[i], CompressedOptimizer):
                    raise ValueError("this checkpoint's optimizer state was not written by a lightning_onebit "
                                     f"optimizer, it cannot be resumed with strategy {self.algorithm!r}")
                continue
            if section["algorithm"] != type(self.optimizers[i]).__name__:
                raise ValueError(f"checkpoint was written with {section['algorithm']}; strategy {self.algorithm!r} "
                                 f"runs {type(self.optimizers[i]).__name__}. Resume with the same algorithm.")
            section = dict(section)
            saved_ws = section.pop("world_size", None)
            section.pop("error_state", None)
            per_rank = section.pop("comm_per_rank", None)  # checkpoints that held every rank's state
            if saved_ws is not None and saved_ws != self.world_size:
                warnings.warn(f"checkpoint was written on {saved_ws} ranks, resuming on {self.world_size}: "
                              "moments and phase are kept, the per-rank error-feedback state is reset",
                              stacklevel=2)
                section["comm"] = [None for _ in section["comm"]]
            elif per_rank is not None:
                section["comm"] = per_rank[self.global_rank]
            states[i] = dict(st, onebit=section)
        super().load_optimizer_state_dict(dict(checkpoint, optimizer_states=states))

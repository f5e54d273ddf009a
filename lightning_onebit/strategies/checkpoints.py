"""Checkpoints of the package's strategies: what every rank shares goes to the main file, each
rank's own state to a shard of its own next to it.

::

    <dir>/epoch=3-step=400.ckpt                                       # rank 0: the main file
    <dir>/.onebit-error-state/epoch=3-step=400.ckpt/rank00002-of-00004.pt  # rank 2's shard

:class:`RankShards` is the machinery (shard paths, the ``.prev`` copy kept until a new shard is
complete, save ids, ``ModelCheckpoint``'s deletions, missing/unreadable/stale shards,
``strict_resume``); a family says what its shards hold:

* the compressed strategies (:class:`ErrorStateShards`): the main file holds the model, the
  moments and the phase; a shard, the rank's error-feedback state;
* ``diloco``: the main file holds the anchor (as the model), the outer momentum, the clock, the
  counters and the outer steps in flight; a shard, the rank's replica, AdamW moments, error state and
  buffers.

Saving moves no rank's own state across the network (a barrier orders the files), needs no memory
beyond a rank's own state, and the main file does not grow with the number of ranks. A resume on
the same world size and layout continues bit for bit. With a shard that is missing, unreadable or
from another save, the rank's own state is reset with a warning naming it (``strict_resume``: an
error): the compressed strategies keep the moments and phase and zero the error state, DiLoCo starts
the rank from the anchor with rank 0's AdamW moments. On another world size the compressed
strategies warn on every rank and reset the error state; DiLoCo starts every rank from the anchor
with rank 0's moments, with one warning on rank 0 (``strict_resume``: an error).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem
from torch.optim import Optimizer

from ..optim import CompressedOptimizer

__all__ = ["SHARD_DIR", "ErrorStateShards", "RankShards", "shard_path"]


SHARD_DIR = ".onebit-error-state"
"""Directory, next to a checkpoint file, of the per-rank shards (one sub-directory per checkpoint
file; named for the compressed strategies' error-state shards, which came first). Hidden and without
``.ckpt`` or ``last`` in its name, so that Lightning's search for checkpoints (``ckpt_path="last"``)
never takes it for one."""


def shard_path(checkpoint: str | os.PathLike, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its own state for ``checkpoint``."""
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


def _save_id(checkpoint: Mapping[str, Any], clock: Callable[[dict], Any]) -> list:
    """What ties a shard to its main file without a collective: the same on every rank of one save
    (``clock``: an optimizer state's step, as its family keeps it)."""
    return [checkpoint.get("epoch"), checkpoint.get("global_step"),
            [clock(st) for st in checkpoint.get("optimizer_states", []) if isinstance(st, dict)]]


class RankShards:
    """Mixin of the strategies (before the DDP strategy in their bases): the checkpoint hooks that
    keep each rank's own optimizer state in a shard of its own next to the main file (paths, the
    ``.prev`` copy, save ids, removal with the file, missing/unreadable/stale shards and
    ``strict_resume``). Uses the strategy's ``optimizers``, ranks, ``barrier`` and ``strict_resume``.

    A family says what goes in a shard (:meth:`_shard_states`), the keys of its section in an
    optimizer's saved state (``_section``, ``_marker``, ``_slot``, ``_clock_key``: where the shard's
    content goes back), and the words of its warning (``_shard_name``, ``_reset_note``). The main file's optimizer state
    (``optimizer_state``) and its loading (``load_optimizer_state_dict``) are the family's too.
    """

    _shard_name = "error-state"  # what the shard is called in the warnings
    _reset_note = "moments and phase are kept, the compression error state is reset"  # what a lost shard costs
    _shards_of: str | None = None  # the checkpoint file last loaded (another rank's shard is found from it)

    # -- the family's part ---------------------------------------------------------------------
    #: the key of the family's section in an optimizer's saved state, the key in it that marks a state
    #: whose per-rank part is in shards (its value ``"shards"``), where a shard's content goes back in
    #: the section, and the section's step count (for the save id)
    _section: str
    _marker: str
    _slot: str
    _clock_key: str

    def _shard_states(self) -> dict[int, Any]:
        """This rank's own state per optimizer index, for its shard (empty: no shard)."""
        raise NotImplementedError

    def _shard_clock(self, optimizer_state: dict) -> Any:
        """An optimizer's step in its saved state (for the save id)."""
        return optimizer_state.get(self._section, {}).get(self._clock_key)

    def _sharded(self, checkpoint: Mapping[str, Any]) -> tuple[list[int], int | None] | None:
        """(the optimizer indices whose per-rank state is in shards, the world size the main file was
        written on), or None when the checkpoint has no shards."""
        sections = [st.get(self._section) if isinstance(st, dict) else None
                    for st in checkpoint.get("optimizer_states", [])]
        wanted = [i for i, sec in enumerate(sections) if sec is not None and sec.get(self._marker) == "shards"]
        return (wanted, sections[wanted[0]].get("world_size")) if wanted else None

    def _use_shard(self, checkpoint: dict[str, Any], states: Mapping[int, Any]) -> None:
        """Put a shard's content back where the family's loading reads it."""
        for i, own in states.items():
            checkpoint["optimizer_states"][i][self._section][self._slot] = own

    def _save_id(self, checkpoint: Mapping[str, Any]) -> list:
        return _save_id(checkpoint, self._shard_clock)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its shard; once all have (a barrier), rank 0 writes the main file.

        A save killed part way must leave a resumable pair. Each rank keeps its previous shard
        (``.prev``) until its new one is complete, and the main file is replaced only after every
        new shard exists: an old main file finds its shards in ``.prev``, a new one in the current
        files (:meth:`_find_shard` picks by save id).
        """
        shards = self._shard_states() if "optimizer_states" in checkpoint else {}
        if shards:
            path = shard_path(filepath, self.global_rank, self.world_size)
            fs = get_filesystem(path)
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            if fs.exists(path):
                fs.mv(path, path + _PREVIOUS)
            _atomic_save({"rank": self.global_rank, "world_size": self.world_size, "save_id": self._save_id(checkpoint),
                          "optimizers": shards}, path)
            if self.is_global_zero:  # shards of an earlier save at this path on another world size
                mine = f"-of-{self.world_size:05d}.pt"
                for old in fs.ls(os.path.dirname(path), detail=False):
                    if not str(old).removesuffix(_PREVIOUS).endswith(mine):
                        fs.rm(old)
            self.barrier("lightning_onebit: per-rank shards written")
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

    # -- loading ---------------------------------------------------------------------------------
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the main file (a clear error if it is unreadable) and this rank's shard."""
        if os.path.isdir(checkpoint_path):  # a sharded checkpoint (torch.distributed.checkpoint's directory)
            raise ValueError(f"{os.fspath(checkpoint_path)!r} is a sharded checkpoint directory (strategy "
                             "'diloco_fsdp' or Lightning's ModelParallelStrategy writes them): resume it with the "
                             "strategy that wrote it, or turn it into one file first with "
                             "torch.distributed.checkpoint.format_utils.dcp_to_torch_save")
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as e:  # truncated, corrupted, not a checkpoint
            raise RuntimeError(f"cannot read the checkpoint file {os.fspath(checkpoint_path)!r} (truncated or "
                               f"corrupted?): {type(e).__name__}: {e}") from e
        self._shards_of = os.fspath(checkpoint_path)
        self._attach_shard(checkpoint, checkpoint_path)
        return checkpoint

    def _find_shard(self, checkpoint: Mapping[str, Any], path: str,
                    wanted: list[int]) -> tuple[str | None, dict | None]:
        """(why it cannot be used, None) or (None, the shard at ``path`` of this save): the file, or the
        one kept from the save before (``.prev``) when a save was killed before the main file."""
        save_id = self._save_id(checkpoint)

        def of_this_save(candidate: dict | None) -> bool:
            return candidate is not None and candidate.get("save_id") == save_id \
                and set(candidate.get("optimizers", {})) == set(wanted)

        why, shard = _read_shard(path)
        if shard is not None and not of_this_save(shard):
            why, shard = "belongs to another save of this path", None
        if shard is None:  # a save killed before it replaced the main file leaves the matching shard here
            _, prev = _read_shard(path + _PREVIOUS)
            shard = prev if of_this_save(prev) else None
        return (None, shard) if shard is not None else (why, None)

    def _rank_shard(self, checkpoint: Mapping[str, Any], rank: int, world_size: int) -> dict | None:
        """Rank ``rank``'s shard of the checkpoint last loaded (written on ``world_size`` ranks), if it
        can be read and is of this save; else None."""
        sharded = self._sharded(checkpoint)
        if self._shards_of is None or not sharded or not sharded[0]:
            return None
        return self._find_shard(checkpoint, shard_path(self._shards_of, rank, world_size), sharded[0])[1]

    def _attach_shard(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        sharded = self._sharded(checkpoint)
        if not sharded or not sharded[0] or sharded[1] != self.world_size:
            return  # nothing per rank, or another world size (load_optimizer_state_dict says so)
        path = shard_path(checkpoint_path, self.global_rank, self.world_size)
        why, shard = self._find_shard(checkpoint, path, sharded[0])
        if shard is None:
            msg = f"rank {self.global_rank}: the {self._shard_name} shard {path} {why}; {self._reset_note}"
            if self.strict_resume:
                raise RuntimeError(msg + " (strict_resume=True: stopping instead)")
            warnings.warn(msg, stacklevel=2)
            return
        self._use_shard(checkpoint, shard["optimizers"])


class ErrorStateShards(RankShards):
    """The compressed strategies' part of :class:`RankShards`
    (:class:`~lightning_onebit.strategies.CompressedDDPStrategy`): the main file holds the optimizers'
    state without the collectives' error-feedback state (``comm``), which goes to the shards. Uses
    the strategy's ``algorithm`` too."""

    _section, _marker, _slot, _clock_key = "onebit", "error_state", "comm", "step"

    def _shard_states(self) -> dict[int, Any]:
        return {i: opt.error_state_dict() for i, opt in enumerate(self.optimizers)
                if isinstance(opt, CompressedOptimizer)}

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

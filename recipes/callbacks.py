"""Lightning callbacks of the recipes: byte accounting for the DDP baselines, a per-rank record
that reaches the summary whatever launched the ranks, and what a resume needs beyond Lightning's
own checkpoint (the run's identity, every rank's random number generators)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch

from lightning_onebit import DiLoCo
from lightning_onebit.callbacks import ReplicaSync, find_compressed_optimizer
from lightning_onebit.comm import gather_objects, ring_allreduce_bytes
from lightning_onebit.optim import NonFiniteGradientError
from lightning_onebit.strategies import destroy_process_group_at_exit
from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy

__all__ = ["DDPCommCounter", "RNGStates", "RankRecord", "RunIdentity", "TorchThreads"]


class DDPCommCounter(L.Callback):
    """What DDP sends per rank: one fp32 ring allreduce of every trainable gradient per optimizer step, or,
    with a comm hook of :mod:`lightning_onebit.strategies.ddp_hooks` (``HookDDPStrategy``), what that hook sends
    (``hook_step_bytes``: fp16/bf16 half of it, PowerSGD its P and Q factors after its vanilla steps). Logs
    the keys :class:`lightning_onebit.CommunicationMonitor` logs for the compressed strategies, so plots and
    tables treat the baselines like any algorithm."""

    def __init__(self) -> None:
        self.bytes_total = 0
        self.fp32_ring_total = 0
        self.last_ratio = 1.0  # fp32 ring bytes / bytes sent, of the last step
        self.rounds = 0  # steps that sent anything (every step, on more than one rank)
        self._last_step = 0
        self._step_bytes: int | None = None  # of the last step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        first, self._last_step = self._last_step, trainer.global_step  # no step while accumulating gradients
        shapes = [p.shape for p in pl_module.parameters() if p.requires_grad]
        numel = sum(s.numel() for s in shapes)
        opt = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0]) if trainer.optimizers else None
        if isinstance(opt, DiLoCo):  # DDP sends nothing: the optimizer counts its outer steps' bytes
            c = opt.comm_counter
            sent_now, self.bytes_total = c.total.bytes_sent - self.bytes_total, c.total.bytes_sent
            self.fp32_ring_total, self.rounds = c.total.fp32_ring_bytes, c.rounds
            self.last_ratio = c.total.ratio_vs_fp32  # over the run: most steps send nothing
            pl_module.log_dict({"comm/bytes_step": float(sent_now), "comm/bytes_total": float(self.bytes_total),
                                "comm/rounds": float(self.rounds),
                                "comm/bits_per_param": 8.0 * self.bytes_total / max(c.steps, 1) / max(numel, 1)},
                               on_step=True, on_epoch=False, rank_zero_only=True)
            return
        fp32 = ring_allreduce_bytes(numel, trainer.world_size)
        hooked = trainer.strategy if isinstance(trainer.strategy, HookDDPStrategy) else None
        sent_now = 0
        for step in range(first, trainer.global_step):
            sent = hooked.step_bytes(shapes, trainer.world_size, step) if hooked else None
            self._step_bytes = fp32 if sent is None else sent
            sent_now += self._step_bytes
            self.rounds += bool(self._step_bytes)
            self.fp32_ring_total += fp32
            self.last_ratio = fp32 / self._step_bytes if self._step_bytes else 1.0
        self.bytes_total += sent_now
        per_step = fp32 if self._step_bytes is None else self._step_bytes
        pl_module.log_dict({"comm/bytes_step": float(sent_now), "comm/bytes_total": float(self.bytes_total),
                            "comm/rounds": float(self.rounds),
                            "comm/bits_per_param": 8.0 * per_step / numel if numel else 0.0},
                           on_step=True, on_epoch=False, rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:  # a resumed run goes on counting from the checkpoint
        return {"bytes_total": self.bytes_total, "fp32_ring_total": self.fp32_ring_total,
                "last_ratio": self.last_ratio, "last_step": self._last_step, "step_bytes": self._step_bytes,
                "rounds": self.rounds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.bytes_total, self.fp32_ring_total = state_dict["bytes_total"], state_dict["fp32_ring_total"]
        self.last_ratio, self._last_step = state_dict["last_ratio"], state_dict["last_step"]
        self.rounds = state_dict.get("rounds", 0)
        self._step_bytes = state_dict["step_bytes"]


def _param_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class RankRecord(L.Callback):
    """At the end of fitting, every rank's figures (steps, bytes sent, phase switch, a digest of
    its parameters, final metrics) are gathered over the process group and global rank 0
    writes them to ``path`` as JSON.

    Spawned ranks return none of their state to the launching process, and with torchrun the
    ranks of other nodes are not even on this machine; the collective reaches both. The
    summary uses the file to check that every rank ran and that the replicas are identical.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.switch_step: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # every rank of every recipe fit, the DDP baselines included (gloo: see the function)
        destroy_process_group_at_exit()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        opt = find_compressed_optimizer(trainer)
        if self.switch_step is None and opt is not None and opt.compressing:
            self.switch_step = trainer.global_step  # 1-based index of the first compressed step

    def state_dict(self) -> dict[str, Any]:
        return {"switch_step": self.switch_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.switch_step = state_dict["switch_step"]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = find_compressed_optimizer(trainer)
        if opt is not None:
            sent, fp32 = opt.comm_counter.total.bytes_sent, opt.comm_counter.total.fp32_ring_bytes
            last_ratio, rounds = opt.comm_counter.last.ratio_vs_fp32, opt.comm_counter.rounds
        else:
            counter = next((c for c in trainer.callbacks if isinstance(c, DDPCommCounter)), None)
            sent = counter.bytes_total if counter else 0
            fp32 = counter.fp32_ring_total if counter else 0
            last_ratio = counter.last_ratio if counter else 1.0
            rounds = counter.rounds if counter else 0
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if isinstance(v, torch.Tensor) and v.numel() == 1 and math.isfinite(float(v))}
        record = {"global_rank": trainer.global_rank, "world_size": trainer.world_size,
                  "global_step": trainer.global_step, "bytes_sent": sent, "fp32_ring_bytes": fp32,
                  "last_step_ratio_vs_fp32": last_ratio, "rounds": rounds, "switch_step": self.switch_step,
                  "param_digest": _param_digest(pl_module), "metrics": metrics,
                  "status": getattr(pl_module, "status", "ok")}
        records = gather_objects(record)
        if trainer.global_rank == 0:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps(records, indent=1))


class RunIdentity(L.Callback):
    """Stamps checkpoints with the experiment and algorithm that wrote them; resuming one with
    another fails before any state is loaded, on every rank (they all read the same file), saying
    which run wrote it."""

    KEY = "lightning_onebit_recipe"

    def __init__(self, experiment: str, algorithm: str) -> None:
        self.identity = {"experiment": experiment, "algorithm": algorithm}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[self.KEY] = dict(self.identity)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        saved = checkpoint.get(self.KEY)
        if saved is not None and saved != self.identity:
            raise ValueError(
                f"checkpoint {trainer.ckpt_path} was written by experiment={saved['experiment']} "
                f"algorithm={saved['algorithm']}; this run is experiment={self.identity['experiment']} "
                f"algorithm={self.identity['algorithm']}. Resume with the same experiment and algorithm, "
                "or start without ckpt_path.")


class RNGStates(L.Callback):
    """Saves every rank's random number generators (python, numpy, torch, CUDA) with the checkpoint and
    restores this rank's on resume; Lightning saves none. Dropout and data augmentation (whose loader
    workers are seeded from torch's generator) then draw what the uninterrupted run drew.

    A resumed fit also gets its first training iterator made again at ``on_train_start``: Lightning
    makes it before it gives the samplers the epoch, and with DataLoader workers the indices are
    fetched at once, in epoch 0's order. The iterator is made again with the samplers at the resumed
    epoch and the generators back at the checkpoint's state (making it draws the workers' seeds).

    Each rank's state is a few kB; they are gathered when saving (every rank builds the checkpoint,
    rank 0 writes it). A resume on another world size keeps the generators as seeded, with a warning.
    """

    KEY = "rng_states_per_rank"

    def __init__(self) -> None:
        self._restored: dict | None = None  # this rank's state from the checkpoint, until training starts

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        np_state = np.random.get_state(legacy=False)  # tensors and ints only: checkpoints load with weights_only
        np_state["state"]["key"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
        state = {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        states = gather_objects(state)
        checkpoint[self.KEY] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(self.KEY)
        if states is None:
            return
        if len(states) != trainer.world_size:
            warnings.warn(f"checkpoint holds the random generators of {len(states)} ranks, this run has "
                          f"{trainer.world_size}: they stay as seeded, so random draws differ from the saved run",
                          stacklevel=2)
            return
        self._restored = states[trainer.global_rank]
        self._apply(self._restored)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state, self._restored = self._restored, None
        fit_loop = trainer.fit_loop
        fetcher, loader = getattr(fit_loop, "_data_fetcher", None), getattr(fit_loop, "_combined_loader", None)
        if state is None or fetcher is None or loader is None:
            return
        for dl in loader.flattened:
            _set_sampler_epoch(dl, fit_loop.epoch_progress.current.processed)
        self._apply(state)
        iter(fetcher)  # the epoch's iterator again: this epoch's order, the checkpoint's worker seeds

    @staticmethod
    def _apply(state: dict) -> None:
        random.setstate(state["python"])
        np_state = dict(state["numpy"], state=dict(state["numpy"]["state"]))
        np_state["state"]["key"] = np_state["state"]["key"].numpy().astype(np.uint32)
        np.random.set_state(np_state)
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class TorchThreads(L.Callback):
    """Sets torch's intra-op threads in every rank, after Lightning's launcher has set its own
    (cores / ranks, unless OMP_NUM_THREADS is set) and whatever started the ranks (spawn, popen,
    torchrun). MKL's GEMM splits its sums by thread count, so the bits of a fit depend on it."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"trainer.threads_per_rank must be >= 1 or null, got {threads}")
        self.threads = threads

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(self.threads)


class ReplicaSyncOrStop(ReplicaSync):
    """:class:`~lightning_onebit.ReplicaSync` for the recipes: a divergence found at a synchronisation
    outside a step (before validation, at the end) is a result, as in steps (``StopOnDivergence``)."""

    def _sync(self, trainer: L.Trainer) -> None:
        try:
            super()._sync(trainer)
        except NonFiniteGradientError as exc:
            diverged = getattr(trainer.lightning_module, "_diverged", None)
            if diverged is None:
                raise
            diverged(exc)

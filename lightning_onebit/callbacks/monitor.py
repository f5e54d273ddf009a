"""Communication monitor: bytes on the wire per step, in total, and against fp32 DDP."""

from __future__ import annotations

from functools import reduce
from operator import add

from lightning.pytorch import Callback

from ..comm import StepStats
from ..optim import CompressedOptimizer, DiLoCo, ShardedCompressed
from ..optim.state_size import state_bytes
from .phase import no_package_optimizer

__all__ = ["CommunicationMonitor"]


class CommunicationMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps, to Lightning's loggers:

    ``comm/bytes_step`` (bytes this rank sent in the last optimizer step), ``comm/bytes_total``,
    ``comm/bits_per_param`` (of the last step), ``comm/rounds`` (steps and synchronisations that sent
    anything so far: every step for most algorithms, fewer with 0/1 Adam's local steps),
    ``comm/ratio_vs_fp32`` (fp32 ring-allreduce bytes
    of the same tensors / bytes sent: ~1 in warm-up, ~32 with 1-bit, ~4 with 8-bit) and
    ``comm/compressing`` (0/1). ``ratio_vs_fp32`` and ``compressing`` also go to the progress bar.
    With the two-level collective the compressed bytes are those between nodes, and
    ``comm/intra_node_bytes_step`` adds the fp32 bytes inside the node. With several optimizers
    the figures are their sums (``comm/compressing``: all of them compress). DiLoCo's figures are its outer
    all-reduces' (``compressing`` is always 1); of a sharded model (the ``*_fsdp`` strategies), the package's
    mean between nodes, and ``comm/intra_node_bytes_step`` FSDP's own all-gathers and reduce-scatters inside
    the node, as this rank sends them. ``mem/optimizer_state_bytes``:
    what the optimizers keep on this rank between steps beyond the parameters and gradients
    (:func:`~lightning_onebit.optim.state_size.state_bytes`: moments, buckets, error state, DiLoCo's outer
    state; of a sharded model this rank's shards), counted again every ``log_every_n_steps`` steps and at
    the switch.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar
        self._state: tuple[tuple, float] | None = None  # (when it was counted, the state's bytes)

    def _state_bytes(self, trainer, opts) -> float:
        """The optimizers' state bytes, counted again every ``log_every_n_steps`` steps and when an optimizer
        switches phase (a walk over the state, which grows when buckets are built and at the switch)."""
        when = (trainer.global_step // max(1, trainer.log_every_n_steps), tuple(o.compressing for o in opts))
        if self._state is None or self._state[0] != when:
            self._state = (when, float(sum(state_bytes(o) for o in opts)))
        return self._state[1]

    def on_train_start(self, trainer, pl_module) -> None:
        _monitored(trainer, type(self).__name__)  # fail before the first step, not after it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opts = _monitored(trainer, type(self).__name__)
        last: StepStats = reduce(add, (o.comm_counter.last for o in opts))
        total: StepStats = reduce(add, (o.comm_counter.total for o in opts))
        metrics = {
            "comm/bytes_step": float(last.bytes_sent),
            "comm/bytes_total": float(total.bytes_sent),
            "comm/bits_per_param": last.bits_per_param,
            "comm/rounds": float(sum(o.comm_counter.rounds for o in opts)),
        }
        if any(o.intra_node_counter.total.bytes_sent for o in opts):
            metrics["comm/intra_node_bytes_step"] = float(sum(o.intra_node_counter.last.bytes_sent for o in opts))
        metrics["mem/optimizer_state_bytes"] = self._state_bytes(trainer, opts)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log_dict({"comm/ratio_vs_fp32": last.ratio_vs_fp32,
                            "comm/compressing": float(all(o.compressing for o in opts))},
                           on_step=True, on_epoch=False, prog_bar=self.prog_bar, rank_zero_only=True)


def _monitored(trainer, who: str) -> list:
    """The trainer's optimizers that count their bytes: the compressed ones (of ``ShardedCompressed``, the
    one on the shards) and DiLoCo; a ValueError naming what runs instead when there is none."""
    out = []
    for opt in (getattr(o, "_optimizer", o) for o in trainer.optimizers):
        if isinstance(opt, ShardedCompressed):
            out.append(opt.inner)
        elif isinstance(opt, CompressedOptimizer | DiLoCo):
            out.append(opt)
    if out:
        return out
    raise no_package_optimizer(trainer, who)

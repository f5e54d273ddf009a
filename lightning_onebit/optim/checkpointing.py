"""Checkpoints of a compressed optimizer: ``state_dict``, ``load_state_dict``, the per-rank error
state and the settings every rank must share."""

from __future__ import annotations

import warnings

import torch

__all__ = ["OptimizerCheckpoint"]


class OptimizerCheckpoint:
    """Mixin of :class:`~lightning_onebit.optim.CompressedOptimizer` (placed right before
    ``torch.optim.Optimizer`` in its bases): the ``onebit`` section of the state dict (step, phases,
    bucket layout, byte counters, the collectives' state) and its loading. Uses the optimizer's
    buckets (each with its :class:`~.sync.BucketSync`) and phase attributes."""

    def state_dict(self) -> dict:
        self.settle_device_skips()  # step counts exact: a step the device skipped is taken back first
        self._flush_pending()  # a synchronised momentum left for the update is state too
        sd = super().state_dict()
        buckets = self._buckets
        sd["onebit"] = {
            "algorithm": type(self).__name__,
            "step": self._step,
            "compressing": self._compressing,
            "switch_at": self._switch_at,
            "layout": [b.ids for b in buckets],
            "phases": [{"compressing": b.compressing, "switch_step": b.switch_step} for b in buckets],
            "comm": self.error_state_dict(),
            "bytes": self.comm_counter.state_dict(),
            "extra": self._extra_state(),
            "skipped_steps": self.skipped_steps,
        }
        return sd

    def settings(self) -> dict[str, str]:
        """What every data-parallel rank must share, as text: algorithm, codec and mode, phases,
        bucketing, layout, the hyperparameters of each param group and the parameter shapes. The
        strategies compare it across ranks at setup, so a mismatch fails there on every rank."""
        out = {"algorithm": type(self).__name__, "wire": str(self.wire),
               "comm_mode": str(self.comm_mode),
               "warmup_steps": repr(self.warmup_steps), "warmup_comm_dtype": str(self.warmup_comm_dtype),
               "bucket_cap_mb": repr(self.bucket_cap_mb),
               "hierarchical": repr(self.hierarchical), "ranks_per_node": repr(self.ranks_per_node),
               "param groups": str(len(self.param_groups))}
        for i, g in enumerate(self.param_groups):
            for k, v in g.items():
                if k != "params":
                    out[f"param group {i}: {k}"] = repr(v)
            out[f"param group {i}: shapes"] = repr([tuple(p.shape) for p in g["params"]])
        return out

    def error_state_dict(self) -> list[dict | None]:
        """This rank's compression state per bucket (error feedback, Markov reference; ``None`` for a
        bucket without a collective yet): the part of :meth:`state_dict` that differs between ranks,
        as large as the model in fp32. Checkpoints keep it per rank (see the strategies)."""
        return [None if b.sync.comm is None else b.sync.comm.state_dict() for b in self._buckets]

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`. Unlike ``torch.optim.Optimizer`` the per-parameter state keeps
        its dtype (fp32, also for fp16/bf16 parameters, whose dtype would round the moments) and
        goes to the parameter's device, as does the compression state."""
        sd = dict(state_dict)
        self._device_steps = []  # a verdict of steps before the load says nothing about the loaded state
        extra = sd.pop("onebit", None)
        if extra is None:
            raise ValueError(f"{type(self).__name__}: this state_dict was not written by a lightning_onebit "
                             "optimizer (no 'onebit' section)")
        if extra["algorithm"] != type(self).__name__:
            raise ValueError(f"state_dict was written by {extra['algorithm']}, cannot load it into "
                             f"{type(self).__name__}")
        saved_state = sd.get("state", {})
        super().load_state_dict({**sd, "state": {}})  # groups and hyperparameters, no casting
        saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
        self.state.clear()
        for sid, p in zip(saved_ids, self.params_in_order(), strict=True):
            if sid in saved_state:
                self.state[p] = {k: v.to(device=p.device) if torch.is_tensor(v) else v
                                 for k, v in saved_state[sid].items()}
        self._step = extra["step"]
        self._compressing = extra["compressing"]
        self._switch_at = extra.get("switch_at")
        self.comm_counter.load_state_dict(extra["bytes"])
        self.skipped_steps = extra.get("skipped_steps", 0)
        self._load_extra_state(extra["extra"])
        self._buckets, self._nbucketed, self._param_bucket = [], 0, {}
        compressing = self._compressing
        self._compressing = False  # buckets are rebuilt in warm-up and get their saved phase below
        buckets = self._build_buckets()  # re-adopts the loaded per-parameter state into flat buffers
        self._compressing = compressing
        same = [b.ids for b in buckets] == extra["layout"]
        phases = extra.get("phases") or [{"compressing": compressing, "switch_step": None}] * len(buckets)
        for i, b in enumerate(buckets):
            ph = phases[i] if same else {"compressing": compressing, "switch_step": None}
            b.compressing, b.switch_step = ph["compressing"], ph["switch_step"]
        if not same and any(c is not None for c in extra["comm"]):
            warnings.warn(f"{type(self).__name__}: bucket layout differs from the checkpoint's "
                          "(different bucket_cap_mb or parameters); compression error state was reset",
                          stacklevel=2)
            return
        for b, csd in zip(buckets, extra["comm"], strict=False):
            if csd is None:
                continue
            comm = b.sync.collective()
            saved, now = _collective_layout(csd), _collective_layout(comm.state_dict())
            if saved != now:  # per-rank state of another layout does not carry over
                warnings.warn(f"{type(self).__name__}: the checkpoint's collectives ran {saved}, this run's {now}; "
                              "moments and phase are kept, the compression error state was reset", stacklevel=2)
                continue
            comm.load_state_dict(csd, device=b.device)


def _collective_layout(sd: dict) -> str:
    """How a collective's state is cut across ranks, from its state_dict."""
    if sd.get("hierarchical"):
        return f"two-level on {sd['nodes']} nodes x {sd['ranks_per_node']} ranks"
    return f"flat on {sd['world_size']} ranks"

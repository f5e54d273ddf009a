"""The methods the emulated-cluster benchmarks run: each a recipes algorithm entry plus the settings it changes.

A row is ``name -> Method(entry, overrides)``: ``entry`` names ``conf/algorithm/<entry>.yaml``, and
``overrides`` update it as ``algorithm.<key>=...`` would on the recipes' command line
(:func:`recipes.algorithms.load_algorithm`). ``recipes/algorithms.py`` then builds the optimizer
(``build_optimizer``: every setting of the optimizer, ``fused``, ``warmup_comm_dtype``, DiLoCo's
``sync_every`` ...) and the strategy (``build_strategy``: only its own settings, the warm-up's end,
``hierarchical``, ``on_nonfinite``, and none of the optimizer's, which it keeps as built), so each setting
is given in one place and a benchmark runs what ``python recipes/train.py algorithm=<entry>`` runs.

Every method shares the AdamW hyperparameters of :func:`algorithm`: the run's learning rate, weight decay
0.01, torch's betas and eps. Override values may interpolate the run's settings as the entries do:
``${optim.warmup}`` (the warm-up steps) and ``${run.<key>}`` (``run`` of :func:`algorithm`, e.g. the
overlap of time_to_accuracy.py's overlapped DiLoCo). The names are what the results tables print.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from _common import repo_on_path

repo_on_path()

__all__ = ["E2E_DILOCO_H", "E2E_HOOKS", "E2E_LABEL", "E2E_METHODS", "E2E_TWO_LEVEL", "TTA_DILOCO_H",
           "TTA_LIGHT", "TTA_METHODS", "TTA_OURS", "TTA_PEERS", "Method", "algorithm", "strategy"]

WEIGHT_DECAY = 0.01


class Method(NamedTuple):
    """A benchmark method: the algorithm entry it runs and what it changes of it."""

    entry: str
    overrides: Mapping[str, Any] = {}


# what a user's LightningModule returns, AdamW(fused=True): its fused kernel wherever the optimizer has one
# (AdamW, 1-bit Adam's and QAdam's warm-up, DiLoCo's inner steps)
FUSED = {"fused": True}
# CompressedDDPStrategy's default, what a user gets (the recipes' entries stop at a non-finite gradient):
# a skipped step is agreed in step(), so the compressed sync runs there rather than in the backward hook
SKIP = {"on_nonfinite": "skip"}
FLAT = {**SKIP, "hierarchical": False}
TWO_LEVEL = {**SKIP, "hierarchical": True}
# the compressed sync in DDP's backward hook, bucket by bucket as the gradients are ready (the policy "raise":
# nothing to agree before the first bucket's state changes): what the skip policy's sync in step() costs
IN_HOOK = {"on_nonfinite": "raise", "hierarchical": False}

# -- e2e.py --------------------------------------------------------------------------------------------------

E2E_DILOCO_H = 8
"""DiLoCo's ``sync_every`` in e2e.py (its phase-2 figures are means over whole intervals of this many steps)."""
E2E_DILOCO = {**FUSED, "sync_every": E2E_DILOCO_H}
# 0/1 Adam's phase A (refreshes and 1-bit steps) for the warm-up's steps, kappa 2, then local intervals 1, 2
# and from then on 4 (H): its phase 2 is the steady state of 3 local steps and 1 synchronisation
E2E_ZERO_ONE = {"var_freeze_step": "${optim.warmup}", "var_update_scaler": 2, "local_step_scaler": 1,
                "local_step_clipper": 4}

E2E_METHODS: dict[str, Method] = {
    "ddp_adamw": Method("adam", FUSED),
    "ddp_fp16": Method("ddp_fp16", FUSED),
    "ddp_bf16": Method("ddp_bf16", FUSED),
    "powersgd_r1": Method("powersgd_r1", FUSED),  # after the warm-up's steps of fp32 all-reduce
    "powersgd_r4": Method("powersgd_r4", FUSED),
    "onebit_adam": Method("onebit_adam", {**FUSED, **FLAT}),
    "onebit_lamb": Method("onebit_lamb", FLAT),
    "qadam": Method("qadam", {**FUSED, **FLAT}),
    "cd_adam": Method("cd_adam", FLAT),
    "zero_one_adam": Method("zero_one_adam", {**E2E_ZERO_ONE, **FLAT}),
    "onebit_adam_hier": Method("onebit_adam", {**FUSED, **TWO_LEVEL}),
    "onebit_adam_hook": Method("onebit_adam", {**FUSED, **IN_HOOK}),
    "onebit_lamb_hier": Method("onebit_lamb", TWO_LEVEL),
    "qadam_hier": Method("qadam", {**FUSED, **TWO_LEVEL}),
    "cd_adam_hier": Method("cd_adam", TWO_LEVEL),
    "diloco": Method("diloco", E2E_DILOCO),
    "diloco_4bit": Method("diloco", {**E2E_DILOCO, "compression": "4bit"}),
    "diloco_1bit": Method("diloco", {**E2E_DILOCO, "compression": "1bit"}),
}
E2E_HOOKS = ("ddp_fp16", "ddp_bf16", "powersgd_r1", "powersgd_r4")
E2E_TWO_LEVEL = {"onebit_adam_hier": "onebit_adam", "onebit_lamb_hier": "onebit_lamb", "qadam_hier": "qadam",
                 "cd_adam_hier": "cd_adam"}
"""The two-level methods (``hierarchical=True``) and the flat method (``hierarchical=False``) each is compared with."""
E2E_LABEL = {
    "ddp_adamw": "DDP + fused AdamW (fp32)",
    "ddp_fp16": "DDP + fp16 hook",
    "ddp_bf16": "DDP + bf16 hook",
    "powersgd_r1": "DDP + PowerSGD r1",
    "powersgd_r4": "DDP + PowerSGD r4",
    "onebit_adam": "onebit_adam",
    "onebit_lamb": "onebit_lamb",
    "qadam": "qadam",
    "cd_adam": "cd_adam",
    "zero_one_adam": "zero_one_adam (mean over intervals)",
    **{hier: f"{flat} two-level" for hier, flat in E2E_TWO_LEVEL.items()},
    "onebit_adam_hook": "onebit_adam, sync in DDP's hook",
    "diloco": f"diloco H={E2E_DILOCO_H}, fp32 (mean over intervals)",
    "diloco_4bit": f"diloco H={E2E_DILOCO_H}, 4-bit (mean over intervals)",
    "diloco_1bit": f"diloco H={E2E_DILOCO_H}, 1-bit (mean over intervals)",
}

# -- time_to_accuracy.py -------------------------------------------------------------------------------------

TTA_DILOCO_H = 16
TTA_DILOCO = {**FUSED, "sync_every": TTA_DILOCO_H}  # the paper's H, outer lr 0.7 and Nesterov momentum 0.9
# each outer step runs while the replicas take --overlap more inner steps, then lands and each replica moves
# onto it with those steps (keep_local, the package's merge) ...
OVERLAP = {"overlap": "${run.overlap}", "keep_local": True}
# ... or is mixed half and half with the replica (Streaming DiLoCo's merge, alpha = 0.5, one fragment)
STREAMING = {"overlap": "${run.overlap}", "mixing": 0.5}
# variance frozen after the warm-up's steps; DeepSpeed's local-step defaults (the optimizer's), which take no
# local steps within a few hundred steps
TTA_ZERO_ONE = {**SKIP, "var_freeze_step": "${optim.warmup}", "local_step_scaler": 32678, "local_step_clipper": 16}
TTA_ONEBIT = {**FUSED, **SKIP}

TTA_METHODS: dict[str, Method] = {
    "ddp_adamw": Method("adam", FUSED),
    "ddp_bf16": Method("ddp_bf16", FUSED),
    "powersgd_r4": Method("powersgd_r4", FUSED),  # after the warm-up's steps of fp32 all-reduce
    # PyTorch's post_localSGD_hook, a PeriodicModelAverager of that period after the warm-up's global steps
    "postlocal_8": Method("adam", {**FUSED, "comm_hook": "post_local_sgd", "post_local_period": 8,
                                   "post_local_start_iter": "${optim.warmup}"}),
    "postlocal_32": Method("adam", {**FUSED, "comm_hook": "post_local_sgd", "post_local_period": 32,
                                    "post_local_start_iter": "${optim.warmup}"}),
    "diloco": Method("diloco", TTA_DILOCO),
    "diloco_streaming": Method("diloco", {**TTA_DILOCO, **STREAMING}),
    "diloco_overlap": Method("diloco", {**TTA_DILOCO, **OVERLAP}),
    "diloco_4bit": Method("diloco", {**TTA_DILOCO, "compression": "4bit"}),
    "diloco_4bit_overlap": Method("diloco", {**TTA_DILOCO, "compression": "4bit", **OVERLAP}),
    "onebit_adam": Method("onebit_adam", TTA_ONEBIT),
    "zero_one_adam": Method("zero_one_adam", TTA_ZERO_ONE),
    "qadam": Method("qadam", TTA_ONEBIT),
    # the full-precision phase (the warm-up, 0/1 Adam's variance refreshes) sent in bf16, or as 8-bit codes
    "onebit_adam_bf16warm": Method("onebit_adam", {**TTA_ONEBIT, "warmup_comm_dtype": "bf16"}),
    "zero_one_adam_bf16warm": Method("zero_one_adam", {**TTA_ZERO_ONE, "warmup_comm_dtype": "bf16"}),
    "onebit_adam_u8warm": Method("onebit_adam", {**TTA_ONEBIT, "warmup_comm_dtype": "uint8"}),
    "zero_one_adam_u8warm": Method("zero_one_adam", {**TTA_ZERO_ONE, "warmup_comm_dtype": "uint8"}),
}
TTA_PEERS = ("ddp_adamw", "ddp_bf16", "powersgd_r4", "postlocal_8", "postlocal_32", "diloco", "diloco_streaming")
"""What a user could run instead of the package (DiLoCo fp32 is the paper's own algorithm; Streaming DiLoCo's
overlap and mixing is its published way to hide the outer all-reduce)."""
TTA_OURS = tuple(m for m in TTA_METHODS if m not in TTA_PEERS)
TTA_LIGHT = {"diloco_streaming": "diloco", "diloco_overlap": "diloco", "diloco_4bit_overlap": "diloco_4bit",
             "onebit_adam_bf16warm": "onebit_adam", "zero_one_adam_bf16warm": "zero_one_adam",
             "onebit_adam_u8warm": "onebit_adam", "zero_one_adam_u8warm": "zero_one_adam"}
"""Variants drawn in the light shade of another method's hue."""


def algorithm(table: Mapping[str, Method], method: str, *, lr: float, warmup: int,
              run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The resolved algorithm entry of ``method`` in ``table`` (``E2E_METHODS``, ``TTA_METHODS``): learning rate
    ``lr``, ``warmup`` steps of warm-up (``optim.warmup``, which the entries and rows read), ``run`` the values
    rows read as ``${run.<key>}``."""
    from recipes.algorithms import load_algorithm

    row = table[method]
    return load_algorithm(row.entry, {"lr": lr, "weight_decay": WEIGHT_DECAY, "warmup": warmup}, row.overrides,
                          run=dict(run or {}))


def strategy(alg: Mapping[str, Any]) -> Any:
    """The Lightning strategy of a resolved entry on a benchmark's torchrun worker: the ranks and the process
    group exist already (so Lightning's popen launcher starts none), and every DDP takes gradients as views of
    its buckets (the compressed strategies' default), so no baseline pays the bucket -> .grad copy the others
    skip."""
    from recipes.algorithms import build_strategy

    return build_strategy(alg, start_method="popen", gradient_as_bucket_view=True)

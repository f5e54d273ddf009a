"""Entry point of the recipes (Hydra). Run from the repository root:

    python recipes/train.py                         # offline quickstart: digits, 2 CPU processes,
                                                    # 1-bit Adam vs uncompressed DDP + AdamW
    python recipes/train.py experiment=logreg_nonconvex algorithm=cd_adam
    python recipes/train.py experiment=quadratic_divergence algorithm.eps_inside_sqrt=false
    python recipes/train.py -m experiment=logreg_nonconvex algorithm=adam,cd_adam,ef_amsgrad,naive_amsgrad

Config groups (``conf/``): ``experiment`` (task, model, data and the paper's hyperparameters),
``algorithm`` (strategy + optimizer together), ``trainer`` (``cpu``, ``gpu``, ``multinode``).
A run writes into Hydra's run directory (``outputs/<experiment>/<algorithm>/<time>``):
``.hydra/`` and ``resolved_config.yaml`` (the config), ``metrics/<algorithm>/metrics.csv``
(Lightning CSVLogger), ``summary.json`` and ``curves.png`` (metrics against steps and bits).
A multirun adds ``comparison.md`` and ``comparison.png`` to its sweep directory.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

# `python recipes/train.py` puts recipes/ on sys.path, not the repository root; spawned DDP
# ranks re-import this file and inherit sys.path, so they find the `recipes` package too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _pin_cpu_kernels() -> None:
    """ATen picks its CPU kernels by instruction set at import (AVX2, AVX-512, ...), and they give
    different bits, from the initial weights on. Pin AVX2 where the CPU has it, before torch is
    imported (ranks inherit it); MKL_CBWR does the same for MKL's GEMM on Intel CPUs. Set either
    variable yourself to choose otherwise."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    if " avx2" in flags:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("MKL_CBWR", "AVX2")


_pin_cpu_kernels()

from recipes.runners import run  # noqa: E402


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    hc = HydraConfig.get()
    return run(cfg, hc.runtime.output_dir, multirun=hc.mode == RunMode.MULTIRUN, overrides=list(hc.overrides.task))


if __name__ == "__main__":
    main()

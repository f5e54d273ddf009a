"""What both emulated-cluster benchmarks do around a training run: a torchrun worker's setup, its Lightning
trainer and method, the gathering of every rank's recording, and the compute-alone processes on the nodes.

A worker runs inside its node's network namespace (``netns_cluster.py``), one thread per process, with the
gloo group joined before Lightning starts (the strategies find it and keep it).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from _common import init_gloo_worker, parse_tagged
from netns_cluster import EmulatedCluster, node_env

__all__ = ["fit_method", "gather", "local_world", "run_alone", "start_worker", "trainer"]


def local_world() -> int:
    """The ranks of this worker's node (torchrun's ``--nproc_per_node``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def quiet(ignore: Sequence[str] | None = None) -> None:
    """Lightning's and the package's info logs off, and the warnings that match ``ignore`` (None: all)."""
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_onebit"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if ignore is None:
        warnings.filterwarnings("ignore")
    for pattern in ignore or ():
        warnings.filterwarnings("ignore", pattern)


def start_worker(pg_timeout: float, ignore: Sequence[str] | None = None) -> tuple[int, int, str]:
    """A torchrun worker of the emulated cluster, quiet (``ignore``: see :func:`quiet`), in the gloo group:
    (rank, world size, the node's interface)."""
    quiet(ignore)
    rank, world = init_gloo_worker(pg_timeout)
    return rank, world, os.environ["GLOO_SOCKET_IFNAME"]


def trainer(strategy: Any, steps: int, callbacks: list[Any], devices: int = 1, num_nodes: int = 1,
            **kwargs: Any) -> Any:
    """A CPU Trainer for one epoch of exactly ``steps`` steps: no logger, checkpoints, progress bar, summary or
    sanity check, and no distributed sampler (every rank's loader holds its own data); ``kwargs``: further
    Trainer arguments (validation)."""
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_steps=steps,
                     max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                     callbacks=callbacks, **kwargs)


def fit_method(alg: dict[str, Any], module: Any, steps: int, callbacks: list[Any], world: int, train: Any,
               val: Any = None, **kwargs: Any) -> tuple[Any, float]:
    """Fit ``module`` on the ``train`` (and ``val``) loaders with the strategy of the resolved entry ``alg``, on
    every rank of the torchrun job (``kwargs``: further Trainer arguments); returns the trainer and the seconds
    its fit took."""
    from methods import strategy

    local = local_world()
    t = trainer(strategy(alg), steps, callbacks, devices=local, num_nodes=world // local, **kwargs)
    t0 = time.perf_counter()
    t.fit(module, train_dataloaders=train, val_dataloaders=val)
    return t, time.perf_counter() - t0


def gather(mine: Any, world: int) -> list[Any]:
    """Every rank's ``mine``, in rank order, on every rank."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def run_alone(cluster: EmulatedCluster, argv: Sequence[str], ranks_per_node: int, tag: str,
              timeout: float) -> list[dict[str, Any]]:
    """``ranks_per_node`` processes of ``argv`` in every node at once (no torchrun, no communication: compute
    alone, with the machine's cores shared as the ranks share them), killed after ``timeout`` s; the rows they
    printed with ``tag``, or SystemExit naming a node whose process failed."""
    procs, files, nodes = [], [], []
    try:
        for k in range(cluster.nodes):
            for _ in range(ranks_per_node):
                out = tempfile.TemporaryFile()
                files.append(out)
                nodes.append(k)
                procs.append(cluster.popen(k, argv, node_env(cluster, k), stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if any(p.poll() is None for p in procs):
            cluster.kill_processes()
    rows = []
    for k, p, f in zip(nodes, procs, files, strict=True):
        f.seek(0)
        text = f.read().decode(errors="replace")
        f.close()
        got = parse_tagged(text, tag)
        if p.returncode != 0 or not got:
            raise SystemExit(f"compute-alone run failed on node {k} (rc={p.returncode}):\n{text[-4000:]}")
        rows.extend(got)
    return rows

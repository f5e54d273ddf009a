"""Lightning on 2 nodes x 2 ranks the way a cluster starts it: one torchrun per node.

Both torchruns run on this host (the nodes meet at 127.0.0.1); Lightning sees torchrun's environment,
``num_nodes=2`` and ``devices=2``, and the strategy chooses the two-level collective by itself.
"""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from proc_utils import started

HERE = Path(__file__).parent
NODES, RANKS = 2, 2


def _launch(out: Path, *args: str, timeout: float = 400.0) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    logs = [out / f"node{node}.log" for node in range(NODES)]
    with contextlib.ExitStack() as jobs:  # leaving it kills whatever is left of either torchrun
        procs = []
        for node in range(NODES):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={RANKS}",
                   f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                   str(HERE / "multinode_fit.py"), "--out", str(out), "--nodes", str(NODES), *args]
            procs.append(jobs.enter_context(started(cmd, logs[node], env=env)))
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, f"exit code {code} (None: hung)\n" + log.read_text()[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(NODES * RANKS)]


@pytest.mark.slow
@pytest.mark.budget(90)  # two torchruns of 2 ranks, twice
def test_two_torchruns_fit_on_two_levels_and_resume_flat(tmp_path):
    """Automatic choice on 2 nodes x 2 ranks: every bucket two-level, replicas identical, the loss falls,
    fp32 bytes inside the nodes; the checkpoint resumes flat (hierarchical=False) with the moments and
    phase kept and the error state reset, and the four replicas stay identical."""
    first = _launch(tmp_path, "--steps", "30")
    assert [r["node_rank"] for r in first] == [0, 0, 1, 1] and {r["world"] for r in first} == {4}
    for r in first:
        assert r["kinds"] == ["HierarchicalAllreduce"] and r["compressing"]
        assert torch.equal(r["params"], first[0]["params"])
        assert r["intra_bytes"] > 0 and r["inter_bytes"] > 0
        losses = r["losses"]
        assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses

    resumed = _launch(tmp_path, "--steps", "40", "--hierarchical", "false", "--resume", str(tmp_path / "last.ckpt"))
    for r in resumed:
        assert r["kinds"] == ["CompressedAllreduce"] and r["compressing"]  # the phase came back
        assert len(r["losses"]) == 10  # steps 30..39
        assert torch.equal(r["params"], resumed[0]["params"])
        assert r["intra_bytes"] == 0
        assert any("error state was reset" in w for w in r["warnings"]), r["warnings"]
    assert not torch.equal(resumed[0]["params"], first[0]["params"])

"""The examples, run as a user would: the README's three ways to use the package, and the codec demo."""

import os
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from proc_utils import run as proc_run

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script,args,expect", [
    # (the two Lightning examples run below, from a checkpoint on, in the test of their resume)
    ("plain_ddp.py", ["--steps", "40"], "compressing: True"),
    ("codec_demo.py", ["--numel", "4096", "--steps", "20"], "bytes per vector: fp32 16384, 1-bit"),
])
@pytest.mark.budget(40)  # a script run as users run it
def test_example_runs(tmp_path, script, args, expect):
    if script == "plain_ddp.py":
        args = [*args, "--port", str(free_port())]
    out = _run(script, args, tmp_path)
    assert expect in out, out[-3000:]


def _run(script, args, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    proc = proc_run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.budget(60)
@pytest.mark.parametrize("script,expect", [("strategy_string.py", "fewer than fp32 DDP"),
                                           ("strategy_object.py", "compressing: True")])
def test_lightning_examples_run_and_resume_from_their_last_checkpoint(tmp_path, script, expect):
    """The example runs and, with --ckpt-dir, a second run (what a torchrun --max-restarts restart is)
    goes on from last.ckpt and ends compressing."""
    first = _run(script, ["--epochs", "1", "--ckpt-dir", "ck"], tmp_path)
    assert "Restoring states" not in first and (tmp_path / "ck" / "last.ckpt").exists()
    second = _run(script, ["--epochs", "2", "--ckpt-dir", "ck"], tmp_path)
    assert f"Restoring states from the checkpoint path at {tmp_path / 'ck' / 'last.ckpt'}" in second, second[-3000:]
    assert expect in second, second[-3000:]


@pytest.mark.budget(150)  # two torchruns of 4 ranks on the CI's 2 cores (one restarted): their starts are most of it
def test_fsdp_diloco_example_under_torchrun_and_after_a_lost_rank(tmp_path):
    """The sharded example as users launch it: torchrun, 4 ranks as 2 nodes of 2, FSDP2 inside each node, 4-bit
    DiLoCo between them; every node ends on the same model, each rank holding half of its state. Then again with
    a file per rank every 4 steps, rank 1 lost after step 10 (node 1, which meets node 0 only at outer steps,
    goes on to save step 12) and torchrun restarting the job: it resumes from step 8, the newest step every rank
    saved, and ends on the same parameters, bit for bit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
               str(free_port()), *args[:-1], str(EXAMPLES / "fsdp_diloco.py"), "--ranks-per-node", "2", "--steps",
               "16", *args[-1]]
        proc = proc_run(cmd, cwd=tmp_path, env=env, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        return out

    whole = torchrun([])
    assert "2 nodes x 2 ranks; outer steps 2; DiLoCo state for 42757 of 85514 parameters" in whole, whole[-3000:]
    assert "nodes agree: True" in whole, whole[-3000:]
    restarted = torchrun("--max-restarts", "1", ["--ckpt-dir", "ck", "--save-every", "4", "--die-at", "10"])
    assert "resumed from step 8" in restarted, restarted[-3000:]
    # the nodes meet at outer steps only: when rank 1 is lost, node 1 may have saved step 12 already
    assert {p.name for p in (tmp_path / "ck").iterdir()} >= {f"rank{r}-step16.pt" for r in range(4)}
    final = [ln.split("; ", 1)[1] for ln in (whole + restarted).splitlines() if "parameter sum" in ln]
    assert len(final) == 2 and final[0] == final[1], final


@pytest.mark.budget(120)  # one torchrun of 4 Lightning ranks on the CI's 2 cores, restarted once
def test_lightning_sharded_example_restarts_after_a_lost_rank_from_its_checkpoint_directory(tmp_path):
    """strategy="diloco_fsdp" as users launch it: torchrun, 4 ranks as 2 nodes of 2, a checkpoint directory after
    every epoch; rank 1 lost in epoch 2, torchrun restarts the job, which goes on from the epoch-1 directory
    (the process group in the new attempt's keys) to the end of the fit. That a resume continues bit for bit is
    tests/test_sharded_lightning.py's to show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           "--max-restarts", "1", str(EXAMPLES / "lightning_sharded.py"), "--ranks-per-node", "2", "--ckpt-dir", "ck",
           "--die-at", "20"]
    proc = proc_run(cmd, cwd=tmp_path, env=dict(env, PYTHONWARNINGS="ignore"), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from epoch=0-step=15.ckpt" in out, out[-3000:]
    assert "2 nodes x 2 ranks; steps 45; state for 78101 of 156202 parameters" in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [f"epoch={e}-step={15 * (e + 1)}.ckpt"
                                                                  for e in range(3)]

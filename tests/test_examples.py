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


@pytest.mark.budget(60)  # torchrun and 4 ranks on the CI's 2 cores: their start is most of it
def test_fsdp_diloco_example_under_torchrun(tmp_path):
    """The sharded example as users launch it: torchrun, 4 ranks as 2 nodes of 2, FSDP2 inside each node,
    4-bit DiLoCo between them; every node ends on the same model, each rank holding half of its state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           str(EXAMPLES / "fsdp_diloco.py"), "--ranks-per-node", "2", "--steps", "16"]
    proc = proc_run(cmd, cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 nodes x 2 ranks; outer steps 2; DiLoCo state for 42757 of 85514 parameters" in out, out[-3000:]
    assert "nodes agree: True" in out, out[-3000:]

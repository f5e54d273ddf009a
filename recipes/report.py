"""Reports: per-run plots, the quickstart summary, and the multirun comparison.

Every run directory holds ``summary.json`` (written by ``recipes/train.py``) and, per
algorithm, a Lightning ``CSVLogger`` file ``metrics/<label>/metrics.csv``. This module only
reads those, so it works on finished runs as well:

    python -m recipes.report outputs/quickstart/onebit_adam/<time>     # redraw one run
    python -m recipes.report multirun/logreg_nonconvex/<time>          # redo a sweep's table

In a Hydra multirun, :class:`MultirunReport` (a Hydra callback, ``conf/config.yaml``) writes
``comparison.md`` and ``comparison.png`` into the sweep directory after the last job.
Plots are against optimizer steps and against bits sent per worker, as the papers plot them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .common import optional_import

__all__ = ["MultirunReport", "compare_bytes", "format_bytes", "plot_curves", "read_metrics", "runs_table",
           "write_comparison", "write_run_report"]

BYTES_KEY = "comm/bytes_total"


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def compare_bytes(baseline: float, sent: float) -> str:
    ratio = baseline / sent
    return f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"


def read_metrics(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """CSVLogger file -> {column: (steps, values)} over the rows where the column is set."""
    cols: dict[str, tuple[list[float], list[float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = float(row.get("step") or "nan")
            for k, v in row.items():
                if k in ("step", "epoch") or v in ("", None):
                    continue
                cols.setdefault(k, ([], []))
                cols[k][0].append(step)
                cols[k][1].append(float(v))
    return {k: (np.asarray(s), np.asarray(v)) for k, (s, v) in cols.items()}


def _bits_at(steps: np.ndarray, metrics: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray | None:
    """Bits sent per worker by each of ``steps``: the logged cumulative bytes, interpolated
    (metrics logged at other steps than the bytes, e.g. per-epoch validation, line up)."""
    if BYTES_KEY not in metrics:
        return None
    bs, bv = metrics[BYTES_KEY]
    order = np.argsort(bs, kind="stable")
    return 8.0 * np.interp(steps, np.concatenate([[0.0], bs[order]]), np.concatenate([[0.0], bv[order]]))


def _ylim(vals: np.ndarray, log: bool) -> tuple[float, float]:
    """y range of the curves that did not diverge, with a margin (a diverged curve's last
    values would squash them all into one line)."""
    vals = vals[np.isfinite(vals) & ((vals > 0) if log else True)]
    lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (1.0, 10.0)
    if log:
        return lo / 2, hi * 2
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
    return lo - pad, hi + pad


def plot_curves(curves: Sequence[tuple[str, Path] | tuple[str, Path, bool]], metrics: Sequence[str],
                logy: Sequence[str], out_png: Path, title: str = "") -> Path | None:
    """One row per metric; columns: against steps, and against bits sent per worker (when any
    curve communicated). ``curves`` are (label, metrics.csv[, diverged]) tuples; a diverged
    curve is dashed and does not stretch the y axis (its last values are huge). Returns None
    when no curve has any of the metrics."""
    optional_import("matplotlib").use("Agg")  # files only, no display
    plt = optional_import("matplotlib.pyplot")

    data = [(c[0] + (" (diverged)" if c[2:] and c[2] else ""), read_metrics(c[1]), bool(c[2:] and c[2]))
            for c in curves if Path(c[1]).exists()]
    metrics = [m for m in metrics if any(m in d for _, d, _ in data)]
    if not metrics:
        return None
    with_bits = any(BYTES_KEY in d and d[BYTES_KEY][1].max(initial=0) > 0 for _, d, _ in data)
    ncols = 2 if with_bits else 1
    fig, axes = plt.subplots(len(metrics), ncols, figsize=(6.0 * ncols, 3.6 * len(metrics)), squeeze=False)
    for r, m in enumerate(metrics):
        kept = [d[m][1] for _, d, diverged in data if m in d and not diverged]
        for i, (label, d, diverged) in enumerate(data):
            if m not in d:
                continue
            style = {"label": label, "color": f"C{i % 10}", "linestyle": "--" if diverged else "-"}
            steps, vals = d[m]
            axes[r][0].plot(steps, vals, **style)
            if with_bits:
                bits = _bits_at(steps, d)
                if bits is not None:  # log axis: from the first bit sent
                    axes[r][1].plot(bits[bits > 0], vals[bits > 0], **style)
        axes[r][0].set_xlabel("optimizer step")
        axes[r][0].set_ylabel(m)
        if with_bits:
            axes[r][1].set_xlabel("bits sent per worker")
            axes[r][1].set_xscale("log")
            axes[r][1].set_ylabel(m)
        for ax in axes[r]:
            if m in logy:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if kept and len(kept) < sum(m in d for _, d, _ in data):
                ax.set_ylim(*_ylim(np.concatenate(kept), m in logy))
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def runs_table(runs: Sequence[dict[str, Any]], primary: str | None, goal: str = "min",
               extra_cols: Sequence[str] = ()) -> str:
    """Markdown table: one row per run with its final metrics and what it sent.

    ``rounds`` (shown when a run has steps that send nothing, 0/1 Adam's local steps) counts the
    steps and synchronisations that sent anything; ``sent/worker`` is what one rank (worker) put
    on the wire over the whole run;
    ``fp32 / sent`` compares it with an fp32 ring allreduce of the same gradients (plain DDP);
    ``vs adam`` with the uncompressed baseline's own run when the table has one; ``status``
    (shown when a run diverged) says where it stopped.
    """
    keys: list[str] = []
    if primary:
        keys.append(primary)
    for r in runs:
        for k in r.get("final", {}):
            if k not in keys:
                keys.append(k)
    base = next((r for r in runs if r.get("algorithm") == "adam" and r.get("bytes_sent")), None)
    with_status = any(r.get("status", "ok") != "ok" for r in runs)
    # rounds (steps that sent anything) only when some run skips rounds (0/1 Adam's local steps)
    with_rounds = any(r.get("rounds") is not None and r.get("rounds") != r.get("steps") and r.get("bytes_sent")
                      for r in runs)
    head = ["run", *extra_cols, *keys, "steps", *(["rounds"] if with_rounds else []), "sent/worker", "fp32 / sent"]
    head += ["vs adam"] if base else []
    head += ["status"] if with_status else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best = None
    if primary:
        vals = [r.get("final", {}).get(primary) for r in runs]
        finite = [v for v in vals if isinstance(v, float) and math.isfinite(v)]
        if finite:
            best = max(finite) if goal == "max" else min(finite)
    for r in runs:
        sent = r.get("bytes_sent") or 0
        cells = [r["label"], *[_fmt(r.get(c, "")) for c in extra_cols]]
        for k in keys:
            v = r.get("final", {}).get(k)
            cell = "" if v is None else _fmt(v)
            cells.append(f"**{cell}**" if k == primary and v is not None and v == best else cell)
        cells += [str(r.get("steps", "")), *([str(r.get("rounds", ""))] if with_rounds else []),
                  format_bytes(sent) if sent else "0",
                  f"{r['fp32_ring_bytes'] / sent:.1f}x" if sent and r.get("fp32_ring_bytes") else "-"]
        if base:
            cells.append(compare_bytes(base["bytes_sent"], sent) if sent and r is not base else "-")
        if with_status:
            cells.append(r.get("status", "ok"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_run_report(run_dir: Path, summary: dict[str, Any]) -> Path | None:
    """``<run_dir>/curves.png`` for the runs of one job."""
    curves = [(r["label"], run_dir / r["metrics_csv"], r.get("status", "ok") != "ok") for r in summary["runs"]]
    return plot_curves(curves, summary["metrics"], summary["logy"], run_dir / "curves.png",
                       title=f"{summary['experiment']}")


def _load_summaries(sweep_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    def job_order(p: Path) -> tuple[int, str]:  # Hydra's job number first: 2_x before 10_x
        num = p.parent.name.split("_", 1)[0]
        return (int(num) if num.isdigit() else 1 << 30, p.parent.name)

    return [(p.parent, json.loads(p.read_text())) for p in sorted(sweep_dir.glob("*/summary.json"), key=job_order)]


def _best_per_variant(runs: Sequence[dict[str, Any]], primary: str, goal: str) -> list[dict[str, Any]]:
    """The best run of each variant over the tuned settings (``report.tune``, e.g. the step
    size, which the CD-Adam paper picks per method from a grid). A variant is a run label
    (an algorithm, or one of its labelled variants such as an eps placement) plus every
    swept setting that is not tuned."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        v = r.get("final", {}).get(primary)
        if not isinstance(v, float) or not math.isfinite(v):
            continue
        cur = best.get(r["variant"])
        if cur is None or (v > cur["final"][primary] if goal == "max" else v < cur["final"][primary]):
            best[r["variant"]] = r
    return list(best.values())


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def write_comparison(sweep_dir: str | Path) -> tuple[Path, Path | None]:
    """One markdown table (``comparison.md``) and one overlay plot (``comparison.png``) over all
    jobs of a sweep directory. When the sweep varies a tuned setting (``report.tune``: the
    learning rate, as the CD-Adam paper tunes each method), a first table keeps each
    algorithm's best run by the primary metric, and the plot shows those."""
    sweep_dir = Path(sweep_dir)
    jobs = _load_summaries(sweep_dir)
    if not jobs:
        raise FileNotFoundError(f"no */summary.json under {sweep_dir}: not a finished multirun directory")
    override_sets = [set(s.get("overrides", [])) for _, s in jobs]
    common = set.intersection(*override_sets)
    first = jobs[0][1]
    primary, goal = first.get("primary"), first.get("goal", "min")
    tune = set(first.get("tune", ["optim.lr", "algorithm.lr"]))  # the config default
    runs = []
    labels = [r["label"] for _, s in jobs for r in s["runs"]]
    for job_dir, s in jobs:
        varying = [o for o in s.get("overrides", []) if o not in common and _key(o) != "algorithm"]
        fixed = " ".join(o for o in varying if _key(o) not in tune)
        for r in s["runs"]:  # runs of one algorithm with other settings are told apart by those
            label = r["label"] if labels.count(r["label"]) == 1 else f"{r['label']} {' '.join(varying) or job_dir.name}"
            runs.append(dict(r, label=label, variant=(r["label"], fixed),
                             metrics_path=str(job_dir / r["metrics_csv"])))
    best = _best_per_variant(runs, primary, goal) if primary and tune else []
    tuned = 0 < len(best) < len(runs)
    shown = best if tuned else runs
    title = first["experiment"] + (f": best run per algorithm by final {primary}" if tuned else "")
    png = plot_curves([(r["label"], Path(r["metrics_path"]), r.get("status", "ok") != "ok") for r in shown],
                      first["metrics"], first["logy"],
                      sweep_dir / "comparison.png", title=title)
    md = [f"# {first['experiment']}: {len(runs)} runs", "", f"Sweep directory: `{sweep_dir}`",
          f"Common overrides: `{' '.join(sorted(common)) or '-'}`", ""]
    if tuned:
        md += [f"## Best run per algorithm over {', '.join(sorted(tune))} (final {primary}, goal: {goal})", "",
               runs_table(best, primary, goal), "", "## All runs", ""]
    md += [runs_table(runs, primary, goal), ""]
    if png is not None:
        md += [f"![curves]({png.name})", ""]
    out = sweep_dir / "comparison.md"
    out.write_text("\n".join(md))
    return out, png


class MultirunReport(Callback):
    """Hydra callback: after a multirun, write the comparison table and overlay plot."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not any(sweep_dir.glob("*/summary.json")):
            return  # the jobs failed or were not recipe runs; their errors were reported already
        md, png = write_comparison(sweep_dir)
        print(f"comparison of the sweep: {md}" + (f" and {png}" if png else ""))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Redraw a run's plot or a multirun's comparison.")
    ap.add_argument("directory", type=Path, help="a run directory (summary.json) or a multirun sweep directory")
    args = ap.parse_args(argv)
    single = args.directory / "summary.json"
    if single.exists():
        summary = json.loads(single.read_text())
        print(runs_table(summary["runs"], summary.get("primary"), summary.get("goal", "min")))
        print(write_run_report(args.directory, summary))
    else:
        md, png = write_comparison(args.directory)
        print(md.read_text())
        print(png)


if __name__ == "__main__":
    main()

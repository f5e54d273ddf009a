"""time_to_accuracy.py's report on the runs' rows: the target (DDP + AdamW's validation metric at ``TARGET_AT`` of
its budget), each method's wall time, steps and bytes to it, the verdict (the package's best against the best
peer) and the curves against wall time and bytes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from methods import TTA_LIGHT, TTA_METHODS, TTA_OURS, TTA_PEERS
from workloads import LM_BATCH

__all__ = ["METRICS", "NAMES", "TARGET_AT", "best_lr", "beyond_compute", "chart", "setting", "smoothed", "tables",
           "target_of", "target_run", "to_target", "verdict"]

METHODS = tuple(TTA_METHODS)  # the tables' order
TARGET_AT = 0.8
U8_WARM = tuple(m for m, row in TTA_METHODS.items() if row.overrides.get("warmup_comm_dtype") == "uint8")
"""Drawn dotted: the methods whose full-precision phase travels as 8-bit codes."""


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
    return r.get("workload", "lm"), r.get("batch", LM_BATCH), r["nodes"], r["ranks_per_node"], r["steps"]


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
        peers = {m: t for m, t in times.items() if m in TTA_PEERS and t}
        ours = {m: t for m, t in times.items() if m in TTA_OURS and t}
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
    hues = [m for m in METHODS if m not in TTA_LIGHT]
    colors = {m: shades[2 * hues.index(TTA_LIGHT.get(m, m)) + (m not in hues)] for m in METHODS}
    for j, where in enumerate(wheres):
        for m in METHODS:
            runs = [r for r in rows if setting(r) == where and r["method"] == m]
            for i, r in enumerate(runs):
                x_t = [p["train_s"] for p in r["points"]]
                x_b = [p["tx"] / 1e6 for p in r["points"]]
                y = [p[metric] for p in r["points"]]
                style = "--" if m in TTA_PEERS else ":" if m in U8_WARM else "-"
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



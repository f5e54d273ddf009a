"""e2e.py's report: a markdown table per (workload, layout, rate) against DDP and the ideal step, 0/1 Adam
against 1-bit Adam, flat against two-level, the targets it checks, and a bar chart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from methods import E2E_HOOKS, E2E_LABEL, E2E_METHODS, E2E_TWO_LEVEL
from netns_cluster import parse_rate
from workloads import E2E_WORKLOADS

__all__ = ["WORKLOAD_DESC", "chart", "fmt_s", "ideal_of", "layout", "setup_text", "tables", "target_check"]

METHODS = tuple(E2E_METHODS)  # the tables' order
WORKLOAD_DESC = {
    "mlp": "wide MLP 1024-4096-4096-1024-10 (25.2M params), batch 16/worker, synthetic teacher labels "
           "(communication-bound)",
    "transformer": "transformer encoder, 4 layers, d=256, 4 heads, ff 1024, seq 128, vocab 1000 (3.7M params), "
                   "batch 8/worker, shifted-token target (compute-heavier)",
}


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _mb(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}" if v < 10e6 else f"{v / 1e6:.1f}"


def layout(nodes: int, L: int) -> str:
    return f"{nodes} nodes x {L} ranks" if L > 1 else f"{nodes} nodes"


def _setting(r: dict[str, Any]) -> tuple[str, int, int, str]:
    """(workload, nodes, ranks per node, rate) of a row (rows without a layout are one rank per node)."""
    return r["workload"], r["nodes"], r.get("ranks_per_node", 1), r["rate"]


def _setting_key(k: tuple[str, int, int, str]) -> tuple[int, int, int, float]:
    return E2E_WORKLOADS.index(k[0]), k[1], k[2], parse_rate(k[3])


def ideal_of(refs: list[dict[str, Any]], nodes: int, rate: str, workload: str,
             ranks_per_node: int = 1) -> dict[str, float] | None:
    for r in refs:
        if r.get("kind") == "fp32_allreduce" and _setting(r) == (workload, nodes, ranks_per_node, rate):
            return {"compute": r["compute_alone_s"], "fp32": r["seconds"],
                    "ideal": r["compute_alone_s"] + r["seconds"] / 32}
    return None


def tables(rows: list[dict[str, Any]], refs: list[dict[str, Any]], rtt: float = 0.0) -> str:
    """Markdown: one table per (workload, nodes, rate), then the target check (``rtt``: the round trip
    every link had, for the titles)."""
    out = []
    settings = sorted({_setting(r) for r in rows}, key=_setting_key)
    for workload, nodes, L, rate in settings:
        sub = [r for r in rows if _setting(r) == (workload, nodes, L, rate)]
        sub.sort(key=lambda r: METHODS.index(r["method"]))
        ideal = ideal_of(refs, nodes, rate, workload, L)
        base = next((r["compress_median_s"] for r in sub if r["method"] == "ddp_adamw"), None)
        link = f"{rate} + {rtt:g} ms RTT" if rtt else rate
        out.append(f"### {workload}, {layout(nodes, L)}, {link}\n")
        if ideal:
            out.append(f"Ideal step: compute alone {ideal['compute']:.3f} s + fp32 all_reduce "
                       f"{ideal['fp32']:.3f} s / 32 = **{ideal['ideal']:.3f} s**\n")
        out.append("| method | phase 1 (warm-up) s | phase 2 (compression) s | samples/s (phase 2) | "
                   "link MB/step/node phase 1 | phase 2 | speedup vs DDP + fused AdamW (phase 2) | "
                   "phase 2 / ideal | loss first -> last |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in sub:
            c = r["compress_median_s"]
            sps = r["batch_per_worker"] * nodes * L / c if c else None
            speed = f"{base / c:.2f}x" if base and c else "-"
            vs_ideal = f"{c / ideal['ideal']:.2f}" if ideal and c else "-"
            out.append(f"| {E2E_LABEL[r['method']]} | {fmt_s(r['warmup_median_s'])} | {fmt_s(c)} | "
                       f"{'-' if sps is None else f'{sps:.1f}'} | {_mb(r.get('warmup_tx_per_step'))} | "
                       f"{_mb(r.get('compress_tx_per_step'))} | {speed} | {vs_ideal} | "
                       f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
        out.append("")
        out.append(_zero_one_vs_onebit(sub))
        out.append(_flat_vs_two_level(sub))
    out.append(target_check(rows, refs))
    return "\n".join(out)


def _zero_one_vs_onebit(sub: list[dict[str, Any]]) -> str:
    """0/1 Adam's steady state (whole local intervals) against 1-bit Adam's compression phase."""
    by = {r["method"]: r for r in sub}
    z, o = by.get("zero_one_adam"), by.get("onebit_adam")
    if z is None:
        return ""
    line = (f"zero_one_adam, phase 2: {z['compress_rounds_per_step']:.2f} rounds per step over "
            f"{z['compress_steps']} steps of whole local intervals")
    if o is not None and o["compress_median_s"] and z["compress_median_s"]:
        bz, bo = z.get("compress_tx_per_step"), o.get("compress_tx_per_step")
        ratio = o["compress_median_s"] / z["compress_median_s"]
        line += f"; onebit_adam (compression phase) / zero_one_adam: step time {ratio:.2f}x"
        line += f", link bytes {bo / bz:.2f}x" if bz and bo else ""
        line += f", rounds {o['compress_rounds_per_step'] / z['compress_rounds_per_step']:.2f}x"
    return line + ".\n"


def _flat_vs_two_level(sub: list[dict[str, Any]]) -> str:
    """For nodes of several ranks: each algorithm flat against two-level, compression phase."""
    by = {r["method"]: r for r in sub}
    pairs = [(flat, hier) for hier, flat in E2E_TWO_LEVEL.items() if hier in by and flat in by]
    if not pairs:
        return ""
    lines = ["Flat vs two-level, compression phase (inter-node bytes: each node's link counter):\n",
             "| algorithm | flat s | two-level s | flat / two-level time | flat link MB/step/node | "
             "two-level link MB/step/node | flat / two-level bytes | two-level fp32 MB/step/node inside the node |",
             "|---|---|---|---|---|---|---|---|"]
    for flat, hier in pairs:
        f, h = by[flat], by[hier]
        tf, th = f["compress_median_s"], h["compress_median_s"]
        bf, bh = f.get("compress_tx_per_step"), h.get("compress_tx_per_step")
        lines.append(f"| {flat} | {fmt_s(tf)} | {fmt_s(th)} | {f'{tf / th:.2f}x' if tf and th else '-'} | "
                     f"{_mb(bf)} | {_mb(bh)} | {f'{bf / bh:.2f}x' if bf and bh else '-'} | "
                     f"{_mb(h.get('compress_intra_per_step'))} |")
    return "\n".join(lines) + "\n"


def target_check(rows: list[dict[str, Any]], refs: list[dict[str, Any]]) -> str:
    """The targets (see the module docstring): on the communication-bound model, 2 nodes, 1 Gbit/s; and
    two-level against flat wherever nodes have 2 ranks."""
    return _flat_targets(rows, refs) + _two_level_targets(rows)


def _two_level_targets(rows: list[dict[str, Any]]) -> str:
    lines = []
    for workload, nodes, L, rate in sorted({_setting(r) for r in rows if r.get("ranks_per_node", 1) == 2},
                                           key=_setting_key):
        by = {r["method"]: r for r in rows if _setting(r) == (workload, nodes, L, rate)}
        for hier, flat in E2E_TWO_LEVEL.items():
            if hier not in by or flat not in by:
                continue
            f, h = by[flat], by[hier]
            bf, bh = f.get("compress_tx_per_step"), h.get("compress_tx_per_step")
            tf, th = f["compress_median_s"], h["compress_median_s"]
            if not (bf and bh and tf and th):
                continue
            lines.append(f"- {workload}, {layout(nodes, L)}, {rate}, {flat}: inter-node bytes flat / two-level "
                         f"{bf / bh:.2f}x (>= 1.8x: {'met' if bf / bh >= 1.8 else 'MISSED'}); step flat / two-level "
                         f"{tf / th:.2f}x (not slower: {'met' if th <= tf else 'MISSED'})")
    return ("Targets (two-level vs flat, compression phase, 2 ranks per node):\n" + "\n".join(lines) + "\n"
            if lines else "")


def _flat_targets(rows: list[dict[str, Any]], refs: list[dict[str, Any]]) -> str:
    sub = {r["method"]: r for r in rows if _setting(r) == ("mlp", 2, 1, "1gbit")}
    ob = sub.get("onebit_adam")
    if not ob or not ob["compress_median_s"]:
        return "Targets (mlp, 2 nodes, 1gbit): not measured in this run.\n"
    t = ob["compress_median_s"]
    lines = ["Targets (mlp, 2 nodes, 1gbit, onebit_adam compression phase):"]
    if "ddp_adamw" in sub:
        s = sub["ddp_adamw"]["compress_median_s"] / t
        lines.append(f"- >= 2.5x faster than DDP + fused AdamW: {s:.2f}x -> {'met' if s >= 2.5 else 'MISSED'}")
    ideal = ideal_of(refs, 2, "1gbit", "mlp", 1)
    if ideal:
        q = t / ideal["ideal"]
        lines.append(f"- within 1.3x of the ideal ({ideal['ideal']:.3f} s): {q:.2f}x -> "
                     f"{'met' if q <= 1.3 else 'MISSED'}")
    for h in E2E_HOOKS:
        if h in sub and sub[h]["compress_median_s"]:
            other = sub[h]["compress_median_s"]
            lines.append(f"- faster than {E2E_LABEL[h]} ({other:.3f} s): {other / t:.2f}x -> "
                         f"{'met' if t < other else 'MISSED'}")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], refs: list[dict[str, Any]], path: Path) -> None:
    """Bar chart: per setting, each method's phase-1 and phase-2 step time, and the ideal as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({_setting(r) for r in rows}, key=_setting_key)
    ncol = min(4, len(settings))
    nrow = -(-len(settings) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(7.0, 4.6 * ncol), 4.2 * nrow + 0.6), squeeze=False)
    for ax, (workload, nodes, L, rate) in zip(axes.flat, settings, strict=False):
        sub = sorted((r for r in rows if _setting(r) == (workload, nodes, L, rate)),
                     key=lambda r: METHODS.index(r["method"]))
        xs = range(len(sub))
        p1 = [r["warmup_median_s"] or 0 for r in sub]
        p2 = [r["compress_median_s"] or 0 for r in sub]
        colors = ["tab:gray" if r["method"] == "ddp_adamw" else "tab:orange" if r["method"] in E2E_HOOKS
                  else "tab:blue" for r in sub]
        ax.bar([x - 0.2 for x in xs], p1, 0.4, color=colors, alpha=0.35)
        ax.bar([x + 0.2 for x in xs], p2, 0.4, color=colors)
        ideal = ideal_of(refs, nodes, rate, workload, L)
        if ideal:
            ax.axhline(ideal["ideal"], color="k", ls="--", lw=1, label=f"ideal {ideal['ideal']:.3f} s")
            ax.legend(fontsize=7, loc="lower left", framealpha=0.9)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([E2E_LABEL[r["method"]].replace("DDP + ", "") for r in sub], rotation=60, ha="right",
                           fontsize=8)
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{workload}, {layout(nodes, L)}, {rate}", fontsize=10)
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.suptitle("Training step time on emulated links (median, slowest rank; lower is better)\n"
                 "pale: phase 1 (warm-up), dark: phase 2 (compression)\n"
                 "gray: DDP, orange: PyTorch comm hooks, blue: lightning_onebit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setup_text(args: argparse.Namespace, chart_path: Path | None) -> str:
    """What was run and how it was measured: the paragraph that heads an ``--out`` file."""
    S = args.warmup + args.skip + args.compress_steps
    wl = "\n".join(f"- `{w}`: {WORKLOAD_DESC[w]}" for w in args.workloads)
    return (
        f"Workloads:\n{wl}\n\n"
        f"One torchrun per node (network namespace behind a tc-tbf shaped veth), Lightning Trainer(accelerator="
        f"'cpu', devices=L, num_nodes=N), gloo, 1 thread per process, all methods in the same torchrun one "
        f"after another. {S} steps per method: warm-up switch at step {args.warmup} "
        f"(CompressedDDPStrategy(warmup={args.warmup}), PowerSGD start_powerSGD_iter={args.warmup}); "
        f"medians skip the first {args.skip} steps of each phase. Step time = interval between consecutive "
        "on_train_batch_end calls, slowest rank per step. Phase 1 = steps before the switch (for the fp16/bf16 "
        "hooks and cd_adam, which have one regime, both phases measure the same thing). Link MB = veth tx "
        "counter per step and node (incl. TCP/IP headers). Ideal = compute alone (same model, Trainer(devices=1),"
        " AdamW(fused=True), N such processes at once since the nodes share the machine's cores) + measured fp32 "
        "all_reduce of all parameters / 32. Loss: mean over ranks, first step -> mean of the last 3 steps (a "
        f"sanity check only: {S} steps say nothing about final quality)."
        + (f"\n\nChart: `{chart_path}`" if chart_path else ""))



"""Sharded DiLoCo and sharded 1-bit Adam on emulated nodes: the bytes on the link between nodes and the state
per rank, against the unsharded two-level layout of the same optimizer at the same settings.

    python benchmarks/sharded.py                     # DiLoCo, 2 nodes x 2 ranks, 1 Gbit/s, 4-bit (as root)
    python benchmarks/sharded.py --compression fp32 --out sharded.md
    python benchmarks/sharded.py --algorithm onebit_adam   # ShardedCompressed vs OnebitAdam two-level

Per emulated node (a network namespace behind a shaped veth, ``netns_cluster.py``) one torchrun of 2 ranks,
gloo, one thread per process; the ranks of a node talk over its loopback, nodes over the link. Each run
trains e2e.py's transformer (3.7M parameters: embeddings, LayerNorms, attention, biases) with DiLoCo, AdamW
inside, on synthetic tokens, in one of two layouts:

* ``sharded``: FSDP2 over the node's ranks (every encoder layer and the root ``fully_shard``ed over
  ``mesh["shard"]``), ``DiLoCo(mesh=mesh)``: each rank's state its shard, the outer all-reduce over the ranks
  holding the same shard on each node;
* ``two-level``: every rank a whole replica, ``DiLoCo(ranks_per_node=2, hierarchical=True)``: an fp32 mean
  inside the node, the compressed all-reduce between nodes.

With ``--algorithm onebit_adam`` the sharded layout runs ``ShardedCompressed("onebit_adam", mesh=mesh)`` and
the two-level one ``OnebitAdam`` with ``set_topology(hierarchical=True)``, each synchronising in ``step()``;
per warm-up step from runs of 2 and 4 steps that do not leave the warm-up, per compressed step from runs of
4 and 8 steps after a warm-up of 2.

Bytes between nodes come from the veth counters (TCP/IP headers included). Per outer step and per inner
step they come from runs of different lengths in the same layout: per outer step the difference between runs
of 2 and 4 outer steps of ``--sync-every`` inner steps (the setup's bytes, the rendezvous and process-group
creation, cancel), and runs of 4 and 12 inner steps without an outer step show what inner steps add. State
per rank: every tensor the optimizer holds beyond the parameters and gradients (``state_bytes``: the inner
AdamW's moments, DiLoCo's anchor, outer momentum and scratch, the collectives' error state and buffers; of a
sharded tensor its local shard), counted once per storage, on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from _common import add_out_argument, header, repo_on_path, require_root, write_out

repo_on_path()

MARK = "SHARDED_RESULT "


# -- the worker (one rank, under torchrun) -------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from workloads import _e2e_net

    from lightning_onebit import DiLoCo, OnebitAdam, ShardedCompressed
    from lightning_onebit.optim.state_size import state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_size = int(os.environ["LOCAL_WORLD_SIZE"])
    net = _e2e_net("transformer")
    kw = dict(lr=1e-3, sync_every=args.sync_every, compression=args.compression)
    onebit = args.algorithm == "onebit_adam"
    if args.layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // local_size, local_size), mesh_dim_names=("node", "shard"))
        for layer in net.enc.layers:
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        opt = ShardedCompressed("onebit_adam", net.parameters(), mesh=mesh, lr=1e-3, warmup_steps=args.warmup) \
            if onebit else DiLoCo(net.parameters(), mesh=mesh, **kw)
    elif onebit:
        opt = OnebitAdam(net.parameters(), lr=1e-3, warmup_steps=args.warmup)
        opt.set_topology(hierarchical=True, ranks_per_node=local_size)
    else:
        opt = DiLoCo(net.parameters(), ranks_per_node=local_size, hierarchical=True, **kw)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randint(0, 1000, (4, 64), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[:, :-1]).reshape(-1, 1000), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    dist.barrier()
    state = state_bytes(opt)
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in net.parameters())
    if rank == 0:
        print(MARK + json.dumps({"state_bytes": state, "local_params": params, "loss": float(loss),
                                 "phase": "compressing" if onebit and opt.compressing else "-"}), flush=True)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------

def _run(cluster, args, layout: str, steps: int, every: int, port: int) -> tuple[int, dict]:
    """One torchrun per node; (bytes the nodes sent on their links, rank 0's result). ``every``: DiLoCo's
    sync_every, or 1-bit Adam's warm-up steps."""
    from netns_cluster import report_failures, run_torchrun

    before = sum(cluster.tx_bytes(k) for k in range(cluster.nodes))
    results = run_torchrun(cluster, __file__, ["--worker", "--layout", layout, "--steps", str(steps),
                                               "--sync-every", str(every), "--warmup", str(every),
                                               "--algorithm", args.algorithm, "--compression", args.compression],
                           master_port=port, timeout=args.timeout, nproc_per_node=args.ranks_per_node)
    sent = sum(cluster.tx_bytes(k) for k in range(cluster.nodes)) - before
    report_failures(results, f"{layout}, {steps} steps", keep_going=False)
    line = next(ln for r in results for ln in r.stdout.splitlines() if ln.startswith(MARK))
    return sent, json.loads(line[len(MARK):])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--compression", default="4bit")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--algorithm", choices=("diloco", "onebit_adam"), default="diloco")
    ap.add_argument("--warmup", type=int, default=2, help="1-bit Adam's warm-up steps")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=("sharded", "two-level"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not require_root():
        return 1
    from netns_cluster import EmulatedCluster

    h, w = args.sync_every, args.warmup
    onebit = args.algorithm == "onebit_adam"
    # (name, steps, DiLoCo's sync_every or 1-bit Adam's warm-up): the difference of the last two is per round
    plan = ((("base", 2, 10_000), ("base+", 4, 10_000), ("round", w + 4, w), ("round+", w + 8, w)) if onebit else
            (("base", 4, 10_000), ("base+", 12, 10_000), ("round", 2 * h, h), ("round+", 4 * h, h)))
    rows, port = {}, 29731
    with EmulatedCluster(args.nodes, rate=args.rate) as cluster:
        for layout in ("sharded", "two-level"):
            runs = {}
            for name, steps, every in plan:
                port += 1
                runs[name] = _run(cluster, args, layout, steps, every, port)
                print(f"{layout} {name}: {runs[name][0]} bytes on the links, {runs[name][1]}", file=sys.stderr)
            base = (runs["base"][0] / args.nodes, runs["base+"][0] / args.nodes)
            extra = (plan[3][1] - plan[2][1]) if onebit else 2
            per_round = (runs["round+"][0] - runs["round"][0]) / extra / args.nodes
            rows[layout] = (base, per_round, runs["round+"][1])
    sh, tl = rows["sharded"], rows["two-level"]
    if onebit:
        lines = [f"2-D layout {args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate}, 1-bit Adam (warm-up {w} "
                 "steps); e2e.py's transformer (3.7M parameters)", "",
                 "| layout | link bytes per node, whole runs of 2 / 4 warm-up steps | per compressed step "
                 "| optimizer state per rank (MB) | per parameter on the rank (B) | parameters on a rank "
                 f"| loss after {w + 8} steps |", "|---|---|---|---|---|---|---|"]
    else:
        lines = [f"2-D layout {args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate}, DiLoCo "
                 f"compression={args.compression}, sync_every={h}; e2e.py's transformer (3.7M parameters)", "",
                 "| layout | link bytes per node, whole runs of 4 / 12 inner steps and no outer step | per outer step "
                 "| optimizer + DiLoCo state per rank (MB) | per parameter on the rank (B) | parameters on a rank "
                 "| loss after 4 outer steps |", "|---|---|---|---|---|---|---|"]
    for layout, (base, per_round, res) in rows.items():
        per = res["state_bytes"] / res["local_params"]
        lines.append(f"| {layout} | {base[0]:,.0f} / {base[1]:,.0f} | {per_round:,.0f} "
                     f"| {res['state_bytes'] / 1e6:.2f} | {per:.1f} | {res['local_params']:,} | {res['loss']:.3f} |")
    ratio_bytes = sh[1] / tl[1]
    ratio_state = sh[2]["state_bytes"] / tl[2]["state_bytes"]
    goal = 1 / args.ranks_per_node + 0.10
    what = "compressed step" if onebit else "outer step"
    lines += ["", f"- sharded / two-level bytes per {what}: {ratio_bytes:.3f} (target within 5%: "
              f"{'met' if abs(ratio_bytes - 1) <= 0.05 else 'MISSED'})",
              f"- sharded / two-level state per rank: {ratio_state:.3f} (target <= 1/L + 10% = {goal:.2f}: "
              f"{'met' if ratio_state <= goal else 'MISSED'})"]
    if onebit:
        lines.append(f"- warm-up: 2 more steps add {sh[0][1] - sh[0][0]:+,.0f} bytes per node on the link sharded, "
                     f"{tl[0][1] - tl[0][0]:+,.0f} two-level (the fp32 mean of the shard, or of the node's "
                     "reduce-scattered piece, between nodes)")
    else:
        lines.append(f"- inner steps: 8 more of them add {sh[0][1] - sh[0][0]:+,.0f} bytes per node on the link "
                     f"sharded, {tl[0][1] - tl[0][0]:+,.0f} two-level (the runs' setup, rendezvous and groups, is the "
                     "rest): FSDP's all-gather and reduce-scatter stay inside the node")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_out(args.out, header("sharded.py", argv) + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

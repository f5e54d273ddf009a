"""Plain PyTorch, a sharded model: FSDP2 inside each node, DiLoCo's compressed outer all-reduce between nodes.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:29500 examples/fsdp_diloco.py   # 2 nodes
    torchrun --nproc-per-node 4 examples/fsdp_diloco.py --ranks-per-node 2   # one host as 2 nodes of 2
    torchrun --max-restarts 1 ... examples/fsdp_diloco.py --ckpt-dir ckpt    # resumes after a lost rank

Each rank holds a shard of the model (``fully_shard`` over the ranks of its node) and DiLoCo's anchor,
outer momentum and error state for that shard only; every ``--sync-every`` inner steps the ranks that
hold the same shard on every node average their pseudo-gradients, 4-bit compressed. With ``--ckpt-dir``
every rank writes its own file every ``--save-every`` steps (its parameter shards and optimizer state:
nothing is gathered), and a restarted job goes on from the last step every rank saved.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from _digits import digits_dataset
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from lightning_onebit import DiLoCo
from lightning_onebit.comm.process_group import attempt_store


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--compression", default="4bit")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="ranks per node (default: torchrun's LOCAL_WORLD_SIZE, the ranks of one host)")
    ap.add_argument("--ckpt-dir", help="a file per rank here every --save-every steps; resume from them")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--die-at", type=int, help="(testing) rank 1 of the first attempt dies after this step")
    args = ap.parse_args()
    # under torchrun the group's keys are this restart attempt's, so a restarted rank never reads the
    # killed attempt's addresses from the agent's store
    timeout = datetime.timedelta(seconds=120)
    store = attempt_store(timeout)
    if store is None:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    local = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # nodes x ranks per node: FSDP shards over the inner dimension, DiLoCo averages over the outer one
    mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("node", "shard"))
    torch.manual_seed(0)
    net = model()
    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    opt = DiLoCo(net.parameters(), lr=3e-3, sync_every=args.sync_every, compression=args.compression, mesh=mesh)
    step = resume(opt, args.ckpt_dir, rank)
    data = digits_dataset()
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, rank))
    batches = (b for epoch in range(10**6) for b in loader)  # the same batches in the same order on a resume
    for _ in range(step):
        next(batches)
    while step < args.steps:
        x, y = next(batches)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        step += 1
        if args.ckpt_dir and step % args.save_every == 0:
            # the nodes meet only at outer steps, so one may be up to sync_every steps ahead when another is lost:
            # each rank keeps the files of that many steps, and a resume takes the newest step every rank has
            save(opt, args.ckpt_dir, rank, step, keep=args.sync_every // args.save_every + 2)
        if step == args.die_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os._exit(1)  # as a lost node would: no cleanup, its peers see the connection drop
    opt.outer_step()  # the interval's last outer step: every node ends on the anchor
    # every node holds the same model now: compare a checksum of this rank's shard across the nodes
    mine = torch.stack([p.to_local().detach().double().sum() for p in net.parameters()])
    top, low = mine.clone(), mine.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh["node"].get_group())
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh["node"].get_group())
    shard = sum(p.to_local().numel() for p in net.parameters())
    whole = sum(p.numel() for p in net.parameters())
    agree = bool(torch.equal(top, low))
    total = mine.sum().reshape(1)
    dist.all_reduce(total, group=mesh["shard"].get_group())  # the whole model's sum: the node's shards
    if rank == 0:
        print(f"loss {loss.item():.3f}; {mesh.size(0)} nodes x {mesh.size(1)} ranks; outer steps {opt.outer_steps}; "
              f"DiLoCo state for {shard} of {whole} parameters on this rank; nodes agree: {agree}; "
              f"bytes sent by rank 0: {opt.comm_counter.total.bytes_sent}; parameter sum {total.item()!r}")
    dist.destroy_process_group()


def _saved_steps(ckpt_dir: str, rank: int) -> list[int]:
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    prefix = f"rank{rank}-step"
    return sorted(int(n[len(prefix):-3]) for n in names if n.startswith(prefix) and n.endswith(".pt"))


def save(opt: DiLoCo, ckpt_dir: str, rank: int, step: int, keep: int) -> None:
    """This rank's file of ``step``: its parameter shards and optimizer state (``local_state``), written whole
    or not at all; its files older than the newest ``keep`` removed."""
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"rank{rank}-step{step}.pt")
    torch.save({"step": step, "local": opt.local_state()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    for old in _saved_steps(ckpt_dir, rank)[:-keep]:
        os.remove(os.path.join(ckpt_dir, f"rank{rank}-step{old}.pt"))


def resume(opt: DiLoCo, ckpt_dir: str | None, rank: int) -> int:
    """The newest step of which every rank has a file (0 without files), its state loaded; raises on every rank
    if the ranks' files have no step in common."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, _saved_steps(ckpt_dir, rank) if ckpt_dir else [])
    if not any(every):
        return 0
    common = set(every[0]).intersection(*every[1:])
    if not common:
        raise RuntimeError(f"the ranks' files in {ckpt_dir} have no step in common ({every}); cannot resume")
    step = max(common)
    opt.load_local_state(torch.load(os.path.join(ckpt_dir, f"rank{rank}-step{step}.pt"), weights_only=False)["local"])
    if rank == 0:
        print(f"resumed from step {step}")
    return step


if __name__ == "__main__":
    main()

"""Plain PyTorch, a sharded model: FSDP2 inside each node, DiLoCo's compressed outer all-reduce between nodes.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:29500 examples/fsdp_diloco.py   # 2 nodes
    torchrun --nproc-per-node 4 examples/fsdp_diloco.py --ranks-per-node 2   # one host as 2 nodes of 2

Each rank holds a shard of the model (``fully_shard`` over the ranks of its node) and DiLoCo's anchor,
outer momentum and error state for that shard only; every ``--sync-every`` inner steps the ranks that
hold the same shard on every node average their pseudo-gradients, 4-bit compressed.
"""

import argparse
import os

import torch
import torch.distributed as dist
from _digits import digits_dataset
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from lightning_onebit import DiLoCo


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
    args = ap.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
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
    data = digits_dataset()
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world, dist.get_rank()))
    step = 0
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            step += 1
            if step == args.steps:
                break
    opt.outer_step()  # the interval's last outer step: every node ends on the anchor
    # every node holds the same model now: compare a checksum of this rank's shard across the nodes
    mine = torch.stack([p.to_local().detach().double().sum() for p in net.parameters()])
    top, low = mine.clone(), mine.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh["node"].get_group())
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh["node"].get_group())
    shard = sum(p.to_local().numel() for p in net.parameters())
    whole = sum(p.numel() for p in net.parameters())
    agree = bool(torch.equal(top, low))
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.3f}; {mesh.size(0)} nodes x {mesh.size(1)} ranks; outer steps {opt.outer_steps}; "
              f"DiLoCo state for {shard} of {whole} parameters on this rank; nodes agree: {agree}; "
              f"bytes sent by rank 0: {opt.comm_counter.total.bytes_sent}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Way 3: plain PyTorch DDP, no Lightning: one call, ``optimizer.attach(ddp_model)``.

    python examples/plain_ddp.py --steps 100
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _digits import digits_dataset, mlp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from lightning_onebit import OnebitAdam


def run(rank: int, world_size: int, steps: int) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(mlp())
    opt = OnebitAdam(model.parameters(), lr=3e-3, weight_decay=0.01, warmup_steps=steps // 5)
    opt.attach(model)  # compression runs in a DDP comm hook during backward
    data = digits_dataset()
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, world_size, rank))
    step = 0
    while step < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
    if rank == 0:
        s = opt.comm_counter
        print(f"loss {loss.item():.3f}; compressing: {opt.compressing}; bytes sent by rank 0: {s.total.bytes_sent}; "
              f"last step {s.last.ratio_vs_fp32:.1f}x fewer than fp32 DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    os.environ["MASTER_PORT"] = str(args.port)
    mp.spawn(run, args=(2, args.steps), nprocs=2)

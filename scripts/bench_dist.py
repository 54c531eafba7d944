"""Python side of `cargo run --release --example dist_bench`: the same allreduce sizes and the same
DDP step as the Rust ranks, through torch.distributed (Gloo) and torch's DistributedDataParallel.

    python scripts/bench_dist.py allreduce RANK WORLD PORT ITERS SIZE_BYTES...
    python scripts/bench_dist.py ddp RANK WORLD PORT STEPS BATCH HIDDEN
Rank 0 prints one JSON object per line: {"bytes": n, "seconds": s} per size, or {"ms_per_step": ms}.
"""
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def init(rank, world, port):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def allreduce(rank, world, port, iters, sizes):
    init(rank, world, port)
    for size in sizes:
        t = torch.ones(size // 4)
        dist.all_reduce(t)  # warm-up (connections, buffers)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        secs = (time.perf_counter() - start) / iters
        if rank == 0:
            print(json.dumps({"bytes": size, "seconds": secs}), flush=True)
    dist.destroy_process_group()


def ddp(rank, world, port, steps, batch, hidden):
    init(rank, world, port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 784)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    if rank == 0:
        print(json.dumps({"ms_per_step": ms}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rest = [int(a) for a in sys.argv[5:]]
    if mode == "allreduce":
        allreduce(rank, world, port, rest[0], rest[1:])
    else:
        ddp(rank, world, port, *rest)

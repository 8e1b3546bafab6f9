"""A minimal hand-written DDP + AMP training script with torch.multiprocessing.spawn: the baseline that
ddp-amp's core and launcher are measured against. Same model, data, batch, optimizer, schedule and threads;
torch's defaults everywhere else (the default AdamW implementation, DDP's default options), as a user's loop has.

    python benchmarks/handwritten.py --nproc 2 --steps 200 --out result.json
"""

import argparse
import gc
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tasks import wide_regression
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_amp.tasks.mlp import build

TASKS = {"mlp": build, "wide": wide_regression}


def worker(rank: int, world: int, port: int, args, started: float, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    task = TASKS[args.task]()
    model = DDP(task.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    sampler = DistributedSampler(task.dataset, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(task.dataset, batch_size=args.batch_size, sampler=sampler)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    step, epoch, first_step_at, steady_from = 0, 0, None, None
    measure_from = min(20, max(1, args.steps // 10))  # as ddp-amp's steady state
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, target in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = task.loss_fn(model(inputs), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if first_step_at is None:
                first_step_at = time.time()
            if step == measure_from:
                steady_from = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    dist.barrier()
    steady_s = time.perf_counter() - steady_from
    if rank == 0:
        results.put({"time_to_first_step_s": first_step_at - started,
                     "samples_per_s": (args.steps - measure_from) * args.batch_size * world / steady_s})
    # DDP sits in a reference cycle: freed by the collector only, it would take the gloo group's last reference
    # after destroy_process_group, and the group's destructor can hang or abort the rank at exit (docs/scripts.md).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def main() -> None:
    started = time.time()
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with socket.socket() as s:  # the usual hand-written way: find a free port, then hope it stays free
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.nproc, port, args, started, results), nprocs=args.nproc)
    result = results.get()
    result["wall_s"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

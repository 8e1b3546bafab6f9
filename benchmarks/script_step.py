"""A user's torchrun script for benchmarks/script_launch.py: DDP over an MLP on CPU ranks, one optimizer step per
iteration. Its steps come in blocks of BLOCK, every other block printing a line per step (as many scripts do) and
the others silent, so that one run compares the two on the same processes. Rank 0 writes what it measured to
--out: the wall clock of its first finished step, and the median step time of the printing and of the silent
steps after the first few."""

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WARMUP = 5
BLOCK = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(args.width, args.width * 4), nn.ReLU(),
                                                  nn.Linear(args.width * 4, args.width)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, target = torch.randn(64, args.width), torch.randn(64, args.width)
    first_step_at, times = None, {True: [], False: []}
    for step in range(args.steps):
        printing = step // BLOCK % 2 == 1
        started = time.perf_counter()
        loss = nn.functional.mse_loss(model(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if printing:
            print(f"rank {dist.get_rank()} step {step} loss {loss.detach().item():.6f}")
        if first_step_at is None:
            first_step_at = time.time()
        if step >= WARMUP:
            times[printing].append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_at": first_step_at, "printing_step_s": statistics.median(times[True]),
                       "silent_step_s": statistics.median(times[False])}, f)
    # DDP sits in a reference cycle: freed by the collector only, it would take the gloo group's last reference
    # after destroy_process_group, and the group's destructor can hang or abort the rank at exit (docs/scripts.md).
    dist.barrier()
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

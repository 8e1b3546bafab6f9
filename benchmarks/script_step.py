"""A user's torchrun script for benchmarks/script_launch.py: DDP over an MLP on CPU ranks, one optimizer step per
iteration, optionally printing a line per step (as many scripts do). Rank 0 writes what it measured to --out:
the wall clock of its first finished step and its mean step time after the first few."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WARMUP = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--print", action="store_true", help="print a line every step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(args.width, args.width * 4), nn.ReLU(),
                                                  nn.Linear(args.width * 4, args.width)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, target = torch.randn(64, args.width), torch.randn(64, args.width)
    first_step_at, started = None, None
    for step in range(args.steps):
        if step == WARMUP:
            started = time.perf_counter()
        loss = nn.functional.mse_loss(model(data), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if first_step_at is None:
            first_step_at = time.time()
        if args.print:
            print(f"rank {dist.get_rank()} step {step} loss {loss.detach().item():.6f}")
    mean_step_s = (time.perf_counter() - started) / (args.steps - WARMUP)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_at": first_step_at, "mean_step_s": mean_step_s}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The example ddp-amp grew from, in its torchrun form, copied for CPU ranks (gloo, bf16 autocast on the CPU,
no .cuda()) and otherwise unchanged, its traps included (two schedulers stepped back to back, a GradScaler that
bf16 does not need): `torchrun --standalone --nproc-per-node 2 origin_ddp.py` and `ddp-amp run -n 2
origin_ddp.py` must run it alike. Rank 0 saves the final weights to --out."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--out", default="model.pt")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    model = nn.Linear(10, 10)
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    scheduler1 = optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    scheduler2 = optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    scaler = torch.amp.GradScaler("cpu")

    inputs = torch.randn(32, 10)
    targets = torch.randn(32, 10)
    for epoch in range(args.epochs):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = ddp_model(inputs)
            loss = loss_fn(outputs.float(), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler1.step()
        scheduler2.step()
        print(f"Rank {rank}, Epoch {epoch}, Loss {loss.item()}")

    if rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A script's loop through ddp_amp.loop, for the tests: a linear model on a fixed batch whose step 3 (of 5) has an
infinite loss, each step's outcome (stepped, the schedule's rate, the loss scale, the weights) and the number of
DDP's gradient all-reduces written by rank 0 to --out as JSON."""

import argparse
import json

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_amp import loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--overflow-at", type=int, default=3)
    parser.add_argument("--api", choices=["accumulate", "autocast"], default="accumulate",
                        help="the micro-steps inside accumulate(model), or under autocast(model) (earlier versions)")
    args = parser.parse_args()
    run = loop.setup()
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = run.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    allreduces = [0]

    def counted(state, bucket):  # DDP's own all-reduce, counted: one per bucket of a backward that reduces
        allreduces[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    if run.world_size > 1:
        model.register_comm_hook(None, counted)
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(run.device)
    steps = []
    for step in range(1, 6):
        for _ in run.accumulate(model) if args.api == "accumulate" else range(run.grad_accum):
            with run.autocast() if args.api == "accumulate" else run.autocast(model):
                loss = model(inputs).float().pow(2).mean()
            if step == args.overflow_at:
                loss = loss * float("inf")
            run.backward(loss, model)
        before = [p.detach().clone() for p in model.parameters()]
        stepped = run.step(optimizer, scheduler)
        steps.append({"stepped": stepped, "lr": scheduler.get_last_lr()[0], "scale": run.scaler.get_scale(),
                      "moved": any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))})
    if run.rank == 0:
        with open(args.out, "w") as out:
            json.dump({"precision": run.precision, "steps": steps, "skipped": run.skipped_steps,
                       "allreduces": allreduces[0]}, out)
    run.finish()


if __name__ == "__main__":
    main()

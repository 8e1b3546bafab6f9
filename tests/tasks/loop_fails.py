"""A script's loop through ddp_amp.loop that can fail where a test wants it: a linear regression, a report every
step, a checkpoint every 2 steps, model.pt at the end (as examples/own_loop.py writes it).

    --steps N        optimizer steps
    --step-s S       seconds of sleep per step (a run long enough to signal)
    --fail-at K      rank 1 raises ValueError at step K; 0: right after setup(), before any step
"""

import argparse
import os
import time

import torch
from torch import nn

from ddp_amp import loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=-1)
    args = parser.parse_args()
    run = loop.setup(checkpoint_every=2)
    failing = os.environ.get("RANK") == "1"
    if args.fail_at == 0 and failing:
        raise ValueError("fails before its first step")
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = run.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    start = run.restore(model=model, optimizer=optimizer)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)
    for step in range(start, args.steps):
        if step + 1 == args.fail_at and failing:
            raise ValueError(f"fails at step {step + 1}")
        with run.autocast(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
        run.backward(loss, model)
        run.step(optimizer)
        run.report(step + 1, loss=loss)
        if run.checkpoint_due(step + 1):
            run.save(step + 1)
        if run.should_stop(step + 1):
            break
        time.sleep(args.step_s)
    weights = run.full_state_dict(model)
    if run.rank == 0 and run.stopped_at is None:
        torch.save(weights, run.run_dir / "model.pt")
    run.finish()


if __name__ == "__main__":
    main()

"""The example this project grew from (tests/tasks/origin_ddp.py: DDP, autocast, a GradScaler, two schedulers
stepped back to back, no stop, no checkpoint), written with ddp_amp.loop: the same model, data and schedules, and
the precision, the skip-aware step, a stop agreed by every rank with a checkpoint and an exact resume from the
ddp-amp command line.

    ddp-amp spawn -n 2 examples/origin_loop.py --epochs 100
    ddp-amp spawn -n 2 --amp on --dtype fp16 --checkpoint-every 20 --resume auto examples/origin_loop.py
    torchrun --standalone --nproc-per-node 2 examples/origin_loop.py
"""

import argparse

import torch
import torch.nn as nn
import torch.optim as optim

from ddp_amp import loop


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()

    run = loop.setup()
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    model, optimizer = run.prepare(model, optim.SGD(model.parameters(), lr=0.01))
    scheduler1 = optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    scheduler2 = optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
    start = run.restore(model=model, optimizer=optimizer, scheduler1=scheduler1, scheduler2=scheduler2)
    loss_fn = nn.MSELoss()

    inputs = torch.randn(32, 10).to(run.device)
    targets = torch.randn(32, 10).to(run.device)
    for epoch in range(start, args.epochs):
        with run.autocast(model):
            loss = loss_fn(model(inputs).float(), targets)
        run.backward(loss, model)
        run.step(optimizer, scheduler1, scheduler2)  # both schedules skip a step fp16 skipped
        run.report(epoch + 1, loss=loss)
        if run.checkpoint_due(epoch + 1):
            run.save(epoch + 1)
        if run.should_stop(epoch + 1):
            break

    weights = run.full_state_dict(model)
    if run.rank == 0 and run.stopped_at is None:
        torch.save(weights, run.run_dir / "model.pt")
    run.finish()


if __name__ == "__main__":
    main()

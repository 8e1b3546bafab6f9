"""The peer model's training written with ddp_amp.loop (benchmarks/loop_step.py launches it): the wide MLP,
AdamW (fused, as the core's default), MSE, --batch-size per rank. After --warmup steps, each step's seconds; the
steps alternate in blocks of 5 between report() every step and no report, so that the report's cost is read
within one run. Rank 0 writes the figures to --out."""

import argparse
import json
import time

import torch
from tasks import WIDE, wide_regression

from ddp_amp import loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = loop.setup(log_every=1)
    torch.manual_seed(0)
    task = wide_regression()
    model, optimizer = run.prepare(task.model, torch.optim.AdamW(task.model.parameters(), lr=1e-3, fused=True))
    batches = run.loader(task.dataset, batch_size=args.batch_size).forever()
    silent, reporting = [], []
    for step in range(args.steps):
        started = time.perf_counter()
        inputs, targets = next(batches)
        with run.autocast():
            loss = task.loss_fn(model(inputs), targets)
        run.backward(loss, model)
        run.step(optimizer)
        report = (step // 5) % 2 == 1
        if report:
            run.report(step + 1, loss=loss)
        run.should_stop(step + 1)
        if step >= args.warmup:
            (reporting if report else silent).append(time.perf_counter() - started)
    if run.rank == 0:
        with open(args.out, "w") as out:
            json.dump({"silent_step_s": silent, "reporting_step_s": reporting, "world_size": run.world_size,
                       "batch_size": args.batch_size, "widths": WIDE}, out)
    run.finish()


if __name__ == "__main__":
    main()
